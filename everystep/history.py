"""Recorded histories, and the replay check before a deploy.

`export` writes runs with their recorded steps as one JSON document
(`everystep runs export`). `replay` (`everystep replay-check`,
everystep.testing.replay) replays each recorded run against the code
imported now, by the engine's own replay rules (everystep.runner.Replay),
without executing any step: every outcome comes from the history, and a
call the history has no outcome for ends the check of that run there (an
unfinished run goes on from there when a worker claims it; a finished one
has nothing more to do). It reports, per run, OK, or the first step id where
the code now calls another function than the one recorded — the
divergence the engine raises at run time as WorkflowCodeError — or the
recorded function with other arguments (the engine would serve the outcome
recorded for the old ones), or another workflow as a child, or another
event key; and where `patched()` takes the old branch for the run.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import threading
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import psycopg

from everystep import db, registry, serde
from everystep.context import Scope
from everystep.errors import WorkflowCodeError
from everystep.execution import Fence, HeldRun, Lent, Successors
from everystep.runner import EVENT, PATCH_STEP, START, Replay, drive
from everystep.schema import TERMINAL, StepStatus

FORMAT = "everystep.history/1"

log = logging.getLogger("everystep")


# ---------------------------------------------------------------- export

def _plain(value: Any) -> Any:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime.datetime):
        return value.astimezone(datetime.UTC).isoformat()
    return value


def export(conn: psycopg.Connection, run_ids: Iterable[uuid.UUID]) -> dict:
    """The runs (in the order given) with their recorded steps, from one
    snapshot, as a history document. A run that does not exist is a
    LookupError naming it."""
    runs = []
    with conn.transaction():
        for run_id in run_ids:
            run = db.load_run(conn, run_id)
            if run is None:
                raise LookupError(f"no run {run_id}")
            steps = db.load_steps(conn, run_id)
            runs.append({
                "id": str(run["id"]), "workflow": run["name"], "status": run["status"], "args": run["args"],
                "result": run["result"], "error": run["error"], "created_at": _plain(run["created_at"]),
                "completed_at": _plain(run["completed_at"]),
                "steps": [{key: _plain(step[key]) for key in ("step_id", "name", "status", "args", "kwargs",
                                                               "result", "error", "attempts")}
                          for step in steps],
            })
    return {"format": FORMAT, "exported_at": datetime.datetime.now(datetime.UTC).isoformat(), "runs": runs}


def load(source: str | Path | Mapping) -> dict:
    """A history document: given as is, or read from a file."""
    history = dict(source) if isinstance(source, Mapping) else json.loads(Path(source).read_text(encoding="utf-8"))
    if history.get("format") != FORMAT or not isinstance(history.get("runs"), list):
        raise ValueError(f"not an everystep history (format {FORMAT!r}, from `everystep runs export`)")
    return history


# ---------------------------------------------------------------- the check

class Divergence(NamedTuple):
    step_id: str
    recorded: str  # what the history has there
    now: str  # what the code does there now
    message: str


class Patch(NamedTuple):
    """A patched() decision the check made for a run (not served from its record)."""
    step_id: str  # <scope>patch:<name>
    new_code: bool  # True: the new branch; False: the old one (the run went past the patch the old way)


class Checked(NamedTuple):
    """The check of one recorded run."""
    run_id: str
    workflow: str
    status: str  # as recorded
    replayed: int  # recorded steps served
    divergence: Divergence | None
    patches: list[Patch]
    note: str | None  # what else differs from the record, without making the run diverge
    error: str | None  # the run could not be checked (its workflow is not in the code)

    @property
    def ok(self) -> bool:
        return self.divergence is None and self.error is None


class ReplayReport(list):
    """The checks of a history's runs, in its order; `ok` when none diverges."""

    @property
    def ok(self) -> bool:
        return all(checked.ok for checked in self)

    @property
    def diverged(self) -> list[Checked]:
        return [checked for checked in self if not checked.ok]

    def text(self) -> str:
        lines = []
        for c in self:
            head = f"{'OK' if c.ok else 'ERROR' if c.error else 'DIVERGED':<9} {c.run_id}  {c.workflow}  {c.status}"
            if c.error:
                lines.append(f"{head}: {c.error}")
                continue
            if c.divergence is not None:
                lines.append(f"{head}: at step {c.divergence.step_id}: {c.divergence.message}")
            else:
                lines.append(f"{head}: {c.replayed} recorded steps replayed")
            for patch in c.patches:
                branch = "the new code" if patch.new_code else "the old code (its history went past the patch)"
                lines.append(f"          {patch.step_id}: patched() decides {patch.new_code}: {branch}")
            if c.note:
                lines.append(f"          note: {c.note}")
        bad = len(self.diverged)
        lines.append(f"{len(self)} runs checked: {len(self) - bad} OK, {bad} diverge" if self else "no runs checked")
        return "\n".join(lines)

    def data(self) -> list[dict]:
        return [{"run": c.run_id, "workflow": c.workflow, "status": c.status, "ok": c.ok, "replayed": c.replayed,
                 "divergence": c.divergence._asdict() if c.divergence else None,
                 "patches": [p._asdict() for p in c.patches], "note": c.note, "error": c.error} for c in self]


def replay(history: str | Path | Mapping, imports: Iterable[str] = ()) -> ReplayReport:
    """Replay every run of a history (a document, or a file of one) against
    the code, after importing `imports`; no step is executed and nothing is
    written anywhere. See the module."""
    for module in imports:
        registry.import_module(module)
    return ReplayReport(_check(run) for run in load(history)["runs"])


class _EndOfHistory(BaseException):
    """The code reached a call the history has no outcome for."""


def _check(run: dict) -> Checked:
    workflow, status = run["workflow"], run["status"]
    try:
        registry.resolve(workflow)
    except Exception as exc:  # noqa: BLE001  (whatever importing it raised)
        return Checked(run["id"], workflow, status, 0, None, [], None,
                       f"the workflow is not in the code: {type(exc).__name__}: {exc}")
    steps = run["steps"]
    claimed = db.ClaimedRun(uuid.UUID(run["id"]), workflow, run["args"],
                            [[s["step_id"], s["name"], s["status"], s["result"], s["error"], s["attempts"]]
                             for s in steps],
                            token=0, claimed_at=math.inf)  # every recorded wake time has passed
    history = _History(claimed)
    checking = _Checking(history, claimed, {s["step_id"]: s for s in steps})
    quiet = _Quiet(run["id"])
    log.addFilter(quiet)  # the runner's "run failed" of a diverging run is this report's business
    try:
        drive(checking.run())  # the replay rules, driven on this thread as a sync run's are
    except _EndOfHistory:
        pass
    finally:
        log.removeFilter(quiet)
    halt = history.halt
    divergence = checking.divergence
    if divergence is None and isinstance(halt, WorkflowCodeError):
        row = checking.rows.get(checking.last_id or "")
        divergence = Divergence(checking.last_id or "?", row["name"] if row else "", "", str(halt))
    note = None
    if divergence is None and status in TERMINAL:
        if isinstance(halt, _EndOfHistory):
            note = (f"the run {status} in its history, and the code now goes on past its end (step "
                    f"{checking.last_id}): a run in flight there would run it")
        elif history.ended is not None and history.ended != status:
            note = f"the code now ends this history {history.ended}, where the run {status}"
    return Checked(run["id"], workflow, status, len(checking.served), divergence, history.patches, note, None)


class _Quiet(logging.Filter):
    """Drops the engine's log lines about one run."""

    def __init__(self, run_id: str):
        super().__init__()
        self.run_id = run_id

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "run", None) != self.run_id


def _call(name: str, args: Any, kwargs: Any) -> str:
    """A recorded or new call, as the report shows it."""
    values = serde.from_json(args) if isinstance(args, list) else []
    shown = [repr(value) for value in values]
    shown += [f"{key}={serde.from_json(value)!r}" for key, value in (kwargs or {}).items()]
    text = ", ".join(shown)
    return f"{name}({text if len(text) <= 120 else text[:117] + '...'})"


class _Checking(Replay):
    """The engine's replay rules, and on top the check of each recorded
    step's arguments, the workflow a recorded child start starts and the key
    a recorded set_event sets; a step's function is never called."""

    def __init__(self, history: _History, run: db.ClaimedRun, rows: dict[str, dict]):
        super().__init__(history, run)
        self.rows = rows
        self.served: set[str] = set()
        self.divergence: Divergence | None = None
        self.last_id: str | None = None
        self._call = threading.local()  # the call whose id is being taken, on this thread

    def _next_id(self, scope: Scope, everystep_id: str | None) -> str:
        step_id = super()._next_id(scope, everystep_id)
        self.last_id = step_id
        calling, self._call.what = getattr(self._call, "what", None), None
        row = self.rows.get(step_id)
        if row is not None:
            self.served.add(step_id)
            if calling is not None:
                self._compare(step_id, row, *calling)
        return step_id

    def _compare(self, step_id: str, row: dict, name: str, args: Any, kwargs: Any) -> None:
        recorded, now = _call(row["name"], row["args"], row["kwargs"]), _call(name, args, kwargs)
        if row["name"] != name:
            # The engine raises WorkflowCodeError at this call (Replay.step's own check).
            self.divergence = Divergence(step_id, recorded, now, (
                f"recorded {recorded}, the code now calls {now} there: the engine fails the run with "
                "WorkflowCodeError"))
        elif row["args"] != args or (kwargs is not None and (row["kwargs"] or {}) != kwargs):
            what = ("the arguments differ (the engine would serve the outcome recorded for the old ones)"
                    if name not in (START, EVENT) else
                    "another child workflow" if name == START else "another event key")
            self.divergence = Divergence(step_id, recorded, now, f"recorded {recorded}, the code now calls "
                                                                 f"{now}: {what}")
            raise self.held.stop_with(WorkflowCodeError(self.divergence.message))

    def step(self, scope: Scope, fn: Any, name: str, unsafe: bool, args: tuple, kwargs: dict,
             everystep_id: str | None, retry: Any = None, timeout: float | None = None,
             rate_limit: str | None = None, transactional: bool = False, write_behind: bool = False) -> Any:
        # A check of the recorded history takes no token (rate_limit unused),
        # runs no step (a transactional one opens no transaction) and writes
        # nothing (write_behind unused).
        self._call.what = (name, serde.encode(list(args)), serde.encode(kwargs))

        def never(*_args: Any, **_kwargs: Any) -> Any:
            raise self.held.stop_with(_EndOfHistory())

        return super().step(scope, never, name, unsafe, args, kwargs, everystep_id, retry)  # (never times out)

    def start_child(self, scope: Scope, child_name: str, args_json: str) -> uuid.UUID:
        self._call.what = (START, [child_name], None)
        return super().start_child(scope, child_name, args_json)

    def set_event(self, scope: Scope, key: str, value_json: str) -> None:
        self._call.what = (EVENT, [key], None)
        super().set_event(scope, key, value_json)

    def patched(self, scope: Scope, patch: str) -> bool:
        self.held.deciding.on = True
        try:
            return super().patched(scope, patch)
        finally:
            self.held.deciding.on = False


class _History(HeldRun):
    """The execution's HeldRun with the recorded history for all there is,
    and no database behind it: any write but a patch decision means that the
    code went past the history."""

    def __init__(self, run: db.ClaimedRun):
        super().__init__(Lent(None, "replay-check", Fence(), Successors(), None, None), run)  # type: ignore[arg-type]
        self.deciding = threading.local()  # on: patched() is deciding (its check() is no step)
        self.patches: list[Patch] = []
        self.ended: str | None = None

    def _past(self, *_args: Any) -> Any:
        raise self.stop_with(_EndOfHistory())

    def check(self) -> None:
        if not getattr(self.deciding, "on", False):
            self._past()

    def flush(self) -> None:
        pass

    def record_step(self, step_id: str, name: str, args: str, kwargs: str, status: str, result: Any,
                    error: dict | None, update: bool, started: tuple[float, float],
                    write_behind: bool = False) -> None:
        if name != PATCH_STEP or status != StepStatus.DONE:
            self._past()
        self.patches.append(Patch(step_id, bool(result)))

    def end(self, status: str, result: str | None, error: str | None) -> str:
        self.ended = status
        return status

    record_attempt = record_sleep = park = park_waiting = begin_wait = take_message = take_child = _past
    start_child = set_event = requeue = cancel_reason = deliver_cancel = start_traced = _past
