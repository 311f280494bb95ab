"""Schedules as application data: recurring schedules the application
writes itself (one per customer, say), next to the manifest's.

    everystep.schedules.put(key, workflow, args, cron=..., timezone=..., ...)
    everystep.schedules.pause(key) / resume(key) / retire(key) / get(key)

Each call works in the caller's transaction, found as `schedule()` finds it
(conn=, everystep.transaction/use, Django), so a schedule is written or not
with the rest of the caller's work. Definitions are validated by the
manifest's own rules, and each write is a new version of the schedule, as an
apply is. What the API writes belongs to the source `api` (or the `source=`
given); keys of other sources (a deployment's manifest) are refused.
"""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from everystep import db, registry, scheduler, serde
from everystep.api import transaction_connection
from everystep.errors import EverystepError
from everystep.scheduler import API_SOURCE, Schedule


class ScheduleError(EverystepError):
    """Bad input, or a schedule the call does not apply to (unknown, retired,
    owned by another source). Nothing was written."""


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule as the database holds it: its definition, owner, version and state."""

    key: str
    state: str  # active, paused, auto-paused, retired
    source: str
    version: int
    workflow: str
    args: list
    cron: str
    timezone: str
    catchup: str
    max_catchup: int
    overlap: str
    max_lateness_seconds: float
    paused: bool
    auto_pause_after: int | None
    paused_reason: str | None  # why it paused itself
    next_fire_at: datetime.datetime
    last_fire_at: datetime.datetime | None
    last_run_id: uuid.UUID | None
    last_run_status: str | None
    last_error: str | None  # why a due time did not fire
    created_at: datetime.datetime
    updated_at: datetime.datetime
    retired_at: datetime.datetime | None


def put(key: str, workflow: Callable | str, args: Sequence[Any] = (), *, cron: str, timezone: str = "UTC",
        catchup: str = "fire_once", max_catchup: int | None = None, overlap: str = "allow",
        max_lateness_seconds: float = 60.0, paused: bool = False, auto_pause_after: int | None = None,
        source: str = API_SOURCE, conn: Any = None) -> ScheduleInfo:
    """Add or change the schedule `key`: run `workflow(*args)` at the times
    of `cron` read in `timezone`. The options are the manifest's (max_catchup
    only with catchup="fire_all"). Writes nothing when the schedule is already
    so; else a new version. Returns the schedule as written."""
    raw: dict[str, Any] = {
        "workflow": _workflow_name(workflow), "args": list(args) if isinstance(args, (list, tuple)) else args,
        "cron": cron, "timezone": timezone, "catchup": catchup, "overlap": overlap,
        "max_lateness_seconds": max_lateness_seconds, "paused": paused,
    }
    if max_catchup is not None:
        raw["max_catchup"] = max_catchup
    if auto_pause_after is not None:
        raw["auto_pause_after"] = auto_pause_after
    spec = _validate(key, raw, source)  # before the database is touched
    _check_runnable(key, workflow, spec)
    conn = transaction_connection(conn, "everystep.schedules.put()")
    entry = _refused_as_error(lambda: scheduler.plan_entry(
        key, spec, db.load_schedule(conn, key, lock=True), db.database_now(conn), source))
    if entry.writes:
        scheduler.write(conn, entry, spec, source)
    return _info(db.load_schedule(conn, key))


def pause(key: str, *, source: str = API_SOURCE, conn: Any = None) -> ScheduleInfo:
    """Pause the schedule `key`: it fires nothing until resumed."""
    conn = transaction_connection(conn, "everystep.schedules.pause()")
    row = _owned_live_row(conn, key, source)
    if not row["paused"]:
        db.set_schedule_paused(conn, key, True, None)
    return _info(db.load_schedule(conn, key))


def resume(key: str, *, source: str = API_SOURCE, conn: Any = None) -> ScheduleInfo:
    """Resume a paused (or auto-paused) schedule, from its next fire time
    after now: nothing is caught up for the pause."""
    conn = transaction_connection(conn, "everystep.schedules.resume()")
    row = _owned_live_row(conn, key, source)
    if row["paused"]:
        next_fire_at = scheduler.next_fire_time(row["cron"], row["timezone"], db.database_now(conn))
        db.set_schedule_paused(conn, key, False, next_fire_at)
    return _info(db.load_schedule(conn, key))


def retire(key: str, *, source: str = API_SOURCE, conn: Any = None) -> datetime.datetime:
    """Retire the schedule `key`: it never fires again (its row stays; a
    later put() revives it). Returns when it was retired."""
    _validate_source(source)
    conn = transaction_connection(conn, "everystep.schedules.retire()")
    return _refused_as_error(lambda: db.retire_schedule(conn, key, source))


def get(key: str, *, conn: Any = None) -> ScheduleInfo | None:
    """The schedule `key` (of any source, retired or not), or None."""
    row = db.load_schedule(transaction_connection(conn, "everystep.schedules.get()", write=False), key)
    return None if row is None else _info(row)


# ---------------------------------------------------------------- helpers

def _workflow_name(workflow: Callable | str) -> Any:
    if callable(workflow):
        name = registry.workflow_name(workflow)
        if name is None:
            raise ScheduleError(f"everystep.schedules.put(): {workflow!r} is not an @workflow function")
        return name
    return workflow  # a module.qualname, checked as the manifest checks it


def _check_runnable(key: str, workflow: Callable | str, spec: Schedule) -> None:
    """A schedule whose runs could never start (no such workflow, a step, args
    that do not fit) is refused rather than firing failing runs."""
    if callable(workflow):
        problem = registry.arguments_problem(workflow, spec.args)
        problem = problem and f"{spec.workflow}{problem}"
    else:
        problem = registry.workflow_problem(spec.workflow, spec.args)
    if problem:
        raise ScheduleError(f"everystep.schedules.put(): schedule {key!r}: {problem}")


def _validate(key: str, raw: dict, source: str) -> Schedule:
    """The manifest's validation, with its one-line messages."""
    from everystep.config import ConfigError, read_schedule  # noqa: PLC0415  (the manifest's rules)

    _validate_source(source)
    try:
        return read_schedule("everystep.schedules.put()", key, raw)
    except ConfigError as exc:
        raise ScheduleError(str(exc)) from None


def _validate_source(source: str) -> None:
    from everystep.config import ConfigError, read_source  # noqa: PLC0415

    try:
        read_source("everystep.schedules: source", source)
    except ConfigError as exc:
        raise ScheduleError(str(exc)) from None


def _owned_live_row(conn: Any, key: str, source: str) -> dict:
    _validate_source(source)
    row = db.load_schedule(conn, key, lock=True)
    if row is None:
        raise ScheduleError(f"no schedule {key!r}")
    if row["retired_at"] is not None:
        raise ScheduleError(f"schedule {key!r} was retired at {scheduler.iso_utc(row['retired_at'])}")
    if row["source"] != source:
        raise ScheduleError(f"schedule {key!r} belongs to source {row['source']!r}, not {source!r}: "
                            "it is left alone")
    return row


def _refused_as_error(action: Callable[[], Any]) -> Any:
    try:
        return action()
    except db.ScheduleRefused as refused:
        raise ScheduleError(str(refused)) from None


def _info(row: dict) -> ScheduleInfo:
    args = row["args"]
    fields = {name: row[name] for name in ScheduleInfo.__dataclass_fields__ if name not in ("state", "args")}
    return ScheduleInfo(**fields, state=scheduler.state_of(row),
                        args=serde.from_json(json.loads(args) if isinstance(args, str) else args))


__all__ = ["Schedule", "ScheduleError", "ScheduleInfo", "get", "pause", "put", "resume", "retire"]
