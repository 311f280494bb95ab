"""OpenTelemetry spans and Sentry reports of real runs on the real
PostgreSQL: the span tree of a run with a `parallel`, a replay after a
SIGKILL, failed, blocked and stopped runs, spans exported over the wire by a
supervisor, and the Sentry envelopes of failed and blocked runs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.support.processes import ROOT, wait_for


def _extra(module: str, extra: str, variable: str):
    try:
        return __import__(module)
    except ImportError:
        if os.environ.get(variable) == "1":
            raise
        pytest.skip(f"{module} is not installed: pip install 'everystep[{extra}]' ({variable}=1 requires it)",
                    allow_module_level=True)


_extra("opentelemetry.sdk", "otel", "EVERYSTEP_REQUIRE_OTEL")
_extra("opentelemetry.proto", "otel", "EVERYSTEP_REQUIRE_OTEL")
_extra("sentry_sdk", "sentry", "EVERYSTEP_REQUIRE_SENTRY")

import sentry_sdk  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402
from opentelemetry.util._once import Once  # noqa: E402
from sentry_sdk.transport import Transport  # noqa: E402

import everystep  # noqa: E402
import everystep.db  # noqa: E402
from everystep import logs, observe, tracing  # noqa: E402
from everystep.runner import Runner  # noqa: E402
from tests.apps import tracing_workflows as flows  # noqa: E402
from tests.support.otlp_receiver import Receiver  # noqa: E402
from tests.support.supervisor_process import config  # noqa: E402

CHILD = "tracing-child"


# ---------------------------------------------------------------- helpers

def _set_tracer_provider(provider) -> None:
    # The API sets its global provider once per process; the tests set and
    # clear it around each test, so that tracing is off for every other test.
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)


@pytest.fixture
def spans():
    """Tracing on in this process, with the SDK's in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _set_tracer_provider(provider)
    yield exporter
    _set_tracer_provider(None)


class Capture(Transport):
    """The Sentry SDK's transport hook: keeps the events instead of sending them."""

    def __init__(self, options=None):
        super().__init__(options)
        self.events: list[dict] = []

    def capture_envelope(self, envelope) -> None:
        event = envelope.get_event()
        if event is not None:
            self.events.append(event)


@pytest.fixture
def sentry_events():
    capture = Capture()
    sentry_sdk.init(dsn="https://key@sentry.invalid/1", transport=capture)
    yield capture.events
    sentry_sdk.get_global_scope().set_client(None)


def schedule(db, fn, *args):
    with db.connect() as conn, everystep.transaction(conn):
        return everystep.schedule(fn, *args).id


def run_in_child_killed(db, tmp_path: Path) -> tuple[list[dict], list[bytes]]:
    """Execute the scheduled runs in tests/support/tracing_child.py, which a step
    SIGKILLs; return the spans it exported and the envelopes it sent."""
    spans_file, envelopes_file = tmp_path / "child-spans.jsonl", tmp_path / "child-envelopes"
    child = subprocess.run([sys.executable, "-m", "tests.support.tracing_child", db.url, CHILD, str(spans_file),
                            str(envelopes_file)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert child.returncode == -9, child.stdout + child.stderr
    exported = [json.loads(line) for line in spans_file.read_text().splitlines()] if spans_file.exists() else []
    envelopes = envelopes_file.read_bytes().splitlines() if envelopes_file.exists() else []
    return exported, envelopes


def by_name(finished) -> dict:
    found: dict = {}
    for span in finished:
        found.setdefault(span.name, []).append(span)
    return found


def render(finished) -> str:
    """The span tree as text: one line per span, children indented."""
    children: dict = {}
    ids = {span.context.span_id for span in finished}
    for span in finished:
        parent = span.parent.span_id if span.parent is not None and span.parent.span_id in ids else None
        children.setdefault(parent, []).append(span)
    shown = ("everystep.step_id", "everystep.attempt", "everystep.outcome")  # attempt: run spans only
    lines = []

    def walk(parent, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_time):
            attributes = " ".join(f"{k.removeprefix('everystep.')}={span.attributes[k]}" for k in shown
                                  if k in span.attributes and not (k.endswith("attempt") and span.name[:5] == "step "))
            code, description = span.status.status_code, span.status.description
            status = "" if code == StatusCode.UNSET else f" [{code.name}: {description}]"
            lines.append(f"{'  ' * depth}{span.name} {attributes}{status}".rstrip())
            walk(span.context.span_id, depth + 1)

    walk(None, 0)
    return "\n".join(lines)


# ---------------------------------------------------------------- spans

def test_a_run_with_parallel_is_one_span_tree_under_the_request_that_scheduled_it(db, spans):
    with trace.get_tracer("app").start_as_current_span("POST /orders") as request:
        run_id = schedule(db, flows.fan_out, 5)
    assert db.run_pending() == {run_id: "completed"}
    finished = spans.get_finished_spans()
    print(render(finished))
    named = by_name(finished)
    (scheduled,) = named["schedule tests.apps.tracing_workflows.fan_out"]
    (run,) = named["run tests.apps.tracing_workflows.fan_out"]
    steps = named["step tests.apps.tracing_workflows.double"]

    # One trace: request -> schedule -> run -> every step, the parallel branches' too.
    assert {s.context.trace_id for s in finished} == {request.get_span_context().trace_id}
    assert scheduled.parent.span_id == request.get_span_context().span_id
    assert scheduled.kind == trace.SpanKind.PRODUCER and scheduled.attributes["everystep.run_id"] == str(run_id)
    assert run.parent.span_id == scheduled.context.span_id and run.kind == trace.SpanKind.CONSUMER
    assert sorted(s.attributes["everystep.step_id"] for s in steps) == ["1", "2.0.1", "2.1.1", "2.1.2"]
    assert {s.parent.span_id for s in steps} == {run.context.span_id}
    assert dict(run.attributes) == {
        "everystep.workflow": "tests.apps.tracing_workflows.fan_out", "everystep.run_id": str(run_id),
        "everystep.runner": "test-runner", "everystep.attempt": 1, "everystep.outcome": "completed",
    }
    assert {s.attributes["everystep.outcome"] for s in steps} == {"done"}
    assert {s.attributes["everystep.step"] for s in steps} == {"tests.apps.tracing_workflows.double"}
    assert {s.attributes["everystep.run_id"] for s in steps} == {str(run_id)}
    # Each branch ran on its own thread: spans overlap in time, inside the run's.
    assert all(run.start_time <= s.start_time and s.end_time <= run.end_time for s in steps)


def test_a_replay_after_a_sigkill_continues_the_trace_without_spans_for_recorded_steps(db, spans, tmp_path):
    run_id = schedule(db, flows.killed_then_done, str(tmp_path))
    (scheduled,) = spans.get_finished_spans()
    trace_id = f"0x{scheduled.context.trace_id:032x}"

    exported, _ = run_in_child_killed(db, tmp_path)
    # The killed execution exported the spans of the steps it finished, in the scheduler's trace.
    assert sorted(s["attributes"]["everystep.step_id"] for s in exported) == ["1", "2"]
    assert {s["context"]["trace_id"] for s in exported} == {trace_id}

    assert db.resume_held(CHILD) == {run_id: "completed"}
    finished = spans.get_finished_spans()
    print(render(finished))
    (run,) = by_name(finished)["run tests.apps.tracing_workflows.killed_then_done"]
    replayed = [s for s in finished if s.name.startswith("step ")]
    # Steps 1 and 2 were served from the record: no second span for them.
    assert sorted(s.attributes["everystep.step_id"] for s in replayed) == ["3", "4"]
    assert run.attributes["everystep.attempt"] == 2 and run.attributes["everystep.outcome"] == "completed"
    assert run.parent.span_id == scheduled.context.span_id
    assert {s.context.trace_id for s in finished} == {scheduled.context.trace_id}


def test_a_failed_run_records_the_exception_on_its_step_and_run_spans(db, spans):
    run_id = schedule(db, flows.fails, "no stock")
    assert db.run_pending() == {run_id: "failed"}
    print(render(spans.get_finished_spans()))
    named = by_name(spans.get_finished_spans())
    (run,) = named["run tests.apps.tracing_workflows.fails"]
    (refused,) = named["step tests.apps.tracing_workflows.refuse"]
    (doubled,) = named["step tests.apps.tracing_workflows.double"]
    assert doubled.status.status_code == StatusCode.UNSET and doubled.attributes["everystep.outcome"] == "done"
    for span in (refused, run):
        assert span.status.status_code == StatusCode.ERROR
        assert span.status.description == "ValueError: no stock"
        (event,) = span.events
        assert event.name == "exception" and event.attributes["exception.type"] == "ValueError"
        assert event.attributes["exception.message"] == "no stock"
    assert refused.attributes["everystep.outcome"] == "failed" and run.attributes["everystep.outcome"] == "failed"


def test_blocked_and_stopped_runs_are_marked_on_their_spans(db, spans, tmp_path):
    blocked = schedule(db, flows.blocks, str(tmp_path))
    run_in_child_killed(db, tmp_path)
    assert db.resume_held(CHILD) == {blocked: "blocked"}
    stopped = schedule(db, flows.stops, "customer asked")
    assert db.run_pending() == {stopped: "stopped"}
    named = by_name(spans.get_finished_spans())

    (run,) = named["run tests.apps.tracing_workflows.blocks"]
    assert run.attributes["everystep.outcome"] == "blocked" and run.attributes["everystep.blocked_step"] == "1"
    assert run.status.status_code == StatusCode.ERROR
    assert run.status.description == "blocked on step 1: resolve it with `everystep resolve-step`"
    assert "step tests.apps.tracing_workflows.charge_card" not in named  # started, never executed again

    (run,) = named["run tests.apps.tracing_workflows.stops"]
    assert run.attributes["everystep.outcome"] == "stopped"
    assert (run.status.status_code, run.status.description) == (StatusCode.ERROR, "stopped: customer asked")


def test_with_tracing_off_nothing_is_stored_or_made(db):
    assert not tracing.enabled()
    run_id = schedule(db, flows.fan_out, 1)
    assert db.run_pending() == {run_id: "completed"}
    assert db.value("SELECT trace_context FROM everystep_workflow WHERE id = %s", (run_id,)) is None


def test_a_run_scheduled_with_tracing_off_gets_a_trace_of_its_own(db, spans):
    _set_tracer_provider(None)
    run_id = schedule(db, flows.fan_out, 1)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    _set_tracer_provider(provider)
    assert db.run_pending() == {run_id: "completed"}
    (run,) = by_name(spans.get_finished_spans())["run tests.apps.tracing_workflows.fan_out"]
    assert run.parent is None and run.attributes["everystep.attempt"] == 1


def test_counting_a_traced_execution_is_retried_across_a_connection_error(db, spans, tmp_path, monkeypatch):
    run_id = schedule(db, flows.touches, str(tmp_path / "touched"))
    real, calls = everystep.db.start_traced_execution, []

    def cut_once(*args):
        calls.append(args[1:])
        if len(calls) == 1:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(*args)

    monkeypatch.setattr(everystep.db, "start_traced_execution", cut_once)
    assert db.run_pending() == {run_id: "completed"}
    assert len(calls) == 2  # retried under the claim, as every write about the run is
    (run,) = by_name(spans.get_finished_spans())["run tests.apps.tracing_workflows.touches"]
    assert run.attributes["everystep.attempt"] == 1 and run.attributes["everystep.outcome"] == "completed"
    assert db.value("SELECT trace_context->>'executions' FROM everystep_workflow WHERE id = %s", (run_id,)) == "1"


def test_a_traced_execution_whose_claim_was_lost_stops_before_its_first_step(db, spans, tmp_path):
    touched = tmp_path / "touched"
    run_id = schedule(db, flows.touches, str(touched))
    with db.connect() as conn:
        (stale,) = everystep.db.claim(conn, "test-runner", 1)
        # Put back and claimed again: a new execution of the run, with a token of its own.
        assert everystep.db.requeue_held(conn, "test-runner", [everystep.db.Claim(stale.id, stale.token)]) == [run_id]
        (fresh,) = everystep.db.claim(conn, "test-runner", 1)
    engine = Runner(db.pool, "test-runner")
    try:
        assert engine.execute(stale).outcome == "abandoned"
        assert not touched.exists()  # the lost claim was found by the count, before the step ran
        assert engine.execute(fresh).outcome == "completed"
    finally:
        engine.close()
    assert touched.exists()
    (run,) = by_name(spans.get_finished_spans())["run tests.apps.tracing_workflows.touches"]
    assert run.attributes["everystep.attempt"] == 1  # the stale execution counted nothing


def test_json_log_lines_carry_the_ids_of_the_current_span(db, spans):
    lines: list[str] = []
    handler = logging.Handler()
    handler.setFormatter(logs.JsonFormatter())
    handler.emit = lambda record: lines.append(handler.format(record))
    logging.getLogger("shop").addHandler(handler)
    try:
        run_id = schedule(db, flows.talks, "paid")
        assert db.run_pending() == {run_id: "completed"}
    finally:
        logging.getLogger("shop").removeHandler(handler)
    (said,) = by_name(spans.get_finished_spans())["step tests.apps.tracing_workflows.say"]
    (entry,) = [json.loads(line) for line in lines]
    assert entry["message"] == "paid" and entry["run"] == str(run_id)
    assert entry["trace_id"] == f"{said.context.trace_id:032x}" and entry["span_id"] == f"{said.context.span_id:016x}"


# ---------------------------------------------------------------- over the wire

def test_the_supervisor_exports_spans_with_otlp_over_http(db, spans, supervisors, monkeypatch):
    receiver = Receiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "shop-workers")
        run_id = schedule(db, flows.fan_out, 3)
        (scheduled,) = spans.get_finished_spans()
        supervisors(config(db.url, "traced", imports=["tests.apps.tracing_workflows"], tracing={"enabled": True}))

        def exported() -> list:
            names = [span.name for _service, span in receiver.spans]
            return receiver.spans if "run tests.apps.tracing_workflows.fan_out" in names and len(names) >= 5 else []

        received = wait_for(exported, timeout=60, what="the run's spans at the OTLP receiver")
        assert db.run(run_id)["status"] == "completed"
        assert {service["service.name"] for service, _span in received} == {"shop-workers"}
        run = next(span for _service, span in received if span.name.startswith("run "))
        steps = [span for _service, span in received if span.name.startswith("step ")]
        assert run.trace_id == scheduled.context.trace_id.to_bytes(16, "big")
        assert run.parent_span_id == scheduled.context.span_id.to_bytes(8, "big")
        assert sorted(next(a.value.string_value for a in s.attributes if a.key == "everystep.step_id")
                      for s in steps) == ["1", "2.0.1", "2.1.1", "2.1.2"]
        assert {s.parent_span_id for s in steps} == {run.span_id}
        attributes = {a.key: a.value for a in run.attributes}
        assert attributes["everystep.outcome"].string_value == "completed"
        assert attributes["everystep.runner"].string_value.startswith("traced-")
    finally:
        receiver.close()


# ---------------------------------------------------------------- Sentry

def test_a_failed_run_is_reported_once_across_its_executions(db, sentry_events, tmp_path):
    run_id = schedule(db, flows.killed_then_fails, str(tmp_path))
    _, child_envelopes = run_in_child_killed(db, tmp_path)
    assert child_envelopes == []  # the step's failure alone is not a report: the run went on
    assert db.resume_held(CHILD) == {run_id: "failed"}
    assert db.resume_held(CHILD) == {}  # ended: no later execution reports it again
    (event,) = sentry_events
    (exception, *_) = reversed(event["exception"]["values"])
    assert (exception["type"], exception["value"]) == ("RuntimeError", "the order could not be paid")
    assert event["tags"] == {"everystep.workflow": "tests.apps.tracing_workflows.killed_then_fails",
                             "everystep.step": "tests.apps.tracing_workflows.refuse", "everystep.runner": CHILD}
    assert event["contexts"]["everystep run"]["run_id"] == str(run_id)


def test_a_blocked_run_is_a_warning_that_says_how_to_resolve_it(db, sentry_events, tmp_path):
    run_id = schedule(db, flows.blocks, str(tmp_path))
    run_in_child_killed(db, tmp_path)
    assert db.resume_held(CHILD) == {run_id: "blocked"}
    (event,) = sentry_events
    assert event["level"] == "warning"
    assert f"`everystep resolve-step {run_id} 1 --result JSON`" in event["message"]
    assert event["tags"]["everystep.step"] == "tests.apps.tracing_workflows.charge_card"
    assert event["fingerprint"] == ["everystep-blocked", "tests.apps.tracing_workflows.blocks",
                                    "tests.apps.tracing_workflows.charge_card"]


def test_a_completed_run_reports_nothing(db, sentry_events):
    run_id = schedule(db, flows.fan_out, 2)
    assert db.run_pending() == {run_id: "completed"}
    assert sentry_events == []


def test_the_switch_keeps_the_applications_sentry_and_otherwise_reads_sentry_dsn(sentry_events, monkeypatch):
    application = sentry_sdk.get_client()
    observe.setup(tracing_enabled=False, sentry_enabled=True)
    assert sentry_sdk.get_client() is application
    sentry_sdk.get_global_scope().set_client(None)
    monkeypatch.setenv("SENTRY_DSN", "https://other@sentry.invalid/2")
    observe.setup(tracing_enabled=False, sentry_enabled=True)
    assert sentry_sdk.get_client().is_active() and sentry_sdk.get_client().dsn == "https://other@sentry.invalid/2"
