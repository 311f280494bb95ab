"""History and retention: finished runs leave the hot tables for the
weekly-partitioned history, and are removed once past the retention of
their end status (config `retention:`, `everystep prune`).

    archive(conn, after=10)          # move runs that ended 10 s ago or more, in batches
    prepare(conn)                    # partitions for this week and the next ones
    apply(conn, {"completed": 7 * 86400, "failed": 30 * 86400})

`apply` drops every partition (a week of runs, by their UUIDv7 ids) whose
runs are all expired, in an instant whatever their number, and deletes the
expired runs of the other partitions in batches. A status left out of the
retention is kept for ever; blocked runs are never in the history (they are
not finished), so never removed. The maintenance child calls these in its
loop; `everystep prune` on demand. See docs/operations.md, History and
retention.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from typing import NamedTuple

import psycopg

from everystep import db
from everystep.schema import TERMINAL

log = logging.getLogger("everystep")

RETAINED = TERMINAL  # the statuses `retention:` may name: completed, failed, stopped, cancelled
ARCHIVE_BATCH = 2000  # runs moved per transaction
RETENTION_BATCH = 5000  # runs deleted per transaction, where a partition is not wholly expired
WEEKS_AHEAD = 2  # partitions made ahead of time: this week's and the next two

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: object) -> float:
    """Seconds: a number, or a string such as `45s`, `30m`, `12h`, `7d`."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"must be a duration (seconds, or like 45s, 30m, 12h, 7d), got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        seconds = float(match[1]) * _UNITS[match[2]]
    else:
        raise ValueError(f"must be a duration (seconds, or like 45s, 30m, 12h, 7d), got {value!r}")
    if not 0 < seconds < 100 * 365 * 86400 or seconds != seconds:
        raise ValueError(f"must be more than 0 seconds and less than 100 years, got {value!r}")
    return seconds


class Applied(NamedTuple):
    dropped_weeks: int  # partitions (weeks of runs) dropped whole
    dropped: int  # the runs they held
    deleted: int  # runs deleted in batches: of the other partitions, and still hot

    @property
    def removed(self) -> int:
        return self.dropped + self.deleted


def prepare(conn: psycopg.Connection, weeks: int = WEEKS_AHEAD) -> int:
    """Create the partitions of this week and the `weeks` after it where
    missing; how many tables it created."""
    return db.history_ahead(conn, weeks)


def archive(conn: psycopg.Connection, after: float, budget: float | None = None, batch: int = ARCHIVE_BATCH) -> int:
    """Move the runs that ended at least `after` seconds ago to the history,
    in batches, until none is left or `budget` seconds have passed; how many
    moved."""
    moved = 0
    deadline = None if budget is None else time.monotonic() + budget
    for status in TERMINAL:
        since = None  # each status from its oldest run: a run that ended late is not left behind
        while deadline is None or time.monotonic() < deadline:
            batch_moved = db.archive_batch(conn, status, batch, after, since)
            moved += batch_moved.moved
            if batch_moved.candidates < batch or not batch_moved.moved:  # the last, or all locked by others
                break
            since = batch_moved.cursor
    return moved


def apply(conn: psycopg.Connection, retention: Mapping[str, float], budget: float | None = None,
          batch: int = RETENTION_BATCH) -> Applied:
    """Remove the history's runs past the retention of their end status:
    whole partitions where every run in them is expired, batches of the
    rest, until done or `budget` seconds have passed."""
    if not retention:
        return Applied(0, 0, 0)
    deadline = None if budget is None else time.monotonic() + budget
    weeks = dropped = 0
    for week, _estimate in db.history_weeks(conn):
        if not db.week_expired(conn, week, retention, TERMINAL):
            continue
        runs = db.drop_week(conn, week, retention, TERMINAL)
        if runs is not None:
            weeks += 1
            dropped += runs
            log.info("retention: dropped the history of the week of %s (%d runs)", week.isoformat(), runs)
    deleted = 0
    for status, seconds in retention.items():
        for batch_of in (db.retention_batch, db.retention_batch_hot):
            while deadline is None or time.monotonic() < deadline:
                count = batch_of(conn, status, seconds, batch)
                deleted += count
                if count < batch:
                    break
    return Applied(weeks, dropped, deleted)


def count(conn: psycopg.Connection, retention: Mapping[str, float]) -> dict[str, int]:
    """How many runs, by end status, are past their retention (hot or in the history)."""
    return {status: db.count_expired(conn, status, seconds) for status, seconds in retention.items()}


ARCHIVE_AFTER = 60.0  # seconds a finished run stays in the hot table before it may move
ARCHIVE_BUDGET = 0.5  # seconds of moving per look, so the schedules' tick is never held up for long
RETENTION_EVERY = 60.0  # seconds between passes of the retention (and of the partitions made ahead)
RETENTION_BUDGET = 2.0  # seconds of batch deletes per pass (dropping partitions is not counted: it is instant)


class Upkeep:
    """The maintenance child's share of the history: the move at every
    sweep (and at every look while a backlog is left), the partitions ahead
    and the retention every RETENTION_EVERY seconds. A failure other than a
    lost connection (a role that does not own the tables, say) is logged
    once and tried again at the next pass: it never stops the sweep."""

    def __init__(self, retention: Mapping[str, float] | None = None, archive_after: float = ARCHIVE_AFTER):
        self.retention = dict(retention or {})
        self.archive_after = archive_after
        self._backlog = True
        self._next_retention = 0.0
        self._failing: str | None = None

    def run(self, conn: psycopg.Connection, sweep_due: bool) -> None:
        from everystep import metrics  # noqa: PLC0415

        try:
            if sweep_due or self._backlog:
                moved = archive(conn, self.archive_after, budget=ARCHIVE_BUDGET)
                self._backlog = moved >= ARCHIVE_BATCH
                if moved:
                    metrics.HISTORY_MOVED.inc(moved)
            if time.monotonic() >= self._next_retention:
                self._next_retention = time.monotonic() + RETENTION_EVERY
                prepare(conn)
                applied = apply(conn, self.retention, budget=RETENTION_BUDGET)
                if applied.removed:
                    metrics.RETENTION_REMOVED.inc(applied.removed)
                    log.info("retention: removed %d runs (%d in %d dropped partitions)", applied.removed,
                             applied.dropped, applied.dropped_weeks)
            self._failing = None
        except db.CONNECTION_ERRORS:
            raise
        except psycopg.Error as exc:
            problem = " ".join(str(exc).split()) or type(exc).__name__
            if problem != self._failing:
                log.warning("history: the move or the retention failed (tried again later): %s", problem)
            self._failing = problem
