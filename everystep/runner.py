"""Replay of one claimed run. Knows nothing about processes.

On every claim the workflow function is called from the top with its stored
args. Each step call looks up its step id among the recorded steps: a recorded
outcome is served without running the function; otherwise the function runs
and its outcome is recorded: before the next step starts, with the end of the
run, or OUTCOME_DELAY after the step returned, whichever comes first.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import psycopg
from psycopg_pool import ConnectionPool

from everystep import db, metrics, observe, registry, serde
from everystep.context import (
    MAX_STEP_ID,
    Outcome,
    RunContext,
    Scope,
    current_run,
    current_scope,
    run_branches,
)
from everystep.errors import (
    Cancelled,
    ChildFailed,
    Drain,
    EffectUncertain,
    EverystepError,
    LostClaim,
    Parked,
    Terminal,
    WorkflowCodeError,
)
from everystep.ids import uuid7
from everystep.retries import RetryPolicy
from everystep.schema import RunStatus, StepStatus
from everystep.writer import GroupWriter

log = logging.getLogger("everystep")

# The step name of a durable sleep's row.
SLEEP = "everystep.sleep"
# The step names of a wait for a message's row, and of a set_event's.
WAIT = "everystep.wait_for"
EVENT = "everystep.set_event"
# The step names of a child's start (result {"child": id}) and of a wait for its end.
START = "everystep.start"
RESULT = "everystep.result"
# A wait no longer than this (seconds) is waited on the run's thread; a longer
# one parks the run (`waiting`), its slot given back.
MOMENT = 1.0


@functools.cache
def _step_metrics(workflow: str, step: str, status: str) -> tuple:
    """The labelled step counter and histogram (labels are code-defined
    names, so this stays small): looked up once, not at every step."""
    return metrics.STEP_RUNS.labels(workflow, step, status), metrics.STEP_DURATION.labels(workflow, step)


@functools.cache
def _run_metrics(workflow: str, outcome: str) -> tuple:
    return metrics.WORKFLOW_RUNS.labels(workflow, outcome), metrics.WORKFLOW_DURATION.labels(workflow, outcome)


class Fence:
    """How an execution's writes stay fenced by its claim, beyond the
    database's own check of the execution token. A worker supplies one tied
    to its liveness lock; this default never interrupts and retries a write
    that failed on a connection error a few times with back-off."""

    def check(self, run: db.ClaimedRun) -> None:
        """Before a step starts: raise `Drain` to stop at this step boundary,
        block while the claim is uncertain, raise `LostClaim` once it is gone."""

    def before_write(self, run: db.ClaimedRun) -> None:
        """Before every write about the run: block while the claim is
        uncertain, raise `LostClaim` once it is gone."""

    def wait_after_error(self, run: db.ClaimedRun, attempt: int, error: Exception) -> None:
        """After a write failed on a connection error: wait before the retry,
        or raise to give up."""
        if attempt >= 8:
            raise error
        time.sleep(min(0.1 * 2**attempt, 5.0))


class Successors:
    """Whether the statement that ends a run may also claim the next run for
    the slot it frees. This default never claims."""

    # The workflows a successor may be of (LIKE patterns, db.routes_of; None: all).
    routes: list[str] | None = None

    def reserve(self, run: db.ClaimedRun) -> bool:
        """Asked once, as this execution of the run is about to end. True
        obliges the caller of `Runner.execute` to take the execution's
        `successor` (or its absence) into account once it returns or raises."""
        return False


class Execution(NamedTuple):
    """What one execution of a run came to, as `Runner.execute` returns it."""
    outcome: str  # completed, failed, stopped, blocked, cancelled, sleeping (parked waiting),
    # requeued (drain) or abandoned (claim lost)
    successor: db.ClaimedRun | None  # claimed for this slot by the statement that ended the run
    look_again: bool  # the runner may hold runs it does not know of: an answer was lost, or another
    # execution's row was found


# The step name a patch decision is recorded under (see Replay.patched).
PATCH_STEP = "everystep.patched"


# A step's outcome, on the run's own thread, waits for the next step or the
# end of the run to be written with it, but never longer than this (seconds):
# a body that sleeps or computes between two steps does not leave it unwritten.
OUTCOME_DELAY = 0.05


class _LateOutcomes:
    """The runs executing in this process, and one daemon thread that writes
    the outcomes that have waited OUTCOME_DELAY."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.replays: set[Replay] = set()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, replay: Replay) -> None:
        with self.lock:
            self.replays.add(replay)
            if self.thread is None:
                self.thread = threading.Thread(target=self._write_forever, name="everystep-outcomes", daemon=True)
                self.thread.start()

    def discard(self, replay: Replay) -> None:
        with self.lock:
            self.replays.discard(replay)

    def _write_forever(self) -> None:
        while True:
            time.sleep(OUTCOME_DELAY / 2)
            due = time.perf_counter() - OUTCOME_DELAY
            with self.lock:
                replays = list(self.replays)
            for replay in replays:
                replay.write_late_outcome(due)


_late_outcomes = _LateOutcomes()
# A forked child starts without the parent's threads, and with no run of its own.
os.register_at_fork(after_in_child=_late_outcomes.reset)


class Runner:
    """Executes claimed runs under one runner name, writing through a pool."""

    def __init__(self, pool: ConnectionPool, name: str, fence: Fence | None = None,
                 successors: Successors | None = None):
        self.pool = pool
        self.name = name
        self.fence = fence or Fence()
        self.successors = successors or Successors()
        # Step rows and run ends of all this runner's executions share commits:
        # step rows in batches of their own, so that none waits behind the
        # heavier statement that ends runs and claims their successors.
        self.step_writer = GroupWriter(pool, name, lambda: None)
        self.end_writer = GroupWriter(pool, name, lambda: self.successors.routes)

    def close(self) -> None:
        """Stop the writers (once no execution writes any more)."""
        self.step_writer.close()
        self.end_writer.close()

    def execute(self, run: db.ClaimedRun) -> Execution:
        """Replay one held run to an end and say what happened: how it ended,
        and the run its end claimed for this slot, if any."""
        started = time.perf_counter()
        replay = Replay(self, run)
        _late_outcomes.add(replay)
        extra = {"run": str(run.id), "workflow": run.name, "runner": self.name}
        try:
            replay.trace = observe.run_started(replay)
            outcome = replay.run()
        except LostClaim as exc:
            log.warning("claim lost, run abandoned: %s", exc, extra=extra)
            metrics.CLAIMS_LOST.labels(self.name).inc()
            outcome = "abandoned"
        except BaseException as exc:
            if not isinstance(exc, Exception):  # SystemExit or the like out of user code: not ours to record
                _late_outcomes.discard(replay)
                replay.release()
                raise
            # The engine itself failed on this run.
            log.exception("engine error on run; marking it failed", extra=extra)
            observe.run_ending(replay, RunStatus.FAILED, exc)
            try:
                error = serde.dumps(serde.encode_exception(exc))
                replay.end(RunStatus.FAILED, None, error, None)
                outcome = RunStatus.FAILED
            except LostClaim:
                outcome = "abandoned"
            except Exception:
                log.exception("could not mark the run failed; it stays claimed", extra=extra)
                replay.look_again = True  # still held here, executed by nobody: replay it
                outcome = "abandoned"
        return self._ended(run, replay, outcome, started)

    @staticmethod
    def _ended(run: db.ClaimedRun, replay: Replay, outcome: str, started: float) -> Execution:
        _late_outcomes.discard(replay)
        replay.release()
        observe.run_ended(replay, outcome)
        runs, duration = _run_metrics(run.name, outcome)
        runs.inc()
        duration.observe(time.perf_counter() - started)
        return Execution(outcome, replay.successor, replay.look_again)


class Replay:
    """One execution of one run: serves recorded steps and records new ones."""

    def __init__(self, runner: Runner, run: db.ClaimedRun):
        self.runner = runner
        self.claim = run
        self.run_id: uuid.UUID = run.id
        self.token: int = run.token
        self.workflow_name: str = run.name
        self.args = run.args
        # step id -> [name, status, result, error, attempts]
        self.recorded: dict[str, list] = {row[0]: row[1:] for row in run.steps}
        # A cancel request known to this execution (from its claim or a step
        # write's answer), and whether the body got its `Cancelled` yet.
        self.cancel_requested = run.cancel_requested
        self.cancel_delivered: Cancelled | None = None
        self.halt: BaseException | None = None
        self._halt_lock = threading.Lock()
        self.context = RunContext(run.id, run.name, runner.name, self)
        # What the end of the execution hands back (see Execution).
        self.successor: db.ClaimedRun | None = None
        self.claim_successor: bool | None = None  # asked once, at the end
        self.look_again = False
        # The run's own connection, for the writes of the thread executing it;
        # parallel branches borrow from the pool for each write.
        self._owner = threading.get_ident()
        self._conn: psycopg.Connection | None = None
        self._cursor: psycopg.Cursor | None = None
        # The outcome of the owner thread's last step, not written yet: it is
        # written before the next step starts, or with the run's end.
        # (row, started, written by) guarded by _outcome_lock, which is held
        # while it is written.
        self._unwritten: tuple[db.StepRow, float, float] | None = None
        self._outcome_lock = threading.Lock()
        self._late_failure_logged = False
        self.trace: Any = None  # the tracing and error-report hooks' state (everystep.observe)

    # -------------------------------------------------------------- writes

    @contextlib.contextmanager
    def cursor(self) -> Iterator[psycopg.Cursor]:
        """A cursor for one write. The thread executing the run keeps one
        pooled connection, and one cursor on it, for the whole execution;
        parallel branches borrow a connection from the pool for each write."""
        if threading.get_ident() != self._owner:
            with self.runner.pool.connection() as conn:
                yield conn.cursor()
            return
        if self._cursor is None:
            self._conn = self.runner.pool.getconn()
            self._cursor = self._conn.cursor()
        try:
            yield self._cursor
        except db.CONNECTION_ERRORS:
            self.release()  # the pool discards a broken connection; the retry gets another
            raise

    def release(self) -> None:
        if self._conn is not None:
            self.runner.pool.putconn(self._conn)
            self._conn = self._cursor = None

    def _fenced(self, write: Callable[..., Any], args: tuple, step_id: str | None, status: str, what: str,
                grouped: bool = False) -> Any:
        """Run a fenced db write about this execution and return what it
        returned, retrying connection errors as the fence allows. A write that
        matches nothing is explained (db.why_not_written): this execution's
        own earlier attempt wrote it (its answer was lost): None is returned;
        the run is no longer held by this execution, or another execution
        wrote the row: `LostClaim`. `grouped`: a write of the runner's writer,
        which takes no cursor."""
        attempt = 0
        while True:
            try:
                self.runner.fence.before_write(self.claim)
                if grouped:
                    done = write(self.run_id, self.runner.name, self.token, *args)
                else:
                    with self.cursor() as cur:
                        done = write(cur, self.run_id, self.runner.name, self.token, *args)
                if done is not None and done is not False:
                    return done
                with self.cursor() as cur:
                    why = db.why_not_written(cur, self.run_id, self.runner.name, self.token, step_id, status)
                if why == db.WRITTEN:
                    return None
                if why == db.OTHER:
                    # Held here, but not by this execution's writes: the worker
                    # looks again at what it holds and replays the run afresh.
                    self.look_again = True
                    raise LostClaim(f"run {self.run_id}: another execution wrote {what}; this one stops")
                raise LostClaim(f"run {self.run_id} is no longer held by this execution under "
                                f"{self.runner.name} ({what})")
            except db.CONNECTION_ERRORS as exc:
                self.look_again = True  # the answer may be lost: a claim made by it included
                self.runner.fence.wait_after_error(self.claim, attempt, exc)
                attempt += 1

    # -------------------------------------------------------------- the run

    def run(self) -> str:
        try:
            fn = registry.resolve(self.workflow_name)
        except TypeError as exc:
            raise EverystepError(str(exc)) from None
        args = serde.from_json(self.args)
        scope_token = current_scope.set(Scope(self.context))
        run_token = current_run.set(self.context)
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001  (decided below)
            return self._end(exc, None)
        finally:
            current_scope.reset(scope_token)
            current_run.reset(run_token)
        return self._end(None, value)

    def _end(self, raised: BaseException | None, value: Any) -> str:
        # A halt wins over whatever the body did with it.
        exc = self.halt or raised
        with self._outcome_lock:
            unwritten, self._unwritten = self._unwritten, None
        if isinstance(exc, LostClaim):
            raise exc
        if isinstance(exc, Parked):
            return "sleeping"  # parked by the statement that recorded it
        if isinstance(exc, Drain):
            if unwritten is not None:
                self._write_step(unwritten[0], unwritten[1], update=False)  # recorded before the requeue
            self._fenced(lambda cur, run, runner, token: db.requeue_held(cur, runner, [db.Claim(run, token)]),
                         (), None, RunStatus.SCHEDULED, "requeueing the run")
            metrics.REQUEUED.labels(self.runner.name).inc()
            return "requeued"
        if exc is not None and not isinstance(exc, Exception):
            raise exc  # KeyboardInterrupt, SystemExit: not ours to record
        if self.cancel_delivered is not None:
            # Cancelled at a step call: the run ends `cancelled`, with what the
            # body returned, or with what it raised (the Cancelled itself when
            # it let it through), or with the Cancelled when it returned.
            status, result, error = RunStatus.CANCELLED, None, None
            if exc is None:
                error = serde.dumps(serde.encode_exception(self.cancel_delivered))
                try:
                    result = serde.dumps(value)
                except EverystepError:
                    pass
            else:
                error = serde.dumps(serde.encode_exception(exc))
        elif exc is None:
            try:
                status, result, error = RunStatus.COMPLETED, serde.dumps(value), None
            except EverystepError as bad:
                status, result, error = RunStatus.FAILED, None, serde.dumps(serde.encode_exception(bad))
        else:
            status = (
                RunStatus.STOPPED if isinstance(exc, Terminal)
                else RunStatus.BLOCKED if isinstance(exc, EffectUncertain) else RunStatus.FAILED
            )
            result, error = None, serde.dumps(serde.encode_exception(exc))
            if status == RunStatus.FAILED:
                log.warning(
                    "run failed: %s: %s", type(exc).__name__, exc,
                    extra={"run": str(self.run_id), "workflow": self.workflow_name, "runner": self.runner.name},
                    exc_info=exc,
                )
        observe.run_ending(self, status, exc)
        return self.end(status, result, error, unwritten)

    def end(self, status: str, result: str | None, error: str | None,
            unwritten: tuple[db.StepRow, float, float] | None) -> str:
        """The last step's row, the run's end and the claim of the next run for
        this slot: one statement, one commit. The successor, if any, is left in
        `self.successor`. Returns the run's end as written (`cancelled` when a
        cancel request reached the row first)."""
        row = None if unwritten is None else unwritten[0]
        if self.claim_successor is None:
            self.claim_successor = self.runner.successors.reserve(self.claim)

        def write_end(run: uuid.UUID, runner: str, token: int, last_step: db.StepRow | None) -> str | None:
            done = self.runner.end_writer.finish_run(run, token, status, result, error, last_step,
                                                 self.claim_successor and self.successor is None)
            if done.successor is not None:
                self.successor = done.successor  # this slot's next run, whatever became of this end
            if done.step_exists:
                raise psycopg.errors.UniqueViolation(f"step {last_step.step_id!r} of run {run} exists")
            return done.status

        try:
            ended = self._fenced(write_end, (row,), None, status, "ending the run", grouped=True)
        except psycopg.errors.UniqueViolation:
            # The last step's row is there already: written by this execution's
            # earlier attempt (then end without it), or by another execution.
            with self.cursor() as cur:
                why = db.why_not_written(cur, self.run_id, self.runner.name, self.token, row.step_id, row.status)
            if why != db.WRITTEN:
                self.look_again = self.look_again or why == db.OTHER
                raise LostClaim(f"run {self.run_id}: step {row.step_id!r} was written by another execution") from None
            ended = self._fenced(write_end, (None,), None, status, "ending the run", grouped=True)
        # None: an earlier attempt ended it, and its claim, if any, is found
        # by the worker looking again (look_again is set by the retry).
        if unwritten is not None:
            self._count(row.name, row.status, unwritten[1])
        return ended or status

    def stop_with(self, exc: BaseException) -> BaseException:
        """Set the run's halt (the first one wins) and return it to raise."""
        with self._halt_lock:
            if self.halt is None:
                self.halt = exc
            return self.halt

    def outcomes(self) -> Mapping[str, Outcome]:
        self._write_unwritten()
        return {
            step_id: Outcome(
                name, status, serde.from_json(result) if status == StepStatus.DONE else None,
                serde.decode_exception(error) if status == StepStatus.FAILED else None,
            )
            for step_id, (name, status, result, error, _) in list(self.recorded.items())
        }

    # -------------------------------------------------------------- steps

    def step(self, scope: Scope, fn: Callable, name: str, unsafe: bool, args: tuple, kwargs: dict,
             everystep_id: str | None, retry: RetryPolicy | None = None) -> Any:
        step_id = scope.next_id(everystep_id)
        if self.halt is not None:
            raise self.halt
        recorded = self.recorded.get(step_id)
        rerun_started = False
        attempts: list = []
        if recorded is not None:
            rec_name, status, result, error, attempts = recorded
            attempts = attempts or []
            if rec_name != name:
                raise self.stop_with(WorkflowCodeError(
                    f"step {step_id!r} was recorded as {rec_name} but the workflow now calls {name} there; "
                    "the workflow code changed in a way that breaks replay"
                ))
            if status == StepStatus.DONE:
                return serde.from_json(result)
            if status == StepStatus.FAILED:
                exc = serde.decode_exception(error)
                observe.step_ended(self, None, name, StepStatus.FAILED, exc)  # no span: served; the report's step tag
                if isinstance(exc, Terminal):
                    raise self.stop_with(exc)
                if isinstance(exc, Cancelled) and self.cancel_delivered is None:
                    self.cancel_delivered = exc  # delivered here by an earlier execution
                raise exc
            if status == StepStatus.STARTED and unsafe:  # no outcome: the effect may or may not have happened
                raise self.stop_with(EffectUncertain(
                    f"step {step_id!r} ({name}) is unsafe to repeat and was started without a recorded "
                    "outcome; resolve it with `everystep resolve-step`"
                ))
            # `started` of a step no longer unsafe (run it again), or `retrying`: the row is updated in place.
            rerun_started = True

        self._boundary(step_id, name, rerun_started)
        if attempts:  # retrying: the back-off recorded with the last failed attempt comes first
            self._wait(scope, attempts[-1]["retry_at"], self.claim.claimed_at)
        args_json = serde.dumps(list(args))
        kwargs_json = serde.dumps(kwargs)
        while True:
            started = (time.perf_counter(), time.time())
            if unsafe:
                self._record(step_id, name, args_json, kwargs_json, StepStatus.STARTED, None, None, rerun_started,
                             started)
                rerun_started = True

            scope_token = current_scope.set(None)  # a step called inside a step is a plain call
            traced = observe.step_started(self, step_id, name)
            failure: Exception | None = None
            try:
                value = fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (recorded, then re-raised or retried)
                failure = exc
                observe.step_ended(self, traced, name, StepStatus.FAILED, exc)
            finally:
                current_scope.reset(scope_token)
            if failure is None:
                observe.step_ended(self, traced, name, StepStatus.DONE)
                result = serde.encode(value)  # unserializable: EverystepError here, nothing recorded
                self._record(step_id, name, args_json, kwargs_json, StepStatus.DONE, result, None, rerun_started,
                             started)
                return value
            error = serde.encode_exception(failure)
            retried = retry is not None and retry.retried(unsafe, failure, len(attempts))
            if retried and not isinstance(failure, Terminal):
                attempt = self._record_attempt(step_id, name, args_json, kwargs_json, error, len(attempts) + 1,
                                               retry.backoff.wait(len(attempts) + 1), started)
                attempts.append(attempt)
                rerun_started = True
                self._wait(scope, attempt["retry_at"], attempt["at"])
                self._deliver_cancel(step_id, name, update=True)  # a cancel request learnt meanwhile
                continue
            self._record(step_id, name, args_json, kwargs_json, StepStatus.FAILED, None, error, rerun_started, started)
            if isinstance(failure, Terminal):
                raise self.stop_with(failure)
            raise failure

    def _boundary(self, step_id: str, name: str, update: bool = False) -> None:
        """Before a new step (or sleep) starts: stop here for a drain or a
        lost claim, write the previous step's outcome (its answer tells of a
        cancel request), and deliver a known cancel request. `update`: the
        step has a row already (`retrying`, or `started` by a step no longer
        unsafe)."""
        try:
            self.runner.fence.check(self.claim)
        except (Drain, LostClaim) as exc:
            raise self.stop_with(exc) from None
        self._write_unwritten()  # the previous step's outcome is written before this step starts
        self._deliver_cancel(step_id, name, update)

    def _deliver_cancel(self, step_id: str, name: str, update: bool) -> None:
        """Raise a known cancel request as `Cancelled` (once), recorded as
        this step's failure so that a replay raises it at the same call."""
        if not self.cancel_requested or self.cancel_delivered is not None:
            return
        with self.cursor() as cur:
            cancelled = Cancelled(db.cancel_reason(cur, self.run_id))
        self.cancel_delivered = cancelled
        self._record(step_id, name, "[]", "{}", StepStatus.FAILED, None, serde.encode_exception(cancelled), update,
                     (time.perf_counter(), time.time()))
        metrics.CANCELLATIONS.labels(self.workflow_name).inc()
        raise cancelled

    def _record_attempt(self, step_id: str, name: str, args: str, kwargs: str, error: dict, attempt: int,
                        wait: float, started: tuple[float, float]) -> dict:
        """Record a failed attempt that will be retried after `wait` seconds;
        returns the attempt as recorded (its times by the database's clock)."""
        row = db.StepRow(step_id, name, args, kwargs, StepStatus.RETRYING, None, serde.dump_data(error), started[1],
                            time.time())
        self._write_unwritten()
        try:
            done = self._fenced(db.record_attempt, (row, attempt, wait), step_id, StepStatus.RETRYING,
                                f"attempt {attempt} of step {step_id!r}")
        except LostClaim as lost:
            raise self.stop_with(lost) from None
        if done is None:  # written by this execution's earlier try: its answer was lost
            self.look_again = True
            raise self.stop_with(LostClaim(f"run {self.run_id}: the answer of a write was lost; replaying"))
        self._cancel_known(done)
        metrics.STEP_RETRIES.labels(self.workflow_name, name).inc()
        attempts = self.recorded.setdefault(step_id, [name, StepStatus.RETRYING, None, None, []])
        attempts[1], attempts[4] = StepStatus.RETRYING, (attempts[4] or []) + [done.attempt]
        return done.attempt

    # -------------------------------------------------------------- time

    def sleep(self, scope: Scope, seconds: float | None, until: Any) -> None:
        """A durable sleep: a recorded step whose result is the wake time."""
        step_id = scope.next_id(None)
        if self.halt is not None:
            raise self.halt
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded[0] != SLEEP:
                raise self.stop_with(WorkflowCodeError(
                    f"step {step_id!r} was recorded as {recorded[0]} but the workflow now sleeps there; "
                    "the workflow code changed in a way that breaks replay"
                ))
            if recorded[1] == StepStatus.FAILED:
                exc = serde.decode_exception(recorded[3])
                if isinstance(exc, Cancelled) and self.cancel_delivered is None:
                    self.cancel_delivered = exc
                raise exc
            self._wait(scope, float(recorded[2]), self.claim.claimed_at)
            return
        self._boundary(step_id, SLEEP)
        done = self._fenced(db.record_sleep, (step_id, SLEEP, seconds, until), step_id, StepStatus.DONE, "a sleep")
        if done is None:  # written by this execution's earlier try: its answer was lost
            self.look_again = True
            raise self.stop_with(LostClaim(f"run {self.run_id}: the answer of a write was lost; replaying"))
        self.recorded[step_id] = [SLEEP, StepStatus.DONE, done.wake_at, None, None]
        self._wait(scope, done.wake_at, done.now)

    def _wait(self, scope: Scope, wake_at: float, now: float) -> None:
        """Wait until `wake_at` (database time; `now` is the database's time
        as last seen): a moment on this thread; longer, the run is parked
        `waiting` (this execution ends with Parked) unless a cancel request
        is on it (then it returns, and the next step call gets `Cancelled`).
        Parallel branches always wait on their thread."""
        remaining = wake_at - now
        if remaining <= 0:
            return
        if remaining > MOMENT and scope.prefix == "" and threading.get_ident() == self._owner:
            self._write_unwritten()
            parking = self._fenced(db.park_run, (wake_at,), None, RunStatus.WAITING, "parking the run")
            if parking is None or parking.parked:
                raise self.stop_with(Parked())
            if parking.cancel_requested:
                self.cancel_requested = True
                return
            return  # the time came meanwhile
        time.sleep(remaining)

    def _cancel_known(self, written: Any) -> None:
        if getattr(written, "cancel_requested", False):
            self.cancel_requested = True

    def _record(self, step_id: str, name: str, args: str, kwargs: str, status: str,
                result: Any, error: dict | None, update: bool, started: tuple[float, float]) -> None:
        """Record a step's row; `result` and `error` are plain JSON data.

        The outcome of a step of the run's own thread is written a little
        later: before the next step starts, or in the statement that ends the
        run, which saves a commit per run — or by the late-outcome thread
        after OUTCOME_DELAY. Steps are at-least-once, so an outcome lost with
        the worker in between only means the step runs again. The `started`
        mark of an unsafe step, and its outcome, are written at once.
        `started`: (perf_counter, time) when the step started."""
        row = db.StepRow(step_id, name, args, kwargs, status,
                            None if status != StepStatus.DONE else serde.dump_data(result),
                            None if error is None else serde.dump_data(error),
                            started[1], None if status == StepStatus.STARTED else time.time())
        attempts = self.recorded.get(step_id, [None] * 5)[4]
        self.recorded[step_id] = [name, status, result, error, attempts]
        if status != StepStatus.STARTED and not update and threading.get_ident() == self._owner:
            with self._outcome_lock:
                self._unwritten = (row, started[0], time.perf_counter())
        else:
            self._write_step(row, started[0], update)

    def _write_unwritten(self) -> None:
        """Write the outcome waiting to be written, if any (or wait for the
        late-outcome thread to finish writing it)."""
        with self._outcome_lock:
            if self._unwritten is not None:
                self._write_step(self._unwritten[0], self._unwritten[1], update=False)
                self._unwritten = None

    def write_late_outcome(self, due: float) -> None:
        """From the late-outcome thread: write the waiting outcome if it has
        waited since before `due`, unless the run's thread is at it."""
        unwritten = self._unwritten
        if unwritten is None or unwritten[2] > due or self.halt is not None:
            return
        if not self._outcome_lock.acquire(blocking=False):
            return  # the run's own thread is writing it now
        try:
            if self._unwritten is unwritten:
                self._write_step(unwritten[0], unwritten[1], update=False)
                self._unwritten = None
        except LostClaim:
            pass  # the run is halted; its own thread reports it
        except Exception as exc:
            if not self._late_failure_logged:  # retried every tick: say it once
                self._late_failure_logged = True
                log.warning("could not write a step outcome yet (%s); retrying", exc, extra={"run": str(self.run_id)})
        finally:
            self._outcome_lock.release()

    def _write_step(self, row: db.StepRow, started: float, update: bool) -> None:
        try:
            if update:
                written = self._fenced(db.complete_started_step, (row,), row.step_id, row.status,
                                       f"step {row.step_id!r}")
            else:
                written = self._fenced(self.runner.step_writer.record_step, (row,), row.step_id, row.status,
                                       f"step {row.step_id!r}", grouped=True)
        except LostClaim as lost:
            raise self.stop_with(lost) from None
        self._cancel_known(written)
        if row.status != StepStatus.STARTED:
            self._count(row.name, row.status, started)

    def _count(self, name: str, status: str, started: float) -> None:
        runs, duration = _step_metrics(self.workflow_name, name, status)
        runs.inc()
        duration.observe(time.perf_counter() - started)

    # -------------------------------------------------------------- messages and events

    def wait_for(self, scope: Scope, topic: str, timeout: float | None) -> Any:
        """The next message on `topic` for this run, or None once `timeout`
        seconds (from the first time the run reached this wait) have passed.
        Recorded like a step: a `started` row with the deadline, then `done`
        with the message (consumed by this wait in the same statement) or the
        timeout. While nothing comes the run is parked `waiting`, its slot
        given back; a send on the topic makes it due at once."""
        result = self._recorded_wait(scope, WAIT, "waits for a message", topic, f"message:{topic}", timeout,
                                     db.take_message, topic)
        return serde.from_json(result["message"]) if "message" in result else None

    def _recorded_wait(self, scope: Scope, name: str, doing: str, topic: str, waiting_on: str,
                       timeout: float | None, take: Callable, what: Any) -> dict:
        """A wait recorded like a step (`name`: WAIT or RESULT): its `started`
        row with `topic` and the deadline, then, once something came or the
        deadline passed, its result (parked meanwhile, see _wait_until_done)."""
        step_id = scope.next_id(None)
        if self.halt is not None:
            raise self.halt
        recorded = self.recorded.get(step_id)
        if recorded is not None and recorded[0] != name:
            raise self.stop_with(WorkflowCodeError(
                f"step {step_id!r} was recorded as {recorded[0]} but the workflow now {doing} there; "
                "the workflow code changed in a way that breaks replay"
            ))
        if recorded is None:
            self._boundary(step_id, name)
            begun = self._fenced(db.begin_wait, (step_id, name, topic, timeout), step_id, StepStatus.STARTED,
                                 "a wait")
            if begun is None:  # written by this execution's earlier try: its answer was lost
                self.look_again = True
                raise self.stop_with(LostClaim(f"run {self.run_id}: the answer of a write was lost; replaying"))
            recorded = self.recorded[step_id] = [name, StepStatus.STARTED, begun.result, None, None]
        if recorded[1] == StepStatus.FAILED:
            exc = serde.decode_exception(recorded[3])
            if isinstance(exc, Cancelled) and self.cancel_delivered is None:
                self.cancel_delivered = exc
            raise exc
        if recorded[1] == StepStatus.STARTED:
            recorded[2] = self._wait_until_done(scope, step_id, take, what, waiting_on, recorded[2].get("deadline"))
            recorded[1] = StepStatus.DONE
        return recorded[2]

    def _wait_until_done(self, scope: Scope, step_id: str, take: Callable, what: Any, waiting_on: str,
                         deadline: float | None) -> dict:
        """Until the started wait `step_id` ends (`take`: db.take_message
        or db.take_child, about `what`): its recorded result. Parks the
        run on `waiting_on` while nothing came."""
        parks = scope.prefix == "" and threading.get_ident() == self._owner
        pause = 0.02
        while True:
            took = self._fenced(take, (step_id, what, deadline), step_id, StepStatus.DONE, "a wait")
            if took is None:
                self.look_again = True
                raise self.stop_with(LostClaim(f"run {self.run_id}: the answer of a write was lost; replaying"))
            if took.result is not None:
                return took.result
            remaining = None if deadline is None else deadline - took.now
            if parks and (remaining is None or remaining > MOMENT):
                parking = self._fenced(db.park_waiting, (deadline, waiting_on, took.wakes), None,
                                       RunStatus.WAITING, "parking the run")
                if parking is None or parking.parked:
                    raise self.stop_with(Parked())
                if parking.cancel_requested:
                    self._cancel_wait(step_id)
                continue  # a message came, or the child ended, meanwhile
            # A parallel branch, or a moment to go: wait on this thread.
            time.sleep(pause if remaining is None else max(0.0, min(pause, remaining)))
            pause = min(pause * 2, 0.5)

    # -------------------------------------------------------------- child workflows

    def start_child(self, scope: Scope, child_name: str, args_json: str) -> uuid.UUID:
        """Schedule a child run once, recorded like a step: a replay returns
        the same child."""
        step_id = scope.next_id(None)
        if self.halt is not None:
            raise self.halt
        recorded = self.recorded.get(step_id)
        if recorded is None:
            self._boundary(step_id, START)
            result = self._fenced(db.start_child, (step_id, START, uuid7(), child_name, args_json), step_id,
                                  StepStatus.DONE, "starting a child")
            if result is None:
                self.look_again = True
                raise self.stop_with(LostClaim(f"run {self.run_id}: the answer of a write was lost; replaying"))
            recorded = self.recorded[step_id] = [START, StepStatus.DONE, result, None, None]
        elif recorded[0] != START:
            raise self.stop_with(WorkflowCodeError(
                f"step {step_id!r} was recorded as {recorded[0]} but the workflow now starts a child there; "
                "the workflow code changed in a way that breaks replay"
            ))
        if recorded[1] == StepStatus.FAILED:
            raise serde.decode_exception(recorded[3])
        return uuid.UUID(recorded[2]["child"])

    def child_result(self, scope: Scope, child: uuid.UUID, timeout: float | None) -> Any:
        """Wait (parked) until the child run ends: its result, or ChildFailed
        for a child that failed, stopped or was cancelled; TimeoutError after
        `timeout` seconds. Recorded like a step."""
        end = self._recorded_wait(scope, RESULT, "waits for a child", f"child:{child}", f"child:{child}", timeout,
                                  db.take_child, child)
        if end.get("timeout"):
            raise TimeoutError(f"child run {child} did not end within the timeout")
        if end["status"] == RunStatus.COMPLETED:
            return serde.from_json(end["result"])
        raise ChildFailed(child, end["status"], None if end["error"] is None else serde.decode_exception(end["error"]))

    def _cancel_wait(self, step_id: str) -> None:
        """A cancel request reached a run in a wait: the wait raises `Cancelled`
        (recorded as its failure, so a replay raises it at the same call)."""
        self.cancel_requested = True
        with self.cursor() as cur:
            cancelled = Cancelled(db.cancel_reason(cur, self.run_id))
        self.cancel_delivered = cancelled
        self._record(step_id, WAIT, "[]", "{}", StepStatus.FAILED, None, serde.encode_exception(cancelled), True,
                     (time.perf_counter(), time.time()))
        metrics.CANCELLATIONS.labels(self.workflow_name).inc()
        raise cancelled

    def set_event(self, scope: Scope, key: str, value_json: str) -> None:
        """Publish `key` = value for the outside (`everystep.get_event`),
        recorded like a step: a replay does not write it again."""
        step_id = scope.next_id(None)
        if self.halt is not None:
            raise self.halt
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded[0] != EVENT:
                raise self.stop_with(WorkflowCodeError(
                    f"step {step_id!r} was recorded as {recorded[0]} but the workflow now sets an event there; "
                    "the workflow code changed in a way that breaks replay"
                ))
            return
        self._boundary(step_id, EVENT)
        self._fenced(db.set_event, (step_id, EVENT, key, value_json), step_id, StepStatus.DONE, "an event")
        self.recorded[step_id] = [EVENT, StepStatus.DONE, None, None, None]

    # -------------------------------------------------------------- patches

    def patched(self, scope: Scope, patch: str) -> bool:
        """Whether this run takes the new branch of the patch `patch`: the
        decision recorded for it, else True when the run's recorded history
        in this scope goes no further than here (it reaches the patch for the
        first time under the new code), False when it does (it went the old
        way). The decision is recorded like a step, under its own id
        (`<scope>patch:<name>`; the name is checked by the caller), so the positional ids of the steps around it
        do not move, and every later replay decides the same."""
        step_id = f"{scope.prefix}patch:{patch}"
        if len(step_id) > MAX_STEP_ID:
            raise EverystepError(f"patch id {step_id[:60]}... is {len(step_id)} characters; at most {MAX_STEP_ID}")
        if self.halt is not None:
            raise self.halt
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded[0] != PATCH_STEP:
                raise self.stop_with(WorkflowCodeError(
                    f"id {step_id!r} was recorded as the step {recorded[0]}, not as a patch"))
            return bool(serde.from_json(recorded[2]))
        with scope.lock:
            reached = set(scope.used)  # the ids this scope has given out so far (a fork's: its branches too)
        went_further = any(
            other.startswith(scope.prefix) and other[len(scope.prefix):].split(".")[0] not in reached
            and row[0] != PATCH_STEP
            for other, row in list(self.recorded.items())
        )
        try:
            self.runner.fence.check(self.claim)
        except (Drain, LostClaim) as exc:
            raise self.stop_with(exc) from None
        self._write_unwritten()
        now = (time.perf_counter(), time.time())
        self._record(step_id, PATCH_STEP, "[]", "{}", StepStatus.DONE, not went_further, None, False, now)
        return not went_further

    # -------------------------------------------------------------- parallel

    def fork(self, scope: Scope, branches: tuple, everystep_id: str | None) -> tuple:
        fork_id = scope.next_id(everystep_id)
        if self.halt is not None:
            raise self.halt
        self._write_unwritten()  # the branches' steps come after it
        scopes = [scope.branch(fork_id, i) for i in range(len(branches))]
        results = run_branches(branches, scopes)
        if self.halt is not None:
            raise self.halt
        return results
