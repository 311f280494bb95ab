"""Starting a run by the workflow's name (`module.qualname`), for a producer
that does not import the workflow's code: schedule(), aschedule() and
schedule_many() check the name's syntax and the arguments' encoding, write
the run, and a worker that has the code runs it."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

import everystep
from everystep import EverystepError, WorkflowArgumentsError
from everystep.testing import assert_ended, drain, server
from tests.apps import testing_flows as flows

PAY = "tests.apps.testing_flows.pay"


def names_and_args(conn) -> list:
    return conn.execute("SELECT name, args FROM everystep_workflow ORDER BY created_at").fetchall()


def test_a_run_scheduled_by_name_is_run_by_the_worker_that_knows_it(everystep_db):
    with everystep.transaction(everystep_db):
        run = everystep.schedule(PAY, "ann")
        same = everystep.schedule("tests.apps.testing_flows:pay", "bob")  # as the CLI spells it
    assert (run.name, same.name) == (PAY, PAY)
    assert drain() == {"completed": 2}
    assert assert_ended(run.id).result == "ch_ann_12"
    assert flows.calls["order bob"] == 1


def test_a_name_no_code_here_defines_is_written_unchecked(everystep_db):
    with everystep.transaction(everystep_db):
        run = everystep.schedule("billing.flows.provision_vm", "vm-1", {"cpus": 2})
        many = everystep.schedule_many("billing.flows.provision_vm", [("vm-2",), ("vm-3", 4, 5)],
                                       idempotency_keys=["k2", None])
    assert run.created and [each.name for each in many] == ["billing.flows.provision_vm"] * 2
    assert names_and_args(everystep_db) == [("billing.flows.provision_vm", ["vm-1", {"cpus": 2}]),
                                            ("billing.flows.provision_vm", ["vm-2"]),
                                            ("billing.flows.provision_vm", ["vm-3", 4, 5])]


@pytest.mark.parametrize("name", ["provision_vm", "", "myapp..flows", "my app.flows", "myapp.flows.", ".flows",
                                  "myapp.1flows", "myapp/flows.x", "a:b:c", "x." * 200 + "y"])
def test_a_bad_name_is_refused_with_nothing_written(everystep_db, name):
    with pytest.raises(EverystepError, match=r"takes an @workflow function or the workflow's name, module\."
                                             "qualname"):
        with everystep.transaction(everystep_db):
            everystep.schedule(name, 1)
    assert names_and_args(everystep_db) == []


def test_arguments_are_checked_as_far_as_the_producer_can(everystep_db):
    with pytest.raises(EverystepError, match="cannot store a value of type builtins.object"):
        with everystep.transaction(everystep_db):
            everystep.schedule("billing.flows.provision_vm", object())
    with pytest.raises(WorkflowArgumentsError, match="given 3 arguments"):  # registered here: its signature too
        with everystep.transaction(everystep_db):
            everystep.schedule(PAY, 1, 2, 3)
    with pytest.raises(EverystepError, match="script run as __main__"):
        with everystep.transaction(everystep_db):
            everystep.schedule("__main__.provision_vm")
    with pytest.raises(TypeError, match="takes an @workflow function or its name"):
        with everystep.transaction(everystep_db):
            everystep.schedule(42)
    assert names_and_args(everystep_db) == []


async def _aschedule_by_name(url: str) -> everystep.ScheduledRun:
    async with await psycopg.AsyncConnection.connect(url) as aconn:
        async with everystep.atransaction(aconn):
            run = await everystep.aschedule(PAY, "cid")
            await everystep.aschedule_many(PAY, [("dee",)])
    return run


def test_aschedule_by_name(everystep_db):
    run = asyncio.run(_aschedule_by_name(server.resolve(everystep_db).url))
    assert drain() == {"completed": 2}
    assert assert_ended(run.id).result == "ch_cid_12"
