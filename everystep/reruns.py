"""Re-running a run from one of its steps (`everystep.rerun`, `everystep
rerun RUN --from-step STEP_ID`, the UI's button).

A re-run is a new run of the same workflow and args, linked back to the
original (`rerun_of`), into which the recorded outcomes of the steps before
the chosen one are copied: replay serves them, so only the chosen step and
what follows it execute. The original keeps its row and its steps.

Which steps are "before" the chosen one, by their step ids (dotpaths: "3",
"3.1.2" is step 2 of branch 1 of parallel 3, "charge" a named step):

- a step earlier in the same sequence (the first component where the two ids
  differ is a position in a sequence: compared as numbers, or, where a name
  stands, by the order the steps were recorded in) is before it, and so is
  everything inside an earlier parallel;
- a step in another branch of a parallel the chosen step is in ran beside
  it: it is before it only if it finished before the chosen step started
  (by their recorded times; rows without times, by the order they were
  recorded in).

A re-run is refused (nothing written) for a run that does not exist, a step
id the run does not have, a run still in flight (scheduled, waiting,
running or blocked), and when a step before the chosen one is an unsafe
step whose outcome is unknown (its row `started`, never resolved): copying
it would say its effect happened, and leaving it would repeat it.
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import psycopg

from everystep import db
from everystep.db import queries
from everystep.db.queries import Plan
from everystep.errors import EverystepError
from everystep.ids import uuid7
from everystep.schema import TERMINAL, StepStatus

ENGINE_ROWS = "everystep."  # the step names of the engine's own rows: sleeps, waits, child starts, events


class RerunRefused(EverystepError):
    """A re-run was refused; nothing was written."""


class RerunNotFound(RerunRefused):
    """The run, or its step, does not exist."""


def _path(step_id: str) -> list[str]:
    return step_id.split(".")


def _time(text: Any) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(text) if text else None


def _relation(step: dict, target: dict) -> str:
    """How `step` stands to `target`: "before", "after", or "beside" (another
    branch of a parallel both are in)."""
    a, b = _path(step["step_id"]), _path(target["step_id"])
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        if i % 2 == 1:  # a branch index: two branches of one parallel
            return "beside"
        if x.isdigit() and y.isdigit():
            return "before" if int(x) < int(y) else "after"
        return "before" if step["id"] < target["id"] else "after"
    return "before" if step["id"] < target["id"] else "after"


def _finished_before(step: dict, target: dict) -> bool:
    finished, started = _time(step.get("finished_at")), _time(target.get("started_at"))
    if finished is not None and started is not None:
        return finished <= started
    return step["id"] < target["id"] and step["status"] != StepStatus.STARTED


def _started_before(step: dict, target: dict) -> bool:
    started, target_started = _time(step.get("started_at")), _time(target.get("started_at"))
    if started is not None and target_started is not None:
        return started < target_started
    return step["id"] < target["id"]


def steps_to_copy(run: uuid.UUID, steps: list[dict], from_step: str) -> list[str]:
    """The step ids whose recorded outcomes a re-run from `from_step` copies
    (see the module's doc), in recorded order; RerunRefused when the run has
    no such step or one of them is an unsafe step whose outcome is unknown."""
    target = next((s for s in steps if s["step_id"] == from_step), None)
    if target is None:
        raise RerunNotFound(f"run {run} has no step {from_step!r}")
    copied = []
    for step in steps:
        if step is target:
            continue
        relation = _relation(step, target)
        uncertain = step["status"] == StepStatus.STARTED and not step["name"].startswith(ENGINE_ROWS)
        if relation == "before" or (relation == "beside" and uncertain and _started_before(step, target)):
            if uncertain:
                raise RerunRefused(
                    f"step {step['step_id']!r} of run {run} is an unsafe step whose outcome is unknown (started, "
                    f"never recorded): re-run from it, or from an earlier step")
            if step["status"] != StepStatus.STARTED:  # a wait that never ended is waited for again
                copied.append(step["step_id"])
        elif relation == "beside" and step["status"] != StepStatus.STARTED and _finished_before(step, target):
            copied.append(step["step_id"])
    return copied


def rerun_in(conn: psycopg.Connection, run: uuid.UUID, from_step: str, actor: str, source: str
             ) -> tuple[uuid.UUID, list[str]]:
    """Schedule the re-run of `run` from `from_step` in the caller's
    transaction, with its audit record (`rerun`, on the new run); returns the
    new run and the step ids copied."""
    return queries.run(conn, rerunning(run, from_step, actor, source))


def rerunning(run: uuid.UUID, from_step: str, actor: str, source: str) -> Plan:
    """rerun_in as a plan (queries.Plan), for a caller on either kind of connection."""
    if not isinstance(from_step, str) or not from_step:
        raise RerunRefused("from_step must be a step id, e.g. 3 or charge or fan.0.1")
    found = yield from db.rerun_source(run)
    if found is None:
        raise RerunNotFound(f"no run {run}")
    status, steps = found
    if status not in TERMINAL:
        raise RerunRefused(f"run {run} is {status}, still in flight: a run is re-run once it has ended "
                           "(cancel it first?)")
    copied = steps_to_copy(run, steps, from_step)
    new = yield from db.insert_rerun(run, uuid7(), copied)
    yield from db.audit_entry(actor, source, "rerun", run=new, step_id=from_step, target=str(run),
                              details={"rerun_of": str(run), "from_step": from_step, "copied": len(copied)})
    return new, copied
