"""Replay of one claimed run. Knows nothing about processes.

On every claim the workflow function is called from the top with its stored
args. Each step call looks up its step id among the recorded steps: a recorded
outcome is served without running the function; otherwise the function runs
and its outcome is recorded: before the next step starts, with the end of the
run, or OUTCOME_DELAY after the step returned, whichever comes first.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from everystep import metrics, observe, serde, store
from everystep.context import Outcome, RunContext, Scope, current_run, current_scope
from everystep.errors import (
    Drain,
    EffectUncertain,
    EverystepError,
    LostClaim,
    Terminal,
    WorkflowCodeError,
)

log = logging.getLogger("everystep")

# Workflows by name, filled by @workflow at import time.
REGISTRY: dict[str, Callable] = {}

# Ends of a run that are decided by the run itself, whatever the body does
# with them: once raised, every later step call raises the same again.
HALTS = (Terminal, EffectUncertain, LostClaim, WorkflowCodeError, Drain)


@functools.cache
def _step_metrics(workflow: str, step: str, status: str) -> tuple:
    """The labelled step counter and histogram (labels are code-defined
    names, so this stays small): looked up once, not at every step."""
    return metrics.STEP_RUNS.labels(workflow, step, status), metrics.STEP_DURATION.labels(workflow, step)


@functools.cache
def _run_metrics(workflow: str, outcome: str) -> tuple:
    return metrics.WORKFLOW_RUNS.labels(workflow, outcome), metrics.WORKFLOW_DURATION.labels(workflow, outcome)


class Lease:
    """How a runner's runs stay claimed. A worker supplies one tied to its
    liveness lock; this default never interrupts and retries a write that
    failed on a connection error a few times with back-off."""

    def check(self, run_id: uuid.UUID) -> None:
        """Before a step starts: raise `Drain` to stop at this step boundary,
        block while the claim is uncertain, raise `LostClaim` once it is gone."""

    def before_write(self, run_id: uuid.UUID) -> None:
        """Before every write about the run: block while the claim is
        uncertain, raise `LostClaim` once it is gone."""

    def wait_after_error(self, run_id: uuid.UUID, attempt: int, error: Exception) -> None:
        """After a write failed on a connection error: wait before the retry,
        or raise to give up."""
        if attempt >= 8:
            raise error
        time.sleep(min(0.1 * 2**attempt, 5.0))

    def claim_next(self) -> bool:
        """When a run is about to end: whether the statement that ends it may
        claim the next run, for the slot it frees. True obliges one call of
        `claimed_next` after that statement."""
        return False

    def claimed_next(self, runs: list[store.ClaimedRun]) -> None:
        """The runs that statement claimed (none if it failed): the lease
        holder starts them."""


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

    def __init__(self, pool: ConnectionPool, name: str, lease: Lease | None = None):
        self.pool = pool
        self.name = name
        self.lease = lease or Lease()

    def execute(self, run: store.ClaimedRun) -> str:
        """Replay one held run to an end; returns how it ended: completed,
        failed, stopped, blocked, requeued (drain) or abandoned (claim lost)."""
        started = time.perf_counter()
        replay = Replay(self, run)
        _late_outcomes.add(replay)
        try:
            replay.trace = observe.run_started(replay)
            outcome = replay.run()
        except LostClaim as exc:
            extra = {"run": str(run.id), "workflow": run.name, "runner": self.name}
            log.warning("claim lost, run abandoned: %s", exc, extra=extra)
            metrics.CLAIMS_LOST.labels(self.name).inc()
            outcome = "abandoned"
        except Exception as exc:  # the engine itself failed on this run
            extra = {"run": str(run.id), "workflow": run.name, "runner": self.name}
            log.exception("engine error on run; marking it failed", extra=extra)
            observe.run_ending(replay, "failed", exc)
            try:
                error = serde.dumps(serde.encode_exception(exc))
                ended = replay.write(store.finish_run, run.id, self.name, "failed", None, error)
                outcome = "failed" if ended is not None else "abandoned"  # None: no longer held
            except Exception:
                log.exception("could not mark the run failed; it stays claimed", extra=extra)
                outcome = "abandoned"
        finally:
            _late_outcomes.discard(replay)
            replay.release()
        observe.run_ended(replay, outcome)
        runs, duration = _run_metrics(run.name, outcome)
        runs.inc()
        duration.observe(time.perf_counter() - started)
        return outcome

class Replay:
    """One execution of one run: serves recorded steps and records new ones."""

    def __init__(self, runner: Runner, run: store.ClaimedRun):
        self.runner = runner
        self.run_id: uuid.UUID = run.id
        self.workflow_name: str = run.name
        self.args = run.args
        self.recorded: dict[str, list] = {row[0]: row[1:] for row in run.steps}
        self.halt: BaseException | None = None
        self._halt_lock = threading.Lock()
        self.context = RunContext(run.id, run.name, runner.name, self)
        # The run's own connection, for the writes of the thread executing it;
        # parallel branches borrow from the pool for each write.
        self._owner = threading.get_ident()
        self._conn: psycopg.Connection | None = None
        self._cursor: psycopg.Cursor | None = None
        # The outcome of the owner thread's last step, not written yet: it is
        # written before the next step starts, or with the run's end.
        # (row, started, finished), guarded by _outcome_lock, which is held
        # while it is written.
        self._unwritten: tuple[tuple, float, float] | None = None
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
        except store.CONNECTION_ERRORS:
            self.release()  # the pool discards a broken connection; the retry gets another
            raise

    def release(self) -> None:
        if self._conn is not None:
            self.runner.pool.putconn(self._conn)
            self._conn = self._cursor = None

    def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one store write about this run, retrying connection errors
        as the lease allows."""
        attempt = 0
        while True:
            self.runner.lease.before_write(self.run_id)
            try:
                with self.cursor() as cur:
                    return fn(cur, *args)
            except store.CONNECTION_ERRORS as exc:
                self.runner.lease.wait_after_error(self.run_id, attempt, exc)
                attempt += 1

    def _fenced(self, write: Callable[..., Any], args: tuple, written_before: Callable[[psycopg.Cursor], bool],
                what: str) -> Any:
        """Run a fenced store write about this run and return what it returned,
        retrying connection errors as the lease allows; raise `LostClaim` when
        it matched nothing (returned False or None). A retried write that
        matches nothing may have been committed by its earlier attempt, whose
        answer was lost: `written_before` tells, and then this returns None."""
        attempt = 0
        while True:
            try:
                self.runner.lease.before_write(self.run_id)
                with self.cursor() as cur:
                    done = write(cur, self.run_id, self.runner.name, *args)
                    if done is not None and done is not False:
                        return done
                    if attempt and written_before(cur):
                        return None
                raise LostClaim(f"run {self.run_id} is no longer running under {self.runner.name} ({what})")
            except store.CONNECTION_ERRORS as exc:
                self.runner.lease.wait_after_error(self.run_id, attempt, exc)
                attempt += 1

    # -------------------------------------------------------------- the run

    def run(self) -> str:
        fn = REGISTRY.get(self.workflow_name)
        if fn is None:
            fn = serde.import_path(self.workflow_name)
            if getattr(fn, "__everystep_workflow__", None) != self.workflow_name:
                raise EverystepError(f"{self.workflow_name} is not an @workflow")
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
        if isinstance(exc, Drain):
            if unwritten is not None:
                self._write_step(unwritten[0], unwritten[1], update=False)  # recorded before the requeue
            if not self.write(store.requeue_held, [self.run_id], self.runner.name):
                raise LostClaim(f"run {self.run_id} is no longer running under {self.runner.name} (requeue)")
            metrics.REQUEUED.labels(self.runner.name).inc()
            return "requeued"
        if exc is not None and not isinstance(exc, Exception):
            raise exc  # KeyboardInterrupt, SystemExit: not ours to record
        if exc is None:
            try:
                status, result, error = "completed", serde.dumps(value), None
            except EverystepError as bad:
                status, result, error = "failed", None, serde.dumps(serde.encode_exception(bad))
        else:
            status = (
                "stopped" if isinstance(exc, Terminal) else "blocked" if isinstance(exc, EffectUncertain) else "failed"
            )
            result, error = None, serde.dumps(serde.encode_exception(exc))
            if status == "failed":
                log.warning(
                    "run failed: %s: %s", type(exc).__name__, exc,
                    extra={"run": str(self.run_id), "workflow": self.workflow_name, "runner": self.runner.name},
                    exc_info=exc,
                )
        observe.run_ending(self, status, exc)
        # The last step's row, the run's end and the claim of the next run for
        # this slot: one statement, one commit.
        row = None if unwritten is None else unwritten[0]
        lease = self.runner.lease
        claim = lease.claim_next()
        claimed = None
        try:
            claimed = self._fenced(store.finish_run, (status, result, error, row, claim),
                                   lambda cur: store.run_ended_as(cur, self.run_id, self.runner.name, status),
                                   "ending the run")
        finally:
            if claim:
                # An earlier attempt's claims, if its answer was lost, are
                # found by the worker's reconciliation (see wait_after_error).
                lease.claimed_next(claimed or [])
        if unwritten is not None:
            self._count(row[1], row[4], unwritten[1])
        return status

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
                name, status, serde.from_json(result) if status == "done" else None,
                serde.decode_exception(error) if status == "failed" else None,
            )
            for step_id, (name, status, result, error) in list(self.recorded.items())
        }

    # -------------------------------------------------------------- steps

    def step(self, scope: Scope, fn: Callable, name: str, unsafe: bool, args: tuple, kwargs: dict,
             everystep_id: str | None) -> Any:
        step_id = scope.next_id(everystep_id)
        if self.halt is not None:
            raise self.halt
        recorded = self.recorded.get(step_id)
        rerun_started = False
        if recorded is not None:
            rec_name, status, result, error = recorded
            if rec_name != name:
                raise self.stop_with(WorkflowCodeError(
                    f"step {step_id!r} was recorded as {rec_name} but the workflow now calls {name} there; "
                    "the workflow code changed in a way that breaks replay"
                ))
            if status == "done":
                return serde.from_json(result)
            if status == "failed":
                exc = serde.decode_exception(error)
                observe.step_ended(self, None, name, "failed", exc)  # no span: served; the report's step tag
                if isinstance(exc, Terminal):
                    raise self.stop_with(exc)
                raise exc
            if unsafe:  # started, no outcome: the effect may or may not have happened
                raise self.stop_with(EffectUncertain(
                    f"step {step_id!r} ({name}) is unsafe to repeat and was started without a recorded "
                    "outcome; resolve it with `everystep resolve-step`"
                ))
            rerun_started = True  # the unsafe mark was removed from the code: run it again

        try:
            self.runner.lease.check(self.run_id)
        except (Drain, LostClaim) as exc:
            raise self.stop_with(exc) from None
        self._write_unwritten()  # the previous step's outcome is written before this step starts
        args_json = serde.dumps(list(args))
        kwargs_json = serde.dumps(kwargs)
        started = time.perf_counter()
        if unsafe and not rerun_started:
            self._record(step_id, name, args_json, kwargs_json, "started", None, None, False, started)
            rerun_started = True

        scope_token = current_scope.set(None)  # a step called inside a step is a plain call
        traced = observe.step_started(self, step_id, name)
        try:
            value = fn(*args, **kwargs)
        except Exception as exc:
            observe.step_ended(self, traced, name, "failed", exc)
            error = serde.encode_exception(exc)
            self._record(step_id, name, args_json, kwargs_json, "failed", None, error, rerun_started, started)
            if isinstance(exc, Terminal):
                raise self.stop_with(exc)  # noqa: B904  (the Terminal itself)
            raise
        finally:
            current_scope.reset(scope_token)
        observe.step_ended(self, traced, name, "done")
        result = serde.encode(value)  # unserializable: EverystepError here, nothing recorded
        self._record(step_id, name, args_json, kwargs_json, "done", result, None, rerun_started, started)
        return value

    def _record(self, step_id: str, name: str, args: str, kwargs: str, status: str,
                result: Any, error: dict | None, update: bool, started: float) -> None:
        """Record a step's row; `result` and `error` are plain JSON data.

        The outcome of a step of the run's own thread is written a little
        later: before the next step starts, or in the statement that ends the
        run, which saves a commit per run — or by the late-outcome thread
        after OUTCOME_DELAY. Steps are at-least-once, so an outcome lost with
        the worker in between only means the step runs again. The `started`
        mark of an unsafe step, and its outcome, are written at once."""
        row = (step_id, name, args, kwargs, status,
               None if status != "done" else serde.dump_data(result),
               None if error is None else serde.dump_data(error))
        self.recorded[step_id] = [name, status, result, error]
        if status != "started" and not update and threading.get_ident() == self._owner:
            with self._outcome_lock:
                self._unwritten = (row, started, time.perf_counter())
        else:
            self._write_step(row, started, update)

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

    def _write_step(self, row: tuple, started: float, update: bool) -> None:
        step_id, name, status = row[0], row[1], row[4]

        def written_before(cur: psycopg.Cursor) -> bool:
            if not store.is_held(cur, self.run_id, self.runner.name):
                return False
            found = store.step_row(cur, self.run_id, step_id)
            return found is not None and found[1] == status

        try:
            self._fenced(store.complete_started_step if update else store.record_step, row, written_before,
                         f"recording step {step_id!r}")
        except LostClaim as lost:
            raise self.stop_with(lost) from None
        if status != "started":
            self._count(name, status, started)

    def _count(self, name: str, status: str, started: float) -> None:
        runs, duration = _step_metrics(self.workflow_name, name, status)
        runs.inc()
        duration.observe(time.perf_counter() - started)

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


def run_branches(branches: tuple, scopes: list[Scope] | None) -> tuple:
    """Run each branch on its own thread (the last on this one), wait for all,
    and return their results in order; raise one failure as is, several as an
    ExceptionGroup. With `scopes`, each branch records into its scope."""
    results: list[Any] = [None] * len(branches)
    errors: list[BaseException | None] = [None] * len(branches)

    def run_one(i: int) -> None:
        if scopes is not None:
            current_scope.set(scopes[i])
        try:
            branch = branches[i]
            if isinstance(branch, (list, tuple)):
                results[i] = tuple(call() for call in branch)
            else:
                results[i] = branch()
        except BaseException as exc:  # noqa: BLE001  (re-raised by the caller)
            errors[i] = exc

    for branch in branches:
        calls = branch if isinstance(branch, (list, tuple)) else [branch]
        for call in calls:
            if not callable(call):
                raise TypeError(f"parallel() takes zero-argument callables or lists of them, not {call!r}")
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(run_one, i), daemon=True)
        for i in range(len(branches) - 1)
    ]
    for thread in threads:
        thread.start()
    if branches:
        contextvars.copy_context().run(run_one, len(branches) - 1)
    for thread in threads:
        thread.join()

    failures = [exc for exc in errors if exc is not None]
    for exc in failures:
        if isinstance(exc, HALTS) or not isinstance(exc, Exception):
            raise exc
    if len(failures) == 1:
        raise failures[0]
    if failures:
        raise ExceptionGroup(f"{len(failures)} of {len(branches)} parallel branches failed", failures)
    return tuple(results)
