"""Executes the scheduled runs of a schema once, with tracing and Sentry set
up by the application (this module), writing the spans it ends and the Sentry
envelopes it sends to files: a process the tests may SIGKILL mid-run.

python -m tests.support.tracing_child DATABASE_URL RUNNER SPANS_FILE ENVELOPES_FILE"""

from __future__ import annotations

import sys

import sentry_sdk
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from psycopg_pool import ConnectionPool
from sentry_sdk.transport import Transport

import tests.apps.tracing_workflows  # noqa: F401  (registers the workflows)
from everystep import db
from everystep.runner import Runner


class FileTransport(Transport):
    """Every envelope, as one line of its serialized form."""

    def __init__(self, options=None, path: str = ""):
        super().__init__(options)
        self.path = path

    def capture_envelope(self, envelope) -> None:
        with open(self.path, "ab") as f:
            f.write(envelope.serialize().replace(b"\n", b" ") + b"\n")


def main(url: str, runner: str, spans: str, envelopes: str) -> None:
    provider = TracerProvider()
    out = open(spans, "a")  # noqa: SIM115  (the process may be killed; each span is flushed)
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
        out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    trace.set_tracer_provider(provider)
    sentry_sdk.init(dsn="https://key@sentry.invalid/1", transport=FileTransport(path=envelopes))
    with ConnectionPool(url, min_size=1, max_size=4, kwargs={"autocommit": True}) as pool:
        engine = Runner(pool, runner)
        with pool.connection() as conn:
            runs = db.claim(conn, runner, 100)
        for run in runs:
            engine.execute(run)
            out.flush()
        engine.close()
    sentry_sdk.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
