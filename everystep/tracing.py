"""OpenTelemetry spans (the `otel` extra). All of everystep's OpenTelemetry
code is here, and none of it imports OpenTelemetry until tracing is on.

Tracing is on when the process has a real TracerProvider: the application's,
or the one `setup()` makes for the supervisor's `tracing: {enabled: true}`.
Otherwise every function here returns at its first line.

Spans:
  schedule <workflow>   (PRODUCER) around `schedule()`, in the caller's trace;
                        its context is stored with the run (trace_context).
  run <workflow>        (CONSUMER) one per execution of a run, claim to end,
                        a child of the schedule span: every execution of the
                        run, across claims, crashes and replays, continues the
                        trace of the code that scheduled it.
  step <step>           (INTERNAL) one per step execution, a child of the run
                        span; none for a step served from the record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

from everystep.schema import RunStatus

log = logging.getLogger("everystep")

_tracer_cache: tuple[Any, Any] | None = None  # (provider, tracer)
_own_provider: Any = None  # the provider setup() made, shut down by shutdown()


def _trace_api() -> Any:
    """The opentelemetry.trace module if a real TracerProvider is set, else
    None. Never imports anything: without OpenTelemetry loaded, tracing is off."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return trace


def _tracer(trace: Any) -> Any:
    global _tracer_cache
    provider = trace.get_tracer_provider()
    if _tracer_cache is None or _tracer_cache[0] is not provider:
        _tracer_cache = (provider, trace.get_tracer("everystep"))
    return _tracer_cache[1]


def enabled() -> bool:
    """Whether spans are made in this process now."""
    return _trace_api() is not None


def current_ids() -> tuple[str, str] | None:
    """The (trace id, span id) of the span current on this thread, in hex,
    for log lines; None when tracing is off or no span is current."""
    trace = _trace_api()
    if trace is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


# ---------------------------------------------------------------- schedule()

class Scheduling:
    """What `scheduling` gives the insert of a run: `context`, the trace
    context to store with it (JSON; None with tracing off)."""

    __slots__ = ("context", "span")

    def __init__(self, context: str | None, span: Any):
        self.context = context
        self.span = span

    def scheduled(self, run_id: uuid.UUID, created: bool) -> None:
        """The run is inserted (or existed: `created` False)."""
        if self.span is not None:
            self.span.set_attribute("everystep.run_id", str(run_id))
            self.span.set_attribute("everystep.created", created)


@contextlib.contextmanager
def scheduling(workflow: str) -> Iterator[Scheduling]:
    """Around the insert of a run (`schedule()`, `aschedule()`): a `schedule`
    span when tracing is on, whose context the run stores; nothing otherwise."""
    trace = _trace_api()
    if trace is None:
        yield Scheduling(None, None)
        return
    from opentelemetry import propagate  # noqa: PLC0415  (loaded already: the API is)

    attributes = {"everystep.workflow": workflow}
    with _tracer(trace).start_as_current_span(f"schedule {workflow}", kind=trace.SpanKind.PRODUCER,
                                              attributes=attributes) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the application's propagators: traceparent, tracestate, baggage...
        yield Scheduling(json.dumps(carrier), span)


# ---------------------------------------------------------------- executions

class RunSpan:
    """The tracing state of one execution of a run."""

    __slots__ = ("trace", "span", "token", "attributes")

    def __init__(self, trace: Any, span: Any, token: object, attributes: dict):
        self.trace = trace
        self.span = span
        self.token = token
        self.attributes = attributes  # shared with its step spans


def run_started(workflow: str, run_id: uuid.UUID, runner: str, stored: dict, execution: int) -> RunSpan | None:
    """Open the span of this execution of a run (on the thread executing it)
    and make it current; None when tracing is off. `stored`: the trace
    context stored with the run; `execution`: the number of this traced
    execution (both as the runner's write of the execution returned them)."""
    trace = _trace_api()
    if trace is None:
        return None
    from opentelemetry import context, propagate  # noqa: PLC0415  (loaded already: the API is)

    # Only the stored context is the parent, never whatever this worker thread
    # has current; no stored context (scheduled with tracing off): a new trace.
    parent = propagate.extract(stored, context=context.Context())
    attributes = {
        "everystep.workflow": workflow,
        "everystep.run_id": str(run_id),
        "everystep.runner": runner,
        "everystep.attempt": execution,
    }
    span = _tracer(trace).start_span(f"run {workflow}", context=parent, kind=trace.SpanKind.CONSUMER,
                                     attributes=attributes)
    token = context.attach(trace.set_span_in_context(span, parent))
    return RunSpan(trace, span, token, attributes)


def run_ended(run: RunSpan, outcome: str, exc: BaseException | None, blocked_on: str | None) -> None:
    """Close the execution's span: its outcome, and the run's exception."""
    from opentelemetry import context  # noqa: PLC0415

    span, status = run.span, run.trace.StatusCode
    span.set_attribute("everystep.outcome", outcome)
    if exc is not None and outcome in (RunStatus.FAILED, RunStatus.STOPPED, RunStatus.BLOCKED):
        span.record_exception(exc)
    if outcome == RunStatus.FAILED:
        span.set_status(status.ERROR, f"{type(exc).__name__}: {exc}" if exc is not None else "failed")
    elif outcome == RunStatus.STOPPED:
        span.set_status(status.ERROR, f"stopped: {exc}")
    elif outcome == RunStatus.BLOCKED:
        span.set_attribute("everystep.blocked_step", blocked_on or "")
        span.set_status(status.ERROR, f"blocked on step {blocked_on}: resolve it with `everystep resolve-step`")
    elif outcome == "requeued":
        span.add_event("requeued: the worker is draining; another execution continues the run")
    elif outcome == "abandoned":
        span.add_event("abandoned: the claim was lost; another claimer owns the run")
    context.detach(run.token)
    span.end()


def step_started(run: RunSpan, step_id: str, name: str) -> tuple:
    """Open a step's span, a child of what is current (the run's span, also in
    a parallel branch), and make it current while the step runs."""
    from opentelemetry import context  # noqa: PLC0415

    span = _tracer(run.trace).start_span(
        f"step {name}", attributes={**run.attributes, "everystep.step_id": step_id, "everystep.step": name})
    return span, context.attach(run.trace.set_span_in_context(span))


def step_ended(run: RunSpan, step: tuple, status: str, exc: BaseException | None) -> None:
    from opentelemetry import context  # noqa: PLC0415

    span, token = step
    span.set_attribute("everystep.outcome", status)
    if exc is not None:
        span.record_exception(exc)
        span.set_status(run.trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
    context.detach(token)
    span.end()


# ---------------------------------------------------------------- the supervisor's switch

def setup() -> None:
    """`tracing: {enabled: true}`: unless the application has set a
    TracerProvider, set one exporting with OTLP over HTTP, configured by the
    standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, _HEADERS,
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER...)."""
    global _own_provider
    from opentelemetry import trace  # noqa: PLC0415  (the otel extra)

    if _trace_api() is not None:
        log.info("tracing: using the application's TracerProvider")
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    named = "OTEL_SERVICE_NAME" in os.environ or "service.name" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "everystep"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _own_provider = provider


def shutdown() -> None:
    """Before a supervised child exits: export the spans still buffered."""
    trace = _trace_api()
    if _own_provider is not None:
        _own_provider.shutdown()
    elif trace is not None and hasattr(provider := trace.get_tracer_provider(), "force_flush"):
        provider.force_flush()
