"""Replay of one claimed run. Knows nothing about processes.

On every claim the workflow function is called from the top with its stored
args. Each step call looks up its step id among the recorded steps: a recorded
outcome is served without running the function; otherwise the function runs
and its outcome is recorded: before the next step starts, with the end of the
run, or OUTCOME_DELAY (everystep.execution) after the step returned, whichever comes first.

`Runner.execute` is one run's life, claim to end. `Replay` holds the replay
rules and does no I/O: every read and write about the run goes through the
execution's `HeldRun` (everystep.execution), fenced by the claim.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from psycopg_pool import ConnectionPool

from everystep import db, faults, metrics, observe, registry, serde, tracing
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
from everystep.execution import Fence, HeldRun, Lent, Successors
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
# The step name a patch decision is recorded under (see Replay.patched).
PATCH_STEP = "everystep.patched"
# A wait no longer than this (seconds) is waited on the run's thread; a longer
# one parks the run (`waiting`), its slot given back.
MOMENT = 1.0


@functools.cache
def _run_metrics(workflow: str, outcome: str) -> tuple:
    return metrics.WORKFLOW_RUNS.labels(workflow, outcome), metrics.WORKFLOW_DURATION.labels(workflow, outcome)


class Execution(NamedTuple):
    """What one execution of a run came to, as `Runner.execute` returns it."""
    outcome: str  # completed, failed, stopped, blocked, cancelled, sleeping (parked waiting),
    # requeued (drain) or abandoned (claim lost)
    successor: db.ClaimedRun | None  # claimed for this slot by the statement that ended the run
    look_again: bool  # the runner may hold runs it does not know of: an answer was lost, or another
    # execution's row was found


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
        self._lent = Lent(pool, name, self.fence, self.successors, self.step_writer, self.end_writer)

    def close(self) -> None:
        """Stop the writers (once no execution writes any more)."""
        self.step_writer.close()
        self.end_writer.close()

    def execute(self, run: db.ClaimedRun) -> Execution:
        """Replay one held run to an end and say what happened: how it ended,
        and the run its end claimed for this slot, if any.

        The run's life crosses these threads: this one (the worker's slot
        thread) runs the workflow body and the steps it calls; the runner's
        writer threads commit its step rows and its end with other runs'
        (this thread waits for each answer); the late-outcome thread writes
        a step's outcome that waited OUTCOME_DELAY (everystep.execution);
        each `parallel` branch but the last runs on a thread of its own,
        writing through a connection borrowed for each write. The HeldRun
        does every write, whichever the thread; the Replay decides them."""
        started = time.perf_counter()
        extra = {"run": str(run.id), "workflow": run.name, "runner": self.name}
        with HeldRun(self._lent, run) as held:
            replay = Replay(held, run)
            try:
                # With tracing on, the execution is counted under the claim
                # (a fenced write like any other) and the span continues the
                # trace stored with the run.
                traced = held.start_traced() if tracing.enabled() else None
                replay.trace = observe.run_started(replay, traced)
                outcome = replay.run()
            except LostClaim as exc:
                log.warning("claim lost, run abandoned: %s", exc, extra=extra)
                metrics.CLAIMS_LOST.labels(self.name).inc()
                outcome = "abandoned"
            except Exception as exc:
                # The engine itself failed on this run. (SystemExit or the like
                # out of user code is not ours to record: it goes on up.)
                log.exception("engine error on run; marking it failed", extra=extra)
                observe.run_ending(replay, RunStatus.FAILED, exc)
                try:
                    held.end(RunStatus.FAILED, None, serde.dumps(serde.encode_exception(exc)), None)
                    outcome = RunStatus.FAILED
                except LostClaim:
                    outcome = "abandoned"
                except Exception:
                    log.exception("could not mark the run failed; it stays claimed", extra=extra)
                    held.look_again = True  # still held here, executed by nobody: replay it
                    outcome = "abandoned"
        observe.run_ended(replay, outcome)
        runs, duration = _run_metrics(run.name, outcome)
        runs.inc()
        duration.observe(time.perf_counter() - started)
        return Execution(outcome, held.successor, held.look_again)


class RecordedStep(NamedTuple):
    """A step as recorded when the run was claimed (or since, by this
    execution): `result` and `error` are plain JSON data, not yet decoded."""
    step_id: str
    name: str
    status: str  # done, failed, started or retrying
    result: Any
    error: dict | None
    attempts: list | None  # the failed attempts of a retried step, oldest first


def recorded_steps(raw: list) -> dict[str, RecordedStep]:
    """A claimed run's steps ([[step_id, name, status, result, error,
    attempts], ...] as stored), by step id."""
    return {row[0]: RecordedStep(*row) for row in raw}


class Replay:
    """The replay rules of one execution of one run: serves recorded steps,
    checks that the workflow still calls what was recorded, and decides what
    to record; its HeldRun writes it."""

    def __init__(self, held: HeldRun, run: db.ClaimedRun):
        self.held = held
        self.run_id: uuid.UUID = run.id
        self.workflow_name: str = run.name
        self.runner_name: str = held.runner
        self.args = run.args
        self.claimed_at = run.claimed_at  # the database's time of the claim
        self.recorded = recorded_steps(run.steps)
        # Whether the body got its `Cancelled` yet (the request itself is the
        # HeldRun's: from the claim or a write's answer).
        self.cancel_delivered: Cancelled | None = None
        self.context = RunContext(run.id, run.name, held.runner, self)
        self.trace: Any = None  # the tracing and error-report hooks' state (everystep.observe)

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
        exc = self.held.halt or raised
        last = self.held.ending()
        if isinstance(exc, LostClaim):
            raise exc
        if isinstance(exc, Parked):
            return "sleeping"  # parked by the statement that recorded it
        if isinstance(exc, Drain):
            self.held.requeue(last)
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
                    extra={"run": str(self.run_id), "workflow": self.workflow_name, "runner": self.runner_name},
                    exc_info=exc,
                )
        observe.run_ending(self, status, exc)
        return self.held.end(status, result, error, last)

    def outcomes(self) -> Mapping[str, Outcome]:
        self.held.flush()
        return {
            step_id: Outcome(
                step.name, step.status, serde.from_json(step.result) if step.status == StepStatus.DONE else None,
                serde.decode_exception(step.error) if step.status == StepStatus.FAILED else None,
            )
            for step_id, step in list(self.recorded.items())
        }

    def _next_id(self, scope: Scope, everystep_id: str | None) -> str:
        """The id of this call, unless the run is halted."""
        step_id = scope.next_id(everystep_id)
        if self.held.halt is not None:
            raise self.held.halt
        return step_id

    def _code_changed(self, step_id: str, recorded: RecordedStep, doing: str) -> BaseException:
        """The run's halt when the workflow now does something else than what
        was recorded at `step_id`."""
        return self.held.stop_with(WorkflowCodeError(
            f"step {step_id!r} was recorded as {recorded.name} but the workflow now {doing} there; "
            "the workflow code changed in a way that breaks replay"
        ))

    def _failure(self, recorded: RecordedStep) -> BaseException:
        """A recorded failure, to raise again; a recorded `Cancelled` is the
        cancel request delivered (by an earlier execution)."""
        exc = serde.decode_exception(recorded.error)
        if isinstance(exc, Cancelled) and self.cancel_delivered is None:
            self.cancel_delivered = exc
        return exc

    # -------------------------------------------------------------- steps

    def step(self, scope: Scope, fn: Callable, name: str, unsafe: bool, args: tuple, kwargs: dict,
             everystep_id: str | None, retry: RetryPolicy | None = None) -> Any:
        step_id = self._next_id(scope, everystep_id)
        recorded = self.recorded.get(step_id)
        rerun_started = False
        attempts: list = []
        if recorded is not None:
            attempts = list(recorded.attempts or [])
            if recorded.name != name:
                raise self._code_changed(step_id, recorded, f"calls {name}")
            if recorded.status == StepStatus.DONE:
                return serde.from_json(recorded.result)
            if recorded.status == StepStatus.FAILED:
                exc = self._failure(recorded)
                observe.step_ended(self, None, name, StepStatus.FAILED, exc)  # no span: served; the report's step tag
                if isinstance(exc, Terminal):
                    raise self.held.stop_with(exc)
                raise exc
            if recorded.status == StepStatus.STARTED and unsafe:  # no outcome: the effect may or may not have happened
                raise self.held.stop_with(EffectUncertain(
                    f"step {step_id!r} ({name}) is unsafe to repeat and was started without a recorded "
                    "outcome; resolve it with `everystep resolve-step`"
                ))
            # `started` of a step no longer unsafe (run it again), or `retrying`: the row is updated in place.
            rerun_started = True

        self._boundary(step_id, name, rerun_started)
        if attempts:  # retrying: the back-off recorded with the last failed attempt comes first
            self._wait(scope, attempts[-1]["retry_at"], self.claimed_at)
        args_json = serde.dumps(list(args))
        kwargs_json = serde.dumps(kwargs)
        while True:
            started = (time.perf_counter(), time.time())
            if unsafe:
                self._record(step_id, name, args_json, kwargs_json, StepStatus.STARTED, None, None, rerun_started,
                             started)
                rerun_started = True
                if faults.ARMED:
                    self._fault(faults.BEFORE_EFFECT, step_id, name)

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
                if faults.ARMED:
                    self._fault(faults.AFTER_STEP, step_id, name)
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
            if faults.ARMED:
                self._fault(faults.AFTER_STEP, step_id, name)
            if isinstance(failure, Terminal):
                raise self.held.stop_with(failure)
            raise failure

    def _record(self, step_id: str, name: str, args: str, kwargs: str, status: str,
                result: Any, error: dict | None, update: bool, started: tuple[float, float]) -> None:
        """Record a step's outcome (or an unsafe step's `started` mark): as
        this execution knows it now, and in its row (see HeldRun.record_step)."""
        previous = self.recorded.get(step_id)
        attempts = None if previous is None else previous.attempts
        self.recorded[step_id] = RecordedStep(step_id, name, status, result, error, attempts)
        self.held.record_step(step_id, name, args, kwargs, status, result, error, update, started)

    def _fault(self, where: str, step_id: str, name: str) -> None:
        """A test armed a fault here (everystep.faults): the execution dies,
        writing nothing more; its step's outcome first, if the fault says so."""
        fault = faults.reached(where, self.run_id, step_id, name)
        if fault is None:
            return
        if fault.durable:
            self.held.flush()
        raise self.held.stop_with(faults.crash(self.held.claim.token, self.run_id, step_id, where))

    def _boundary(self, step_id: str, name: str, update: bool = False) -> None:
        """Before a new step (or sleep) starts: stop here for a drain or a
        lost claim, write the previous step's outcome (its answer tells of a
        cancel request), and deliver a known cancel request. `update`: the
        step has a row already (`retrying`, or `started` by a step no longer
        unsafe)."""
        self.held.check()
        self.held.flush()  # the previous step's outcome is written before this step starts
        self._deliver_cancel(step_id, name, update)

    def _deliver_cancel(self, step_id: str, name: str, update: bool) -> None:
        """Raise a known cancel request as `Cancelled` (once), recorded as
        this step's failure so that a replay raises it at the same call."""
        if self.held.cancel_requested and self.cancel_delivered is None:
            self._cancel(step_id, name, update)

    def _cancel(self, step_id: str, name: str, update: bool) -> None:
        """Raise `Cancelled` at this call, recorded as its failure."""
        cancelled = Cancelled(self.held.cancel_reason())
        self.cancel_delivered = cancelled
        self._record(step_id, name, "[]", "{}", StepStatus.FAILED, None, serde.encode_exception(cancelled), update,
                     (time.perf_counter(), time.time()))
        metrics.CANCELLATIONS.labels(self.workflow_name).inc()
        raise cancelled

    def _record_attempt(self, step_id: str, name: str, args: str, kwargs: str, error: dict, attempt: int,
                        wait: float, started: tuple[float, float]) -> dict:
        """Record a failed attempt that will be retried after `wait` seconds;
        returns the attempt as recorded (its times by the database's clock)."""
        done = self.held.record_attempt(step_id, name, args, kwargs, error, attempt, wait, started)
        metrics.STEP_RETRIES.labels(self.workflow_name, name).inc()
        previous = self.recorded.get(step_id) or RecordedStep(step_id, name, StepStatus.RETRYING, None, None, None)
        self.recorded[step_id] = previous._replace(status=StepStatus.RETRYING,
                                                   attempts=[*(previous.attempts or []), done])
        return done

    # -------------------------------------------------------------- time

    def sleep(self, scope: Scope, seconds: float | None, until: Any) -> None:
        """A durable sleep: a recorded step whose result is the wake time."""
        step_id = self._next_id(scope, None)
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded.name != SLEEP:
                raise self._code_changed(step_id, recorded, "sleeps")
            if recorded.status == StepStatus.FAILED:
                raise self._failure(recorded)
            self._wait(scope, float(recorded.result), self.claimed_at)
            return
        self._boundary(step_id, SLEEP)
        done = self.held.record_sleep(step_id, SLEEP, seconds, until)
        self.recorded[step_id] = RecordedStep(step_id, SLEEP, StepStatus.DONE, done.wake_at, None, None)
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
        if remaining > MOMENT and scope.prefix == "" and self.held.on_own_thread():
            self.held.flush()
            self.held.park(wake_at)
            return  # the time came meanwhile, or a cancel request is on the run
        time.sleep(remaining)

    # -------------------------------------------------------------- messages and events

    def wait_for(self, scope: Scope, topic: str, timeout: float | None) -> Any:
        """The next message on `topic` for this run, or None once `timeout`
        seconds (from the first time the run reached this wait) have passed.
        Recorded like a step: a `started` row with the deadline, then `done`
        with the message (consumed by this wait in the same statement) or the
        timeout. While nothing comes the run is parked `waiting`, its slot
        given back; a send on the topic makes it due at once."""
        result = self._recorded_wait(scope, WAIT, "waits for a message", topic, f"message:{topic}", timeout,
                                     self.held.take_message, topic)
        return serde.from_json(result["message"]) if "message" in result else None

    def _recorded_wait(self, scope: Scope, name: str, doing: str, topic: str, waiting_on: str,
                       timeout: float | None, take: Callable, what: Any) -> dict:
        """A wait recorded like a step (`name`: WAIT or RESULT): its `started`
        row with `topic` and the deadline, then, once something came or the
        deadline passed, its result (parked meanwhile, see _wait_until_done)."""
        step_id = self._next_id(scope, None)
        recorded = self.recorded.get(step_id)
        if recorded is not None and recorded.name != name:
            raise self._code_changed(step_id, recorded, doing)
        if recorded is None:
            self._boundary(step_id, name)
            begun = self.held.begin_wait(step_id, name, topic, timeout)
            recorded = self.recorded[step_id] = RecordedStep(step_id, name, StepStatus.STARTED, begun, None, None)
        if recorded.status == StepStatus.FAILED:
            raise self._failure(recorded)
        if recorded.status == StepStatus.STARTED:
            result = self._wait_until_done(scope, step_id, take, what, waiting_on, recorded.result.get("deadline"))
            recorded = self.recorded[step_id] = recorded._replace(status=StepStatus.DONE, result=result)
        return recorded.result

    def _wait_until_done(self, scope: Scope, step_id: str, take: Callable, what: Any, waiting_on: str,
                         deadline: float | None) -> dict:
        """Until the started wait `step_id` ends (`take`: HeldRun.take_message
        or take_child, about `what`): its recorded result. Parks the run on
        `waiting_on` while nothing came."""
        parks = scope.prefix == "" and self.held.on_own_thread()
        pause = 0.02
        while True:
            took = take(step_id, what, deadline)
            if took.result is not None:
                return took.result
            remaining = None if deadline is None else deadline - took.now
            if parks and (remaining is None or remaining > MOMENT):
                if self.held.park_waiting(deadline, waiting_on, took.wakes):
                    self._cancel(step_id, WAIT, update=True)  # a wait's `Cancelled`, recorded as its failure
                continue  # a message came, or the child ended, meanwhile
            # A parallel branch, or a moment to go: wait on this thread.
            time.sleep(pause if remaining is None else max(0.0, min(pause, remaining)))
            pause = min(pause * 2, 0.5)

    def set_event(self, scope: Scope, key: str, value_json: str) -> None:
        """Publish `key` = value for the outside (`everystep.get_event`),
        recorded like a step: a replay does not write it again."""
        step_id = self._next_id(scope, None)
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded.name != EVENT:
                raise self._code_changed(step_id, recorded, "sets an event")
            return
        self._boundary(step_id, EVENT)
        self.held.set_event(step_id, EVENT, key, value_json)
        self.recorded[step_id] = RecordedStep(step_id, EVENT, StepStatus.DONE, None, None, None)

    # -------------------------------------------------------------- child workflows

    def start_child(self, scope: Scope, child_name: str, args_json: str) -> uuid.UUID:
        """Schedule a child run once, recorded like a step: a replay returns
        the same child."""
        step_id = self._next_id(scope, None)
        recorded = self.recorded.get(step_id)
        if recorded is None:
            self._boundary(step_id, START)
            result = self.held.start_child(step_id, START, child_name, args_json)
            recorded = self.recorded[step_id] = RecordedStep(step_id, START, StepStatus.DONE, result, None, None)
        elif recorded.name != START:
            raise self._code_changed(step_id, recorded, "starts a child")
        if recorded.status == StepStatus.FAILED:
            raise serde.decode_exception(recorded.error)
        return uuid.UUID(recorded.result["child"])

    def child_result(self, scope: Scope, child: uuid.UUID, timeout: float | None) -> Any:
        """Wait (parked) until the child run ends: its result, or ChildFailed
        for a child that failed, stopped or was cancelled; TimeoutError after
        `timeout` seconds. Recorded like a step."""
        end = self._recorded_wait(scope, RESULT, "waits for a child", f"child:{child}", f"child:{child}", timeout,
                                  self.held.take_child, child)
        if end.get("timeout"):
            raise TimeoutError(f"child run {child} did not end within the timeout")
        if end["status"] == RunStatus.COMPLETED:
            return serde.from_json(end["result"])
        raise ChildFailed(child, end["status"], None if end["error"] is None else serde.decode_exception(end["error"]))

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
        if self.held.halt is not None:
            raise self.held.halt
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded.name != PATCH_STEP:
                raise self.held.stop_with(WorkflowCodeError(
                    f"id {step_id!r} was recorded as the step {recorded.name}, not as a patch"))
            return bool(serde.from_json(recorded.result))
        with scope.lock:
            reached = set(scope.used)  # the ids this scope has given out so far (a fork's: its branches too)
        went_further = any(
            other.startswith(scope.prefix) and other[len(scope.prefix):].split(".")[0] not in reached
            and step.name != PATCH_STEP
            for other, step in list(self.recorded.items())
        )
        self.held.check()
        self.held.flush()
        now = (time.perf_counter(), time.time())
        self._record(step_id, PATCH_STEP, "[]", "{}", StepStatus.DONE, not went_further, None, False, now)
        return not went_further

    # -------------------------------------------------------------- parallel

    def fork(self, scope: Scope, branches: tuple, everystep_id: str | None) -> tuple:
        fork_id = self._next_id(scope, everystep_id)
        self.held.flush()  # the branches' steps come after it
        scopes = [scope.branch(fork_id, i) for i in range(len(branches))]
        results = run_branches(branches, scopes)
        if self.held.halt is not None:
            raise self.held.halt
        return results
