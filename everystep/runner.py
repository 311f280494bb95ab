"""Replay of one claimed run. Knows nothing about processes.

On every claim the workflow function is called from the top with its stored
args. Each step call looks up its step id among the recorded steps: a recorded
outcome is served without running the function; otherwise the function runs
and its outcome is recorded before the call returns.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from everystep import metrics, serde, store
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
        extra = {"run": str(run.id), "workflow": run.name, "runner": self.name}
        replay = Replay(self, run)
        try:
            outcome = replay.run()
        except LostClaim as exc:
            log.warning("claim lost, run abandoned: %s", exc, extra=extra)
            metrics.CLAIMS_LOST.labels(self.name).inc()
            outcome = "abandoned"
        except Exception as exc:  # the engine itself failed on this run
            log.exception("engine error on run; marking it failed", extra=extra)
            try:
                error = serde.dumps(serde.encode_exception(exc))
                replay.write(store.finish_run, run.id, self.name, "failed", None, error)
                outcome = "failed"
            except Exception:
                log.exception("could not mark the run failed; it stays claimed", extra=extra)
                outcome = "abandoned"
        finally:
            replay.release()
        elapsed = time.perf_counter() - started
        metrics.WORKFLOW_RUNS.labels(run.name, outcome).inc()
        metrics.WORKFLOW_DURATION.labels(run.name, outcome).observe(elapsed)
        log.debug("run %s in %.1f ms", outcome, elapsed * 1000, extra=extra)
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

    # -------------------------------------------------------------- writes

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if threading.get_ident() != self._owner:
            with self.runner.pool.connection() as conn:
                yield conn
            return
        if self._conn is None:
            self._conn = self.runner.pool.getconn()
        try:
            yield self._conn
        except psycopg.OperationalError:
            self.release()  # the pool discards a broken connection; the retry gets another
            raise

    def release(self) -> None:
        if self._conn is not None:
            self.runner.pool.putconn(self._conn)
            self._conn = None

    def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one store write about this run, retrying connection errors
        as the lease allows."""
        attempt = 0
        while True:
            self.runner.lease.before_write(self.run_id)
            try:
                with self.connection() as conn:
                    return fn(conn, *args)
            except psycopg.OperationalError as exc:
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
        if isinstance(exc, LostClaim):
            raise exc
        if isinstance(exc, Drain):
            self.write(store.requeue_held, [self.run_id], self.runner.name)
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
        if not self.write(store.finish_run, self.run_id, self.runner.name, status, result, error):
            raise LostClaim(f"run {self.run_id} is no longer running under {self.runner.name}")
        return status

    def stop_with(self, exc: BaseException) -> BaseException:
        """Set the run's halt (the first one wins) and return it to raise."""
        with self._halt_lock:
            if self.halt is None:
                self.halt = exc
            return self.halt

    def outcomes(self) -> Mapping[str, Outcome]:
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
        args_json = serde.dumps(list(args))
        kwargs_json = serde.dumps(kwargs)
        if unsafe and not rerun_started:
            self._record(step_id, name, args_json, kwargs_json, "started", None, None, update=False)
            rerun_started = True

        started = time.perf_counter()
        scope_token = current_scope.set(None)  # a step called inside a step is a plain call
        try:
            value = fn(*args, **kwargs)
        except Exception as exc:
            error = serde.encode_exception(exc)
            self._record(step_id, name, args_json, kwargs_json, "failed", None, error, update=rerun_started)
            self._count(name, "failed", started)
            if isinstance(exc, Terminal):
                raise self.stop_with(exc)  # noqa: B904  (the Terminal itself)
            raise
        finally:
            current_scope.reset(scope_token)
        result = serde.encode(value)  # unserializable: EverystepError here, nothing recorded
        self._record(step_id, name, args_json, kwargs_json, "done", result, None, update=rerun_started)
        self._count(name, "done", started)
        return value

    def _record(self, step_id: str, name: str, args: str, kwargs: str, status: str,
                result: Any, error: dict | None, update: bool) -> None:
        """Write a step row; `result` and `error` are plain JSON data."""
        write = store.complete_started_step if update else store.record_step
        result_json = None if status != "done" else serde.dump_data(result)
        error_json = None if error is None else serde.dump_data(error)
        attempt = 0
        while True:
            try:
                self.runner.lease.before_write(self.run_id)
                with self.connection() as conn:
                    if write(conn, self.run_id, self.runner.name, step_id, name, args, kwargs, status,
                             result_json, error_json):
                        break
                    # Matched nothing. After a retried write, it may be our own
                    # earlier attempt that committed before its answer was lost.
                    if attempt and store.is_held(conn, self.run_id, self.runner.name):
                        row = store.step_row(conn, self.run_id, step_id)
                        if row is not None and row[1] == status:
                            break
                raise LostClaim(
                    f"run {self.run_id} is no longer running under {self.runner.name} (recording step {step_id!r})"
                )
            except psycopg.OperationalError as exc:
                try:
                    self.runner.lease.wait_after_error(self.run_id, attempt, exc)
                except LostClaim as lost:
                    raise self.stop_with(lost) from None
                attempt += 1
            except LostClaim as lost:
                raise self.stop_with(lost) from None
        self.recorded[step_id] = [name, status, result, error]

    def _count(self, name: str, status: str, started: float) -> None:
        metrics.STEP_RUNS.labels(self.workflow_name, name, status).inc()
        metrics.STEP_DURATION.labels(self.workflow_name, name).observe(time.perf_counter() - started)

    # -------------------------------------------------------------- parallel

    def fork(self, scope: Scope, branches: tuple, everystep_id: str | None) -> tuple:
        fork_id = scope.next_id(everystep_id)
        if self.halt is not None:
            raise self.halt
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
