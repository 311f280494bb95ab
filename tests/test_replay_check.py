"""`everystep runs export` and `everystep replay-check` (everystep.history):
a history exported from real runs, then the workflow changed in each way
that matters — a step renamed, an argument changed, a step inserted, a
patched() branch, the same change without patched() — and not changed, each
checked by the command line as a CI job runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import everystep
from everystep import history, registry
from everystep.testing import advance, drain, server

MODULE = "checkout_flows"

V1 = '''
import everystep
from everystep import step, workflow


@step
def reserve(item, qty):
    return f"r-{item}"


@step
def pay(customer, amount):
    return f"p-{customer}"


@step
def ship(item):
    return f"s-{item}"


@workflow
def order(customer, item):
    reserve(item, 1)
    pay(customer, 10)
    everystep.sleep(3600)
    return ship(item)
'''


def variant(old: str, new: str) -> str:
    assert old in V1
    return V1.replace(old, new)


# Each change: the module, the exit status, and what the report says of the
# run that completed and of the one waiting in its sleep.
CHANGES = {
    "unchanged": (V1, 0, "OK        {done}  checkout_flows.order  completed: 4 recorded steps replayed",
                  "OK        {waiting}  checkout_flows.order  waiting: 3 recorded steps replayed"),
    "step renamed": (
        variant("def ship(item):", "def send_out(item):").replace("return ship(item)", "return send_out(item)"), 1,
        "DIVERGED  {done}  checkout_flows.order  completed: at step 4: recorded checkout_flows.ship('book'), the "
        "code now calls checkout_flows.send_out('book') there: the engine fails the run with WorkflowCodeError",
        "OK        {waiting}  checkout_flows.order  waiting: 3 recorded steps replayed"),
    "argument changed": (
        variant("pay(customer, 10)", "pay(customer, 12)"), 1,
        "DIVERGED  {done}  checkout_flows.order  completed: at step 2: recorded checkout_flows.pay('ann', 10), "
        "the code now calls checkout_flows.pay('ann', 12): the arguments differ (the engine would serve the "
        "outcome recorded for the old ones)",
        "DIVERGED  {waiting}  checkout_flows.order  waiting: at step 2: recorded checkout_flows.pay('bob', 10), "
        "the code now calls checkout_flows.pay('bob', 12): the arguments differ"),
    "step inserted": (
        variant("    pay(customer, 10)", "    ship('gift')\n    pay(customer, 10)"), 1,
        "DIVERGED  {done}  checkout_flows.order  completed: at step 2: recorded checkout_flows.pay('ann', 10), "
        "the code now calls checkout_flows.ship('gift') there",
        "DIVERGED  {waiting}  checkout_flows.order  waiting: at step 2: recorded checkout_flows.pay('bob', 10)"),
    "patched branch": (
        variant("    return ship(item)", "    if everystep.patched('gift'):\n        reserve('gift', 1)\n"
                                         "    return ship(item)"), 0,
        "OK        {done}  checkout_flows.order  completed: 4 recorded steps replayed\n"
        "          patch:gift: patched() decides False: the old code (its history went past the patch)",
        "OK        {waiting}  checkout_flows.order  waiting: 3 recorded steps replayed\n"
        "          patch:gift: patched() decides True: the new code"),
    "same change without patched()": (
        variant("    return ship(item)", "    reserve('gift', 1)\n    return ship(item)"), 1,
        "DIVERGED  {done}  checkout_flows.order  completed: at step 4: recorded checkout_flows.ship('book'), the "
        "code now calls checkout_flows.reserve('gift', 1) there",
        "OK        {waiting}  checkout_flows.order  waiting: 3 recorded steps replayed"),
}


def cli(*args: str, cwd, check_code: int | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "everystep", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(cwd)})
    if check_code is not None:
        assert done.returncode == check_code, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, server_url):
    """Runs of V1 in a schema: one completed (ann), one waiting in its sleep
    (bob), exported by the command line to history.json."""
    folder = tmp_path_factory.mktemp("recorded")
    (folder / f"{MODULE}.py").write_text(V1)
    sys.path.insert(0, str(folder))
    database = server.create(server_url)
    try:
        flows = registry.import_module(MODULE)
        with database.connect() as conn:
            with everystep.transaction(conn):
                done = everystep.schedule(flows.order, "ann", "book")
            drain(conn)
            advance(conn, 3600)
            with everystep.transaction(conn):
                waiting = everystep.schedule(flows.order, "bob", "pen")
            drain(conn)
        cli("--database-url", database.url, "runs", "export", str(done.id), str(waiting.id), "-o", "history.json",
            cwd=folder, check_code=0)
        yield folder / "history.json", database, {"done": done.id, "waiting": waiting.id}
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(MODULE, None)
        server.drop(database, server_url)


def test_the_export_holds_the_runs_and_their_recorded_steps(recorded):
    path, _, ids = recorded
    document = json.loads(path.read_text())
    assert document["format"] == history.FORMAT
    done, waiting = document["runs"]
    assert (done["id"], done["workflow"], done["status"], done["args"]) == (
        str(ids["done"]), "checkout_flows.order", "completed", ["ann", "book"])
    assert [(s["step_id"], s["name"], s["args"]) for s in done["steps"]] == [
        ("1", "checkout_flows.reserve", ["book", 1]), ("2", "checkout_flows.pay", ["ann", 10]),
        ("3", "everystep.sleep", []), ("4", "checkout_flows.ship", ["book"])]
    assert (waiting["status"], len(waiting["steps"])) == ("waiting", 3)


@pytest.mark.parametrize("change", list(CHANGES))
def test_replay_check_finds_what_a_change_breaks(recorded, tmp_path, change):
    path, _, ids = recorded
    module, code, about_done, about_waiting = CHANGES[change]
    (tmp_path / f"{MODULE}.py").write_text(module)
    (tmp_path / "history.json").write_bytes(path.read_bytes())
    done = cli("replay-check", "history.json", "--imports", MODULE, cwd=tmp_path)
    assert done.returncode == code, done.stdout + done.stderr
    for expected in (about_done.format(**ids), about_waiting.format(**ids)):
        assert expected in done.stdout, done.stdout
    diverging = sum(line.startswith("DIVERGED") for line in done.stdout.splitlines())
    assert done.stdout.splitlines()[-1] == f"2 runs checked: {2 - diverging} OK, {diverging} diverge"


def test_replay_check_as_json_and_as_a_function(recorded, tmp_path):
    path, _, ids = recorded
    (tmp_path / f"{MODULE}.py").write_text(CHANGES["argument changed"][0])
    done = cli("replay-check", str(path), "--import", MODULE, "-o", "json", cwd=tmp_path)
    report = json.loads(done.stdout)
    assert done.returncode == 1 and report["ok"] is False
    assert [(run["run"], run["ok"], run["divergence"]["step_id"]) for run in report["runs"]] == [
        (str(ids["done"]), False, "2"), (str(ids["waiting"]), False, "2")]
    # In this process the recorded module (V1) is still the one imported: nothing diverges.
    sys.path.insert(0, str(path.parent))
    try:
        checked = everystep.testing.replay(path, imports=[MODULE])
    finally:
        sys.path.remove(str(path.parent))
    assert checked.ok and [c.replayed for c in checked] == [4, 3] and checked.diverged == []


def test_replay_check_executes_no_step(recorded, tmp_path):
    path, _, _ = recorded
    (tmp_path / f"{MODULE}.py").write_text(V1.replace('    return f"s-{item}"', '    raise SystemExit(9)')
                                           .replace('    return f"r-{item}"', '    raise SystemExit(9)'))
    done = cli("replay-check", str(path), "--imports", MODULE, cwd=tmp_path, check_code=0)
    assert done.stdout.splitlines()[-1] == "2 runs checked: 2 OK, 0 diverge"


def test_export_by_filter_and_bad_input(recorded, tmp_path):
    path, database, ids = recorded
    cli("--database-url", database.url, "runs", "export", "--workflow", "checkout_flows.order", "--status",
        "completed", "--limit", "5", "-o", "filtered.json", cwd=tmp_path, check_code=0)
    assert [run["id"] for run in json.loads((tmp_path / "filtered.json").read_text())["runs"]] == [str(ids["done"])]
    missing = cli("--database-url", database.url, "runs", "export", "0190f1f4-0000-7000-8000-000000000000",
                  cwd=tmp_path, check_code=2)
    assert "no run 0190f1f4-0000-7000-8000-000000000000" in missing.stderr
    assert "takes run ids, or a filter" in cli("--database-url", database.url, "runs", "export", cwd=tmp_path,
                                               check_code=2).stderr
    (tmp_path / "not-a-history.json").write_text(json.dumps({"runs": []}))
    assert "not an everystep history" in cli("replay-check", "not-a-history.json", cwd=tmp_path,
                                             check_code=2).stderr


def test_a_workflow_no_longer_in_the_code_is_an_error(recorded, tmp_path):
    path, _, ids = recorded
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent("""
        from everystep import workflow

        @workflow
        def other():
            return 1
    """))
    done = cli("replay-check", str(path), "--imports", MODULE, cwd=tmp_path, check_code=1)
    assert done.stdout.startswith(f"ERROR     {ids['done']}  checkout_flows.order  completed: the workflow is not in "
                                  "the code")


def test_replay_check_finds_the_modules_of_the_current_directory_without_imports(recorded, tmp_path):
    # As `everystep schedule MODULE:FUNC` does: the console script (`python -m`
    # would put the current directory on sys.path by itself), no --imports, no PYTHONPATH.
    from tests.support.processes import console_script  # noqa: PLC0415

    path, _, _ = recorded
    (tmp_path / f"{MODULE}.py").write_text(V1)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = subprocess.run([console_script("everystep"), "replay-check", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "2 runs checked: 2 OK, 0 diverge"
