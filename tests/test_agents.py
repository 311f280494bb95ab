"""A durable pydantic-ai agent (everystep.contrib.pydantic_ai): every model
request and tool call is a step; a worker SIGKILLed mid-conversation
resumes without calling the model again for a request it answered nor a
finished tool; the model's text streams into the run's durable stream and
a reader that reconnects halfway reads the whole answer; an unsafe tool is
an unsafe_to_repeat step; the FastAPI app of docs/agents.md runs as written.
The model is pydantic-ai's FunctionModel (no network), counting its calls
in a table."""

from __future__ import annotations

import collections
import json
import threading

import pytest

pytest.importorskip("pydantic_ai")

import everystep  # noqa: E402
from everystep.testing import crash_before_effect  # noqa: E402
from tests.apps import agent_workflows as flows  # noqa: E402
from tests.support.engine import schedule_one  # noqa: E402
from tests.support.processes import wait_for  # noqa: E402


@pytest.fixture
def calls(db, monkeypatch, tmp_path):
    """The table the model and the tools count their calls in; read() -> {what: how many times}."""
    with db.connect() as conn:
        conn.execute("CREATE TABLE agent_calls (what text)")
    monkeypatch.setenv("EVERYSTEP_AGENT_TEST_URL", db.url)
    monkeypatch.setenv("EVERYSTEP_AGENT_KILL_FILE", str(tmp_path / "kill"))
    return lambda: collections.Counter(dict(db.query("SELECT what, count(*)::int FROM agent_calls GROUP BY 1")))


@pytest.fixture(autouse=True)
def _faults():
    yield
    everystep.faults.disarm_all()  # crashed executions are known by token, which the next schema reuses


EVERY_CALL_ONCE = {"model 1": 1, "model 2": 1, "model 3": 1, "model 4": 1,
                   "tool Lyon": 1, "tool Dijon": 1, "tool Paris": 1}


def last_tries(entries: list) -> str:
    """The text of a stream as docs/streams.md says to read it: of each
    step's entries, those of its last try."""
    last = {}
    for entry in entries:
        if entry.step is not None:
            last[entry.step] = entry.tried
    return "".join(e.value for e in entries if e.step is None or e.tried == last[e.step])


@pytest.mark.parametrize("workflow", [flows.deliver, flows.deliver_sync, flows.deliver_streamed],
                         ids=["async", "sync", "run_stream"])
def test_every_model_request_and_tool_call_is_a_step(db, calls, workflow):
    run = schedule_one(db, workflow, "where is my parcel?")
    assert db.run_pending() == {run.id: "completed"}
    assert db.run(run.id)["result"] == flows.ANSWER
    assert calls() == EVERY_CALL_ONCE
    names = [step["name"] for step in db.steps(run.id)]
    assert names.count("courier__model.request_stream") == 4
    assert [n.rsplit(":", 1)[1] for n in names if "call_tool" in n] == ["visit_lyon", "visit_dijon", "visit_paris"]
    text = last_tries(list(everystep.read_stream(run.id, "answer", conn=db.url, timeout=5)))
    assert text == flows.ANSWER


def test_a_worker_killed_mid_conversation_resumes_without_calling_the_model_or_a_tool_again(
        db, calls, start_worker, tmp_path):
    # The worker dies (SIGKILL, from inside) as the third model request
    # starts: after the second tool call, whose step is committed.
    (tmp_path / "kill").write_text("model 3")
    run = schedule_one(db, flows.deliver, "where is my parcel?")
    read: list = []
    reader_done = threading.Event()

    def reader() -> None:
        """Reads three entries, drops its connection, reconnects from the next offset."""
        for entry in everystep.read_stream(run.id, "answer", conn=db.url, timeout=60):
            read.append(entry)
            if len(read) == 3:
                break
        for entry in everystep.read_stream(run.id, "answer", offset=read[-1].offset + 1, conn=db.url, timeout=60):
            read.append(entry)
        reader_done.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    first = start_worker("agent-0", imports=("tests.apps.agent_workflows",))
    wait_for(lambda: not first.alive(), 60, what="the worker to be killed")
    assert db.run(run.id)["status"] == "running"
    assert calls() == {"model 1": 1, "model 2": 1, "tool Lyon": 1, "tool Dijon": 1}
    # Restarted under its name, as the supervisor does: its catchup resumes the run.
    start_worker("agent-0", imports=("tests.apps.agent_workflows",))
    wait_for(lambda: db.run(run.id)["status"] == "completed", 60, what="the run to complete")
    assert db.run(run.id)["result"] == flows.ANSWER
    assert calls() == EVERY_CALL_ONCE
    assert reader_done.wait(30)
    assert len(read) > 3 and last_tries(read) == flows.ANSWER


def test_outside_a_workflow_the_wrapper_runs_the_agent_as_it_is(db, calls):
    assert flows.durable.run_sync("where is my parcel?").output == flows.ANSWER
    assert calls() == EVERY_CALL_ONCE
    assert db.value("SELECT count(*) FROM everystep_step") == 0


def test_a_tool_marked_unsafe_is_an_unsafe_to_repeat_step(db, calls):
    run = schedule_one(db, flows.deliver_carefully, "where is my parcel?")
    paris = "6"  # model, tool, model, tool, model, tool: the third tool call's step
    with crash_before_effect(paris), pytest.raises(everystep.faults.Crash):
        db.run_pending()
    assert db.resume_held() == {run.id: "blocked"}  # its effect may or may not have happened
    assert "tool Paris" not in calls()
    step = {s["step_id"]: s for s in db.steps(run.id)}[paris]
    assert step["name"].endswith("call_tool:visit_paris") and step["status"] == "started"


# ---------------------------------------------------------------- docs/agents.md's FastAPI app, as written

def test_the_fastapi_app_of_the_docs_runs_as_written(db, start_worker, tmp_path, monkeypatch):
    import sys  # noqa: PLC0415

    import httpx  # noqa: PLC0415
    import uvicorn  # noqa: PLC0415

    from everystep.ui.server import bind  # noqa: PLC0415
    from tests.support.docs import write_module  # noqa: PLC0415
    from tests.support.sse import events  # noqa: PLC0415

    folder = tmp_path / "app"
    folder.mkdir()
    write_module("agents.md", 1, folder, "support_app")  # the app (block 0 is the wrapper's sketch)
    with db.connect() as conn:
        conn.execute("CREATE TABLE question (id bigserial PRIMARY KEY, text text NOT NULL, run_id uuid)")
    monkeypatch.setenv("DATABASE_URL", db.url)
    monkeypatch.setenv("PYTHONPATH", f"{folder}{':' + p if (p := __import__('os').environ.get('PYTHONPATH')) else ''}")
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("support_app", None)
    import support_app  # noqa: PLC0415

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(support_app.app, log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_for(lambda: server.started, 20, what="uvicorn to serve the app")
        with httpx.Client(timeout=30) as client:
            asked = client.post(f"{base}/questions", json={"text": "Where is order 42?"}).json()
            assert db.value("SELECT run_id::text FROM question WHERE id = %s", (asked["question"],)) == asked["run"]
            start_worker("app-0", imports=("support_app",))
            url = f"{base}/questions/{asked['run']}/answer"
            first = []
            for event in events(client, url):  # a client that drops after the first token ...
                first.append(event)
                break
            rest = list(events(client, url, {"Last-Event-ID": first[-1].id}))  # ... and reconnects
        assert rest[-1].event == "end"
        tokens = [json.loads(e.data) for e in first + rest[:-1]]
        assert len(tokens) > 2  # the model streamed: the reconnect came halfway
        assert [int(e.id) for e in first + rest[:-1]] == list(range(len(tokens)))
        wait_for(lambda: db.run(asked["run"])["status"] == "completed", 30, what="the run to complete")
        assert "".join(tokens) == db.run(asked["run"])["result"]
        assert any("order_status" in step["name"] for step in db.steps(asked["run"]))
    finally:
        server.should_exit = True
        thread.join(10)
        sys.modules.pop("support_app", None)


def test_the_wrappers_sketch_in_the_docs_runs_as_written():
    from tests.support.docs import python_blocks  # noqa: PLC0415

    namespace: dict = {}
    exec(python_blocks("agents.md")[0], namespace)
    assert namespace["durable"].name == "support"
    assert namespace["durable"].durability.unsafe_tools == {"refund"}
