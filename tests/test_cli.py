"""The operations CLI, run as a real subprocess against a real PostgreSQL."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

import everystep
import everystep.db
from everystep import schedule
from tests.apps import cli_workflows
from tests.apps.cli_workflows import Crash, fails, greet, pays, stops
from tests.support.processes import WorkerProcess, console_script, wait_for

ROOT = Path(__file__).resolve().parent.parent
UNREACHABLE = "host=127.0.0.1 port=1 user=postgres dbname=test connect_timeout=3"
CREATED = "2026-01-02 03:04:05+00"
COMPLETED = "2026-01-02 03:04:06+00"


@pytest.fixture(autouse=True)
def _reset():
    cli_workflows.calls.clear()


def everystep_cli(*args: str, env: dict | None = None, cwd: Path = ROOT,
                  command: tuple = (sys.executable, "-m", "everystep")) -> subprocess.CompletedProcess:
    """Run the CLI; EVERYSTEP_DATABASE_URL comes only from `env`."""
    base = {k: v for k, v in os.environ.items() if k != "EVERYSTEP_DATABASE_URL"}
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd,
                          env={**base, **(env or {})}, timeout=60)


def cli(db, *args: str) -> subprocess.CompletedProcess:
    return everystep_cli("--database-url", db.url, *args)


def ok(result: subprocess.CompletedProcess) -> str:
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    return result.stdout


def error_line(result: subprocess.CompletedProcess, code: int) -> str:
    """The one line a failed command writes; nothing on stdout, no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), result.stderr
    return result.stderr.rstrip("\n")


def schedule_one(db, fn, *args, **kw):
    with db.connect() as conn, everystep.transaction(conn):
        return schedule(fn, *args, **kw)


def set_times(db, run_id, created=CREATED, completed=COMPLETED):
    """Fix a run's timestamps, so that output can be compared exactly."""
    execute(db, "UPDATE everystep_workflow SET created_at = %s,"
             " completed_at = CASE WHEN completed_at IS NULL THEN NULL ELSE %s::timestamptz END WHERE id = %s",
             (created, completed, run_id))


def execute(db, statement, params=()):
    with db.connect() as conn:
        conn.execute(statement, params)


def claim(db, runner):
    with db.connect() as conn:
        return everystep.db.claim(conn, runner, 100)


def blocked_run(db):
    run = schedule_one(db, pays, 10)
    with pytest.raises(Crash):
        db.run_pending(runner="w1")
    db.resume_held("w1")
    assert db.run(run.id)["status"] == "blocked"
    return run


def status(db, run_id):
    return db.value("SELECT status FROM everystep_workflow WHERE id = %s", (run_id,))


def workflow_count(db):
    return db.value("SELECT count(*) FROM everystep_workflow")


# ---------------------------------------------------------------- migrate


def test_migrate_applies_to_a_new_schema_and_then_has_nothing_to_apply(db, server_url):
    assert ok(cli(db, "migrate")) == "nothing to apply: the schema is up to date\n"
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        try:
            url = conninfo.make_conninfo(server_url, options=f"-c search_path={schema}")
            applied = ok(everystep_cli("--database-url", url, "migrate"))
            shipped = sorted(path.stem for path in (ROOT / "everystep" / "migrations").glob("*.sql"))
            assert shipped[:3] == ["0001_initial", "0002_schedules", "0003_execution_token"]
            assert applied == f"applied {', '.join(shipped)}\n"
        finally:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


# ---------------------------------------------------------------- runs list


def three_runs(db):
    """A completed and a failed run, then a scheduled one, with fixed times."""
    done = schedule_one(db, greet, "ada")
    failed = schedule_one(db, fails, 5)
    db.run_pending()
    waiting = schedule_one(db, greet, "bob")
    set_times(db, done.id, "2026-01-02 03:04:05+00", "2026-01-02 03:04:06+00")
    set_times(db, failed.id, "2026-01-02 04:00:00+00", "2026-01-02 04:00:01+00")
    set_times(db, waiting.id, "2026-01-02 05:00:00+00")
    return done.id, failed.id, waiting.id


def test_runs_list_is_a_table_newest_first(db):
    done, failed, waiting = three_runs(db)
    assert ok(cli(db, "runs", "list")) == (
        "ID                                    STATUS     WORKFLOW                        CREATED"
        "               ENDED                 CLAIMED BY\n"
        f"{waiting}  scheduled  tests.apps.cli_workflows.greet  2026-01-02T05:00:00Z  -                     -\n"
        f"{failed}  failed     tests.apps.cli_workflows.fails  2026-01-02T04:00:00Z  2026-01-02T04:00:01Z"
        "  test-runner\n"
        f"{done}  completed  tests.apps.cli_workflows.greet  2026-01-02T03:04:05Z  2026-01-02T03:04:06Z  test-runner\n"
    )


def first_column(output: str) -> list[str]:
    return [line.split()[0] for line in output.splitlines()[1:]]


def test_runs_list_filters_by_status_and_workflow_and_limits(db):
    done, failed, waiting = three_runs(db)
    assert first_column(ok(cli(db, "runs", "list", "--status", "failed"))) == [str(failed)]
    greets = [str(waiting), str(done)]
    assert first_column(ok(cli(db, "runs", "list", "--workflow", "tests.apps.cli_workflows.greet"))) == greets
    assert first_column(ok(cli(db, "runs", "list", "--workflow", "tests.apps.cli_workflows:greet"))) == greets
    assert "--workflow greet: no run has that name and no module defines a workflow of it" in error_line(
        cli(db, "runs", "list", "--workflow", "greet"), 2)
    # A workflow the code defines, with no run (yet): an empty list.
    assert ok(cli(db, "runs", "list", "--workflow", "tests.apps.cli_workflows.describe")) == "no runs\n"
    limited = ok(cli(db, "runs", "list", "--limit", "2")).splitlines()
    assert [line.split()[0] for line in limited[1:3]] == [str(waiting), str(failed)]
    assert limited[3:] == ["(the newest 2; more runs match: raise --limit)"]
    assert ok(cli(db, "runs", "list", "--status", "blocked")) == "no runs\n"


def test_runs_list_json(db):
    done, failed, waiting = three_runs(db)
    listed = json.loads(ok(cli(db, "runs", "list", "--json", "--limit", "2")))
    assert listed == [
        {"id": str(waiting), "name": "tests.apps.cli_workflows.greet", "status": "scheduled", "idempotency_key": None,
         "claimed_by": None, "created_at": "2026-01-02T05:00:00+00:00", "completed_at": None},
        {"id": str(failed), "name": "tests.apps.cli_workflows.fails", "status": "failed", "idempotency_key": None,
         "claimed_by": "test-runner", "created_at": "2026-01-02T04:00:00+00:00",
         "completed_at": "2026-01-02T04:00:01+00:00"},
    ]
    assert json.loads(ok(cli(db, "runs", "list", "--json", "--status", "running"))) == []


@pytest.mark.parametrize("args, message", [
    (["--status", "done"], "argument --status: invalid choice: 'done' (choose from 'scheduled', 'waiting',"
                           " 'running', 'completed', 'failed', 'stopped', 'blocked', 'cancelled')"),
    (["--limit", "0"], "argument --limit: expected a whole number of at least 1, not '0'"),
    (["--limit", "ten"], "argument --limit: expected a whole number of at least 1, not 'ten'"),
])
def test_runs_list_refuses_bad_options(db, args, message):
    line = error_line(cli(db, "runs", "list", *args), 2)
    assert line == f"everystep runs list: {message} (see everystep runs list --help)"


# ---------------------------------------------------------------- runs show


def test_runs_show_prints_the_run_and_its_steps(db):
    run = schedule_one(db, greet, "ada", idempotency_key="order:1")
    db.run_pending()
    set_times(db, run.id)
    assert ok(cli(db, "runs", "show", str(run.id))) == (
        f"run             {run.id}\n"
        "workflow        tests.apps.cli_workflows.greet\n"
        "status          completed\n"
        "claimed by      test-runner\n"
        "idempotency key order:1\n"
        "created         2026-01-02T03:04:05Z\n"
        "ended           2026-01-02T03:04:06Z\n"
        'args            ["ada"]\n'
        'result          "hello ADA"\n'
        "\n"
        "STEP  STATUS  FUNCTION                        ARGS     RESULT OR ERROR\n"
        '1     done    tests.apps.cli_workflows.shout  ["ada"]  "ADA"\n'
    )


def test_runs_show_prints_errors_and_how_to_resolve_a_blocked_run(db):
    failed = schedule_one(db, fails, 5)
    stopped = schedule_one(db, stops, 7)
    db.run_pending()
    blocked = blocked_run(db)

    out = ok(cli(db, "runs", "show", str(failed.id))).splitlines()
    assert "error           tests.apps.cli_workflows.Declined: declined 5" in out
    assert out[-1] == ("1     failed  tests.apps.cli_workflows.decline  [5]"
                       "   tests.apps.cli_workflows.Declined: declined 5")
    assert not any(line.startswith("result") for line in out)

    out = ok(cli(db, "runs", "show", str(stopped.id))).splitlines()
    assert ('error           everystep.errors.Terminal: handed to a human (args: ["handed to a human",'
            ' {"order": 7}])') in out

    out = ok(cli(db, "runs", "show", str(blocked.id))).splitlines()
    assert "status          blocked" in out
    assert "1     started  tests.apps.cli_workflows.send_money  [10]  (started; outcome unknown)" in out
    assert out[-1] == (f"blocked on step 1: resolve it with `everystep resolve-step {blocked.id} 1` and"
                       " --result JSON (it happened), --error MSG (it happened and failed) or --discard (it did not)")


def test_runs_show_of_a_run_without_steps(db):
    run = schedule_one(db, greet, "ada")
    out = ok(cli(db, "runs", "show", str(run.id)))
    assert out.endswith('args            ["ada"]\n\nno steps recorded\n')


def test_runs_show_json(db):
    run = schedule_one(db, greet, "ada")
    db.run_pending()
    set_times(db, run.id)
    shown = json.loads(ok(cli(db, "runs", "show", "--json", str(run.id))))
    step_row_id = shown["steps"][0].pop("id")
    assert isinstance(step_row_id, int)
    started_at, finished_at = shown["steps"][0].pop("started_at"), shown["steps"][0].pop("finished_at")
    assert datetime.datetime.fromisoformat(started_at) <= datetime.datetime.fromisoformat(finished_at)
    assert datetime.datetime.fromisoformat(shown.pop("due_at"))  # when it became claimable: its insert's time
    assert shown == {
        "id": str(run.id), "name": "tests.apps.cli_workflows.greet", "args": ["ada"], "idempotency_key": None,
        "status": "completed", "claimed_by": "test-runner", "result": "hello ADA", "error": None,
        "created_at": "2026-01-02T03:04:05+00:00", "completed_at": "2026-01-02T03:04:06+00:00",
        "cancel_requested_at": None, "cancel_reason": None, "parent_id": None, "deadline_at": None, "priority": 0,
        "concurrency_key": None,
        "steps": [{"step_id": "1", "name": "tests.apps.cli_workflows.shout", "args": ["ada"], "kwargs": {},
                   "status": "done", "result": "ADA", "error": None, "attempts": None}],
        "children": [], "messages": [], "events": [],
    }


def test_runs_show_refuses_an_unknown_or_malformed_id(db):
    unknown = uuid.uuid4()
    assert error_line(cli(db, "runs", "show", str(unknown)), 2) == f"everystep: no run {unknown}"
    assert error_line(cli(db, "runs", "show", "42"), 2) == (
        "everystep runs show: argument RUN: '42' is not a run id (a run id is a UUID)"
        " (see everystep runs show --help)")


# ---------------------------------------------------------------- resolve-step


@pytest.mark.parametrize("how, printed, step_after, result, sends", [
    (["--result", '"confirmed by bank"'], 'recorded as done with the result "confirmed by bank"', ["done"],
     "confirmed by bank", 1),
    (["--result", "null"], "recorded as done with the result null", ["done"], None, 1),
    (["--error", "bank rejected it"], "recorded as failed with the error 'bank rejected it'", ["failed"],
     "failed: bank rejected it", 1),
    (["--discard"], "discarded: the step will run again", [], "sent 10", 2),
])
def test_resolving_a_blocked_run_lets_it_complete(db, how, printed, step_after, result, sends):
    run = blocked_run(db)
    out = ok(cli(db, "resolve-step", str(run.id), "1", *how))
    assert out == f"step '1' of run {run.id} {printed}; the run is scheduled again\n"
    assert status(db, run.id) == "scheduled"
    assert [s["status"] for s in db.steps(run.id)] == step_after
    db.run_pending()
    row = db.run(run.id)
    assert (row["status"], row["result"]) == ("completed", result)
    assert cli_workflows.calls["send_money"] == sends  # the effect ran again only when discarded


def test_resolve_refuses_what_is_not_a_blocked_runs_started_step(db):
    blocked = blocked_run(db)
    done = schedule_one(db, greet, "ada")
    db.run_pending()
    unknown = uuid.uuid4()
    assert error_line(cli(db, "resolve-step", str(done.id), "1", "--discard"), 1) == (
        f"everystep: run {done.id} is completed, not blocked; only a blocked run can be resolved")
    assert error_line(cli(db, "resolve-step", str(blocked.id), "9", "--discard"), 2) == (
        f"everystep: run {blocked.id} has no step '9'")
    assert error_line(cli(db, "resolve-step", str(unknown), "1", "--discard"), 2) == f"everystep: no run {unknown}"
    execute(db, "INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status)"
             " VALUES (%s, '2', 'x', '[]', '{}', 'done')", (blocked.id,))
    assert error_line(cli(db, "resolve-step", str(blocked.id), "2", "--result", "1"), 1) == (
        f"everystep: step '2' of run {blocked.id} is done; only its started step can be resolved")
    assert status(db, blocked.id) == "blocked"
    assert [s["status"] for s in db.steps(blocked.id)] == ["started", "done"]


@pytest.mark.parametrize("args, message", [
    (["--result", "{oops"], "argument --result: '{oops' is not valid JSON"
                            " (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    (["--result", "NaN"], "argument --result: 'NaN' is not valid JSON (NaN is not JSON)"),
    (["--result", '{"$es": "date", "v": "soon"}'],
     "argument --result: '{\"$es\": \"date\", \"v\": \"soon\"}' is not a valid everystep value"
     " (Invalid isoformat string: 'soon')"),
    (["--result", "1", "--discard"], "argument --discard: not allowed with argument --result"),
    (["--result", "null", "--discard"], "argument --discard: not allowed with argument --result"),
    ([], "one of the arguments --result --error --discard is required"),
])
def test_resolve_refuses_bad_input_and_writes_nothing(db, args, message):
    run = blocked_run(db)
    line = error_line(cli(db, "resolve-step", str(run.id), "1", *args), 2)
    assert line == f"everystep resolve-step: {message} (see everystep resolve-step --help)"
    assert status(db, run.id) == "blocked"
    assert [s["status"] for s in db.steps(run.id)] == ["started"]


# ---------------------------------------------------------------- requeue


def test_requeue_puts_back_a_run_whose_claimer_is_dead(db):
    run = schedule_one(db, greet, "ada")
    claim(db, "worker-dead")
    assert ok(cli(db, "requeue", str(run.id))) == f"requeued run {run.id} (its claimer worker-dead is dead)\n"
    row = db.run(run.id)
    assert (row["status"], row["claimed_by"]) == ("scheduled", None)
    assert db.run_pending() == {run.id: "completed"}


def test_requeue_refuses_a_run_whose_claimer_holds_its_lock(db):
    run = schedule_one(db, greet, "ada")
    claim(db, "worker-alive")
    with db.connect() as holder:
        assert everystep.db.try_lock(holder, "worker-alive")
        assert error_line(cli(db, "requeue", str(run.id)), 1) == (
            f"everystep: run {run.id} is running on worker-alive, which holds its lock: the claimer is alive")
        assert (status(db, run.id), db.run(run.id)["claimed_by"]) == ("running", "worker-alive")
    # The same run, once its claimer is gone (its session ended, so its lock is free).
    assert ok(cli(db, "requeue", str(run.id))) == f"requeued run {run.id} (its claimer worker-alive is dead)\n"
    assert status(db, run.id) == "scheduled"


def test_requeue_releases_the_dead_claimers_lock(db):
    runs = [schedule_one(db, greet, name).id for name in ("a", "b")]
    claim(db, "worker-dead")
    out = ok(cli(db, "requeue", str(runs[0]), str(runs[1]), str(runs[0])))
    assert out.splitlines() == [f"requeued run {run} (its claimer worker-dead is dead)" for run in runs]
    with db.connect() as conn:
        assert everystep.db.try_lock(conn, "worker-dead")


def test_requeue_puts_back_a_running_run_without_a_claimer(db):
    run = schedule_one(db, greet, "ada")
    execute(db, "UPDATE everystep_workflow SET status = 'running' WHERE id = %s", (run.id,))
    assert ok(cli(db, "requeue", str(run.id))) == f"requeued run {run.id} (it had no claimer)\n"
    assert status(db, run.id) == "scheduled"


def test_requeue_refuses_runs_that_are_not_running(db):
    done = schedule_one(db, greet, "ada")
    failed = schedule_one(db, fails, 1)
    stopped = schedule_one(db, stops, 1)
    db.run_pending()
    blocked = blocked_run(db)
    waiting = schedule_one(db, greet, "bob")
    for run, why in [
        (done.id, "is completed: a finished run is never requeued; schedule it again"),
        (failed.id, "is failed: a finished run is never requeued; schedule it again"),
        (stopped.id, "is stopped: a finished run is never requeued; schedule it again"),
        (waiting.id, "is scheduled: it needs nothing, a worker will claim it"),
        (blocked.id, "is blocked: resolve its started step with `everystep resolve-step`"),
    ]:
        assert error_line(cli(db, "requeue", str(run)), 1) == f"everystep: run {run} {why}"
    unknown = uuid.uuid4()
    assert error_line(cli(db, "requeue", str(unknown)), 2) == f"everystep: no run {unknown}"
    assert error_line(cli(db, "requeue", "not-a-run"), 2) == (
        "everystep requeue: argument RUN: 'not-a-run' is not a run id (a run id is a UUID)"
        " (see everystep requeue --help)")


def test_requeue_of_several_runs_requeues_all_or_nothing(db):
    orphan = schedule_one(db, greet, "ada")
    claim(db, "worker-dead")
    done = schedule_one(db, greet, "bob")
    db.run_pending()
    assert error_line(cli(db, "requeue", str(orphan.id), str(done.id)), 1) == (
        f"everystep: run {done.id} is completed: a finished run is never requeued; schedule it again;"
        " nothing was requeued")
    assert status(db, orphan.id) == "running"
    assert error_line(cli(db, "requeue", str(orphan.id), str(uuid.UUID(int=1))), 2) == (
        f"everystep: no run {uuid.UUID(int=1)}")
    assert status(db, orphan.id) == "running"


# ---------------------------------------------------------------- reschedule


def test_reschedule_schedules_a_new_run_of_each_with_the_same_args(db):
    done = schedule_one(db, greet, "ada")
    failed = schedule_one(db, fails, 7)
    db.run_pending()
    out = ok(cli(db, "reschedule", str(done.id), str(failed.id), str(done.id)))
    again = dict(db.query("SELECT args::text, id FROM everystep_workflow WHERE status = 'scheduled'"))
    greeting, failing = again['["ada"]'], again["[7]"]  # the same args, new runs
    assert out.splitlines() == [f"scheduled run {done.id} again: new run {greeting}",
                                f"scheduled run {failed.id} again: new run {failing}"]
    rows = db.query("SELECT source, action, run_id, details FROM everystep_audit ORDER BY id")
    assert rows == [("cli", "schedule-again", greeting, {"from_run": str(done.id)}),
                    ("cli", "schedule-again", failing, {"from_run": str(failed.id)})]
    unknown = uuid.uuid4()
    assert error_line(cli(db, "reschedule", str(done.id), str(unknown)), 2) == f"everystep: no run {unknown}"
    assert workflow_count(db) == 4  # all or nothing


# ---------------------------------------------------------------- prune


def test_prune_deletes_old_terminal_runs_only_with_their_steps(db):
    old = {"completed": schedule_one(db, greet, "a").id, "failed": schedule_one(db, fails, 1).id,
           "stopped": schedule_one(db, stops, 1).id}
    recent = schedule_one(db, greet, "recent").id
    db.run_pending()
    old["blocked"] = blocked_run(db).id
    old["running"] = schedule_one(db, greet, "r").id
    claim(db, "worker-dead")
    old["scheduled"] = schedule_one(db, greet, "s").id
    # All of them 40 days old, even the non-terminal ones' completed_at: the status decides.
    execute(db, "UPDATE everystep_workflow SET created_at = now() - interval '40 days',"
             " completed_at = now() - interval '40 days' WHERE id = ANY(%s)", (list(old.values()),))
    execute(db, "UPDATE everystep_workflow SET created_at = now() - interval '40 days',"
             " completed_at = now() - interval '29 days' WHERE id = %s", (recent,))
    steps_before = db.value("SELECT count(*) FROM everystep_step")

    assert ok(cli(db, "prune", "--older-than", "30", "--dry-run")) == (
        "would delete 3 runs completed, failed, stopped or cancelled more than 30 days ago, with their steps"
        " (dry run: nothing deleted)\n")
    assert workflow_count(db) == 7 and db.value("SELECT count(*) FROM everystep_step") == steps_before

    assert ok(cli(db, "prune", "--older-than", "30")) == (
        "deleted 3 runs completed, failed, stopped or cancelled more than 30 days ago, with their steps\n")
    kept = {row[0] for row in db.query("SELECT id FROM everystep_workflow")}
    assert kept == {recent, old["blocked"], old["running"], old["scheduled"]}
    pruned = [old["completed"], old["failed"], old["stopped"]]
    assert db.value("SELECT count(*) FROM everystep_step WHERE workflow_id = ANY(%s)", (pruned,)) == 0
    assert [s["status"] for s in db.steps(old["blocked"])] == ["started"]
    assert [s["step_id"] for s in db.steps(recent)] == ["1"]

    assert ok(cli(db, "prune", "--older-than", "1")) == (
        "deleted 1 run completed, failed, stopped or cancelled more than 1 day ago, with their steps\n")
    assert ok(cli(db, "prune", "--older-than", "1")) == (
        "deleted 0 runs completed, failed, stopped or cancelled more than 1 day ago, with their steps\n")
    assert workflow_count(db) == 3


def test_prune_deletes_more_runs_than_one_batch(db):
    execute(db, "INSERT INTO everystep_workflow (id, name, args, status, created_at, completed_at)"
             " SELECT gen_random_uuid(), 'tests.apps.cli_workflows.greet', '[]', 'completed',"
             " now() - interval '9 days', now() - interval '8 days' FROM generate_series(1, 2500)")
    assert ok(cli(db, "prune", "--older-than", "7")) == (
        "deleted 2500 runs completed, failed, stopped or cancelled more than 7 days ago, with their steps\n")
    assert workflow_count(db) == 0


@pytest.mark.parametrize("days", ["0", "-3", "1.5", "week", "36501"])
def test_prune_refuses_a_bound_that_is_not_a_positive_number_of_days(db, days):
    done = schedule_one(db, greet, "a")
    db.run_pending()
    execute(db, "UPDATE everystep_workflow SET created_at = now() - interval '40 days',"
             " completed_at = now() - interval '40 days'")
    line = error_line(cli(db, "prune", f"--older-than={days}"), 2)
    assert line == (f"everystep prune: argument --older-than: expected a whole number from 1 to 36500,"
                    f" not {days!r} (see everystep prune --help)")
    assert status(db, done.id) == "completed"


# ---------------------------------------------------------------- schedule


def scheduled_id(output: str, prefix: str = "created run ") -> uuid.UUID:
    assert output.startswith(prefix), output
    return uuid.UUID(output[len(prefix):].split()[0])


def test_schedule_creates_a_run_that_workers_execute(db):
    out = ok(cli(db, "schedule", "tests.apps.cli_workflows:greet", '"ada"'))
    run_id = scheduled_id(out)
    assert out == f"created run {run_id} of tests.apps.cli_workflows.greet\n"
    row = db.run(run_id)
    assert (row["status"], row["args"], row["idempotency_key"]) == ("scheduled", ["ada"], None)
    assert db.run_pending() == {run_id: "completed"}
    assert db.run(run_id)["result"] == "hello ADA"


def test_schedule_decodes_each_argument_as_extended_json(db):
    out = ok(cli(db, "schedule", "tests.apps.cli_workflows:describe",
                 '{"$es": "date", "v": "2026-01-02"}', "[1, 2]", '{"a": null}', "-5", "1.5", "true"))
    run_id = scheduled_id(out)
    assert db.run(run_id)["args"] == [{"$es": "date", "v": "2026-01-02"}, [1, 2], {"a": None}, -5, 1.5, True]
    db.run_pending()
    assert db.run(run_id)["result"] == ["date", "list", "dict", "int", "float", "bool"]
    assert scheduled_id(ok(cli(db, "schedule", "tests.apps.cli_workflows:describe")))


def test_schedule_with_an_idempotency_key_returns_the_existing_run(db):
    first = scheduled_id(ok(cli(db, "schedule", "tests.apps.cli_workflows:greet", '"ada"', "--idempotency-key", "k1")))
    again = ok(cli(db, "schedule", "--idempotency-key", "k1", "tests.apps.cli_workflows:greet", '"ada"'))
    assert again == (f"existing run {first} of tests.apps.cli_workflows.greet has the idempotency key 'k1';"
                     " nothing scheduled\n")
    # The key reused with other arguments: the existing run will not do what was asked.
    assert error_line(cli(db, "schedule", "--idempotency-key", "k1", "tests.apps.cli_workflows:greet", '"bob"'),
                      2) == (f"everystep: existing run {first} of tests.apps.cli_workflows.greet has the idempotency"
                             """ key 'k1' with other arguments (["ada"], not ["bob"]); nothing scheduled""")
    assert workflow_count(db) == 1
    assert db.run(first)["idempotency_key"] == "k1"


@pytest.mark.parametrize("args, message", [
    (["tests.apps.cli_workflows.greet"],
     "everystep: expected MODULE:FUNC (e.g. myapp.workflows:provision_vm), not 'tests.apps.cli_workflows.greet'"),
    (["tests.no_such_module:greet"],
     "everystep: cannot import tests.no_such_module: ModuleNotFoundError: No module named 'tests.no_such_module'"),
    (["tests.apps.cli_workflows:nope"], "everystep: module tests.apps.cli_workflows has no 'nope'"),
    (["tests.apps.cli_workflows:not_a_workflow"],
     "everystep: tests.apps.cli_workflows:not_a_workflow is not an @workflow"),
    (["tests.apps.cli_workflows:shout", '"x"'], "everystep: tests.apps.cli_workflows:shout is not an @workflow"),
    (["tests.apps.cli_workflows:greet", "ada"],
     "everystep schedule: argument JSON: 'ada' is not valid JSON (Expecting value: line 1 column 1 (char 0))"
     " (see everystep schedule --help)"),
    (["tests.apps.cli_workflows:greet", '{"$es": "nope", "v": 1}'],
     "everystep schedule: argument JSON: '{\"$es\": \"nope\", \"v\": 1}' is not a valid everystep value"
     " (unknown stored type tag 'nope') (see everystep schedule --help)"),
    (["tests.apps.cli_workflows:greet", '"x"', "--idempotency-key", "k" * 256],
     "everystep: idempotency_key must be a string of at most 255 characters"),
    (["tests.apps.cli_workflows:greet", '"nul \\u0000"'],
     "everystep: cannot store the string 'nul \\x00'...: it contains a NUL character"),
    (["tests.apps.cli_workflows:greet"],
     "everystep: tests.apps.cli_workflows:greet(name): missing a required argument: 'name' (given 0 values)"),
    (["tests.apps.cli_workflows:greet", '"ada"', '"bob"'],
     "everystep: tests.apps.cli_workflows:greet(name): too many positional arguments (given 2 values)"),
])
def test_schedule_refuses_bad_input_and_writes_nothing(db, args, message):
    assert error_line(cli(db, "schedule", *args), 2) == message
    assert workflow_count(db) == 0


def test_schedule_reports_a_module_that_fails_to_import(db, tmp_path):
    (tmp_path / "broken_flows.py").write_text("raise RuntimeError('missing setting\\nsecond line')\n")
    result = everystep_cli("--database-url", db.url, "schedule", "broken_flows:anything", cwd=tmp_path)
    assert error_line(result, 2) == "everystep: cannot import broken_flows: RuntimeError: missing setting"


def test_the_everystep_command_imports_workflows_from_the_current_directory(db, tmp_path):
    # The console script, not `python -m`, which puts the current directory on sys.path by itself.
    script = console_script("everystep")
    (tmp_path / "ops_flows.py").write_text("import everystep\n\n@everystep.workflow\ndef nightly():\n    return 1\n")
    out = ok(everystep_cli("--database-url", db.url, "schedule", "ops_flows:nightly", cwd=tmp_path,
                           command=(script,)))
    assert db.run(scheduled_id(out))["name"] == "ops_flows.nightly"

    worker = WorkerProcess(db.url, "ops-w", tmp_path / "logs", imports=("ops_flows",), command=(script,),
                           cwd=tmp_path)
    try:
        wait_for(lambda: db.run(scheduled_id(out))["status"] == "completed", what="the run done by the worker")
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0
    finally:
        worker.close()
    assert "cannot import" not in worker.output()


# ---------------------------------------------------------------- worker

@pytest.mark.parametrize("args, message", [
    (["--name", ""], "argument --name: expected 1 to 255 printable characters without whitespace, not ''"),
    (["--name", "web 0"], "argument --name: expected 1 to 255 printable characters without whitespace, not 'web 0'"),
    (["--name", "w" * 256], "argument --name: expected 1 to 255 printable characters without whitespace"),
    (["--name", "w", "--drain", "-5"], "argument --drain: expected a number of seconds >= 0, not '-5'"),
    (["--name", "w", "--grace", "nan"], "argument --grace: expected a number of seconds >= 0, not 'nan'"),
    (["--name", "w", "--grace", "inf"], "argument --grace: expected a number of seconds >= 0, not 'inf'"),
    (["--name", "w", "--poll", "0"], "argument --poll: expected a number of seconds > 0, not '0'"),
])
def test_worker_refuses_bad_options_in_one_line(db, args, message):
    line = error_line(cli(db, "worker", *args), 2)
    assert line.startswith(f"everystep worker: {message}"), line


# ---------------------------------------------------------------- the database


@pytest.mark.parametrize("args", [
    ["migrate"], ["runs", "list"], ["runs", "show", str(uuid.UUID(int=7))], ["requeue", str(uuid.UUID(int=7))],
    ["resolve-step", str(uuid.UUID(int=7)), "1", "--discard"], ["prune", "--older-than", "30"],
    ["schedule", "tests.apps.cli_workflows:greet", '"ada"'],
])
def test_an_unreachable_database_is_one_line_and_exit_3(args):
    line = error_line(everystep_cli("--database-url", UNREACHABLE, *args), 3)
    assert line.startswith('everystep: cannot reach the database: connection failed: connection to server at'
                           ' "127.0.0.1", port 1 failed: Connection refused'), line


def test_schedules_commands_take_the_database_after_the_command_too(db):
    assert ok(everystep_cli("schedules", "list", "--database-url", db.url)) == "no live schedules\n"
    assert ok(everystep_cli("schedules", "list", "--all", "--database-url", db.url)) == "no schedules\n"


def test_the_database_url_comes_from_the_option_else_the_environment(db):
    assert error_line(everystep_cli("runs", "list"), 2) == (
        "everystep: no database: pass --database-url, set EVERYSTEP_DATABASE_URL, or pass -c everystep.yaml")
    assert ok(everystep_cli("runs", "list", env={"EVERYSTEP_DATABASE_URL": db.url})) == "no runs\n"
    # The option wins over the environment, before or after the command.
    assert ok(everystep_cli("--database-url", db.url, "runs", "list",
                            env={"EVERYSTEP_DATABASE_URL": UNREACHABLE})) == "no runs\n"
    assert ok(everystep_cli("runs", "list", "--database-url", db.url,
                            env={"EVERYSTEP_DATABASE_URL": UNREACHABLE})) == "no runs\n"


def test_a_malformed_database_url_is_bad_input():
    assert error_line(everystep_cli("--database-url", "localhost", "runs", "list"), 2) == (
        'everystep: bad database URL: missing "=" after "localhost" in connection info string')


def test_a_schema_without_the_tables_says_to_migrate(db, server_url):
    url = conninfo.make_conninfo(server_url, options="-c search_path=no_such_schema")
    assert error_line(everystep_cli("--database-url", url, "runs", "list"), 1) == (
        'everystep: database error: relation "everystep_workflow_all" does not exist (run `everystep migrate` first?)')
