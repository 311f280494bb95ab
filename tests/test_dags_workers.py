"""Graphs against real worker processes: a worker killed between a
dependency's end and its dependents' start loses no release, and the
concurrent ends of a fan-in's dependencies release it once."""

from __future__ import annotations

import os
import time

import pytest

import everystep
from everystep import dags
from tests.apps.dag_workflows import mark, wait_file
from tests.support.processes import wait_for

IMPORTS = ("tests.apps.dag_workflows",)


def lines(path: str) -> list[str]:
    return open(path).read().split() if os.path.exists(path) else []


@pytest.mark.parametrize("kill_at", ["with the end in flight", "once the end committed"])
def test_a_worker_killed_between_an_end_and_its_dependents_start_loses_no_release(db, marks, start_worker, kill_at):
    go, out = f"{marks}/go", f"{marks}/out"
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("killed")
        root = g.add(wait_file, go, key="root")
        after = [g.add(mark, out, f"after{i}", key=f"after{i}", depends_on=[root]) for i in range(3)]
        g.seal()
    # It runs the root only: killed before or after the end, it has started no dependent.
    worker = start_worker("w1", imports=IMPORTS, threads=1, workflows=(db.run(root.run_id)["name"],))
    wait_for(lambda: db.run(root.run_id)["status"] == "running", 20, what="the root running")
    open(go, "w").close()
    if kill_at == "once the end committed":
        wait_for(lambda: db.run(root.run_id)["status"] == "completed", 20, what="the root completed")
    worker.kill()  # SIGKILL
    released = db.value("SELECT count(*) FROM everystep_workflow WHERE id = ANY(%s)"
                        " AND waiting_on IS DISTINCT FROM 'dependencies'", ([m.run_id for m in after],))
    if db.run(root.run_id)["status"] == "completed":
        assert released == 3  # released with the end, in its transaction
    else:
        assert released == 0
    start_worker("w1", imports=IMPORTS, threads=2)  # its catchup re-runs what the killed one held
    wait_for(lambda: all(db.run(m.run_id)["status"] == "completed" for m in after), 30, what="the dependents")
    assert sorted(lines(out)) == ["after0", "after1", "after2"]
    assert db.run(root.run_id)["status"] == "completed"


def test_concurrent_ends_of_a_fan_ins_dependencies_release_it_once(db, marks, start_worker):
    go, out = f"{marks}/go", f"{marks}/out"
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("fan-in")
        deps = [g.add(wait_file, go, key=f"dep{i}") for i in range(8)]
        pairs = [g.add(mark, out, f"pair{i}", key=f"pair{i}", depends_on=deps[2 * i:2 * i + 2]) for i in range(4)]
        every = g.add(mark, out, "all", key="all", depends_on=deps)
        g.seal()
    start_worker("w1", imports=IMPORTS, threads=4)
    start_worker("w2", imports=IMPORTS, threads=4)
    wait_for(lambda: db.value("SELECT count(*) FROM everystep_workflow WHERE status = 'running'") == 8, 30,
             what="the eight dependencies running in two workers")
    assert db.value("SELECT count(DISTINCT claimed_by) FROM everystep_workflow WHERE status = 'running'") == 2
    open(go, "w").close()
    wait_for(lambda: all(db.run(m.run_id)["status"] == "completed" for m in [*pairs, every]), 30, what="the fan-ins")
    time.sleep(0.5)  # a second release would run one again
    assert sorted(lines(out)) == ["all", "pair0", "pair1", "pair2", "pair3"]
    with db.connect() as conn:
        assert dags.get("fan-in", conn=conn).status == "completed"


def test_the_supervisor_counts_graphs_by_status_and_releases(db, marks, supervisors):
    from tests.support.supervisor_process import config  # noqa: PLC0415
    from tests.test_supervisor_metrics import scrape_when, total  # noqa: PLC0415

    out = f"{marks}/out"
    with db.connect() as conn, everystep.transaction(conn):
        g = dags.create("metrics")
        root = g.add(mark, out, "root", key="root")
        g.add(mark, out, "a", key="a", depends_on=[root])
        g.add(mark, out, "b", key="b", depends_on=[root])
        g.seal()
        dags.create("still-open").add(mark, out, "x", key="x")
    sup = supervisors(config(db.url, "dagm", imports=list(IMPORTS)))
    # The root's worker counts its releases once its end has committed: the
    # members may complete in the other worker before that count is made.
    found = scrape_when(sup, lambda f: total(f, "everystep_dags", status="completed") == 1
                        and total(f, "everystep_dag_releases_total") >= 2, what="a completed graph and its releases")
    assert total(found, "everystep_dags", status="open") == 1
    assert total(found, "everystep_dags", status="failed") == 0
    assert total(found, "everystep_dag_releases_total") == 2
