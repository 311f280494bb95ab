"""Replay of one claimed run. Knows nothing about processes.

On every claim the workflow function is called from the top with its stored
args. Each step call looks up its step id among the recorded steps: a recorded
outcome is served without running the function; otherwise the function runs
and its outcome is recorded: before the next step starts, with the end of the
run, or OUTCOME_DELAY (everystep.execution) after the step returned, whichever comes first.

`Runner.execute` is one run's life, claim to end. `Replay` holds the replay
rules and does no I/O: every read and write about the run goes through the
execution's `HeldRun` (everystep.execution), fenced by the claim.

The rules are generators that yield what they need done — a call of the
HeldRun (`_Io`), a pause (`_Pause`), the step's function (`_Invoke`), the
workflow body (`_Body`) — and get its result back. `drive` does it on the
calling thread, for a sync run; `adrive` on the runner's event loop, for an
async run (everystep.aio): the HeldRun's calls on the loop's I/O threads,
async functions awaited on the loop, sync steps on its step threads. So a
sync and an async run follow the same rules, to the line.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Generator, Mapping
from typing import Any, NamedTuple

from psycopg_pool import ConnectionPool

from everystep import aio, db, faults, metrics, observe, registry, serde, timeouts, tracing
from everystep.context import (
    MAX_STEP_ID,
    Outcome,
    RunContext,
    Scope,
    current_run,
    current_scope,
    current_step,
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
    StepTimeout,
    Terminal,
    WorkflowCodeError,
)
from everystep.execution import Fence, HeldRun, Lent, StepTransaction, Successors
from everystep.logs import first_line
from everystep.plans import DONE, Stepper
from everystep.retries import RetryPolicy
from everystep.schema import DEFAULT_MAX_STEPS, RunStatus, StepStatus
from everystep.writer import GroupWriter

log = logging.getLogger("everystep")

# The step name of a durable sleep's row.
SLEEP = "everystep.sleep"
# The step names of a wait for a message's row, and of a set_event's.
WAIT = "everystep.wait_for"
EVENT = "everystep.set_event"
ATTRIBUTES = "everystep.set_attributes"  # the step name of a set_attributes' row
# The step names of a child's start (result {"child": id}) and of a wait for its end.
START = "everystep.start"
RESULT = "everystep.result"
# The step name a patch decision is recorded under (see Replay.patched).
PATCH_STEP = "everystep.patched"
# A body that goes on calling steps after its Cancelled (cleanup) is ended,
# cancelled, at the call past this many.
CANCEL_CLEANUP_CALLS = 100
# A wait no longer than this (seconds) is waited on the run's thread; a longer
# one parks the run (`waiting`), its slot given back.
MOMENT = 1.0
# The event loop's threads beside it, by default: the engine's writes about
# async runs, and the sync steps async workflows call.
IO_THREADS = 8
STEP_THREADS = 8

Rules = Generator[Any, Any, Any]


# ---------------------------------------------------------------- what the rules need done

class _Io(NamedTuple):
    """A call of the HeldRun's (it does I/O): its result is sent back.
    `outcome`: the write of an unsafe step's outcome, which an async run
    makes on the loop's lane of its own (aio.Loop.outcome_call)."""
    call: Callable
    args: tuple = ()
    outcome: bool = False

    def run(self) -> Any:
        return self.call(*self.args)

    async def arun(self, loop: aio.Loop) -> Any:
        if self.outcome:
            return await loop.outcome_call(self.call, *self.args)
        return await loop.io_call(self.call, *self.args)


class _Pause(NamedTuple):
    """Wait a moment (seconds) where the run is, its slot kept."""
    replay: Replay
    seconds: float

    def run(self) -> None:
        time.sleep(self.seconds)

    async def arun(self, loop: aio.Loop) -> None:
        await self.replay.paused(self.seconds)


class _Invoke(NamedTuple):
    """Run a step's function (outside any scope: a step called inside a step is a plain call)."""
    replay: Replay
    fn: Callable
    args: tuple
    kwargs: dict
    step_id: str
    name: str
    timeout: float | None = None  # @step(timeout=): seconds an attempt may take (everystep.timeouts)
    attempt: int = 1  # the step's try, as retried (stream entries written from inside carry it)

    def run(self) -> Any:
        token = current_scope.set(None)
        step_token = current_step.set((self.step_id, self.attempt))
        try:
            if inspect.iscoroutinefunction(self.fn):  # an async step of a sync workflow
                return timeouts.run_coroutine(self.fn(*self.args, **self.kwargs), self.timeout,
                                              self.replay.workflow_name, self.name)
            if self.timeout is not None:
                return timeouts.call(self.fn, self.args, self.kwargs, self.timeout, self.replay.workflow_name,
                                     self.name)
            return self.fn(*self.args, **self.kwargs)
        finally:
            current_scope.reset(token)
            current_step.reset(step_token)

    async def arun(self, loop: aio.Loop) -> Any:
        return await self.replay.invoke(self, loop)


class _Body(NamedTuple):
    """Call the workflow function: its value is sent back, or what it raised thrown."""
    replay: Replay
    fn: Callable
    args: list

    def run(self) -> Any:
        scope_token = current_scope.set(Scope(self.replay.context))
        run_token = current_run.set(self.replay.context)
        try:
            return self.fn(*self.args)
        finally:
            current_scope.reset(scope_token)
            current_run.reset(run_token)

    async def arun(self, loop: aio.Loop) -> Any:
        context = contextvars.copy_context()
        context.run(current_scope.set, Scope(self.replay.context))
        context.run(current_run.set, self.replay.context)
        body = asyncio.Task(self.fn(*self.args), context=context)
        loop.labels.put(body, f"run {self.replay.run_id} ({self.replay.workflow_name}), in its body")
        return await body


class Bounded(BaseException):
    """Internal: the run went past a bound (max_steps, or the calls after its
    Cancelled). A BaseException, so that a body catching Exception (or
    Cancelled) lets it through; the run ends with `error`."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class Preempted(BaseException):
    """Internal: the async step's task was cancelled because its run was (everystep.cancel)."""


def drive(rules: Rules) -> Any:
    """Do what `rules` need done on this thread, to their end: their value."""
    stepper = Stepper(rules)
    while (effect := stepper.next()) is not DONE:
        try:
            stepper.sent = effect.run()
        except BaseException as exc:  # noqa: BLE001  (thrown into the rules)
            stepper.thrown = exc
    return stepper.value


@aio.own_scope
async def adrive(rules: Rules, loop: aio.Loop) -> Any:
    """Do what `rules` need done on the event loop, to their end: their value."""
    stepper = Stepper(rules)
    while (effect := stepper.next()) is not DONE:
        try:
            stepper.sent = await effect.arun(loop)
        except BaseException as exc:  # noqa: BLE001  (thrown into the rules)
            stepper.thrown = exc
    return stepper.value


@functools.cache
def _run_metrics(workflow: str, outcome: str) -> tuple:
    return metrics.WORKFLOW_RUNS.labels(workflow, outcome), metrics.WORKFLOW_DURATION.labels(workflow, outcome)


def _log_fields(run: db.ClaimedRun, runner: str) -> dict:
    """The fields of a log line about a run (made only when one is written)."""
    return {"run": str(run.id), "workflow": run.name, "runner": runner}


class UnknownWorkflow(Exception):
    """This process cannot import the workflow of a claimed run (its module
    is missing, fails to import, or does not define it yet)."""


class Execution(NamedTuple):
    """What one execution of a run came to, as `Runner.execute` returns it."""
    outcome: str  # completed, failed, stopped, blocked, cancelled, sleeping (parked waiting),
    # requeued (drain), unknown (given back: its workflow cannot be imported here) or abandoned (claim lost)
    successor: db.ClaimedRun | None  # claimed for this slot by the statement that ended the run
    look_again: bool  # the runner may hold runs it does not know of: an answer was lost, or another
    # execution's row was found
    ahead: db.ClaimedRun | None = None  # claimed ahead by that statement, for the worker's next free slot


class Runner:
    """Executes claimed runs under one runner name, writing through a pool."""

    def __init__(self, pool: ConnectionPool, name: str, fence: Fence | None = None,
                 successors: Successors | None = None, io_threads: int = IO_THREADS,
                 step_threads: int = STEP_THREADS, give_back_unknown: bool = False):
        """`give_back_unknown`: a run whose workflow cannot be imported here is
        put back in the queue (for a worker that can import it), not failed."""
        self.pool = pool
        self.name = name
        self.give_back_unknown = give_back_unknown
        self.fence = fence or Fence()
        self.successors = successors or Successors()
        # Step rows and run ends of all this runner's executions share commits:
        # step rows in batches of their own, so that none waits behind the
        # heavier statement that ends runs and claims their successors. Both
        # gather while every slot runs a body (writer.LINGER).
        self.step_writer = GroupWriter(pool, name, lambda: None, gather=self.successors.writes_to_gather)
        self.end_writer = GroupWriter(pool, name, lambda: self.successors.routes, lambda: self.successors.skipped,
                                      gather=self.successors.writes_to_gather)
        self._lent = Lent(pool, name, self.fence, self.successors, self.step_writer, self.end_writer)
        self._io_threads, self._step_threads = io_threads, step_threads
        self._loop: aio.Loop | None = None
        self._loop_lock = threading.Lock()
        # The async executions in flight, by token: to reach them from other threads (cancel).
        self.live: dict[int, Replay] = {}

    def loop(self) -> aio.Loop:
        """The event loop of this runner's async runs (started at the first)."""
        with self._loop_lock:
            if self._loop is None:
                self._loop = aio.Loop(self.name, self._io_threads, self._step_threads)
            return self._loop

    def close(self) -> None:
        """Stop the writers (once no execution writes any more), and the loop;
        apply the figures the runs counted (a worker applies them at every
        turn of its loop too)."""
        if self._loop is not None:
            self._loop.close()
        self.step_writer.close()
        self.end_writer.close()
        metrics.TALLY.flush()

    def give_back_idle(self) -> None:
        """The connections of the writers that wrote nothing for a while go
        back to the pool (writer.IDLE)."""
        self.step_writer.give_back_if_idle()
        self.end_writer.give_back_if_idle()

    def execute(self, run: db.ClaimedRun) -> Execution:
        """Replay one held run to an end and say what happened: how it ended,
        and the run its end claimed for this slot, if any. An async workflow's
        run is executed on the runner's event loop (this thread waits).

        The run's life crosses these threads: this one (the worker's slot
        thread) runs the workflow body and the steps it calls; the runner's
        writers commit its step rows and its end with other runs', each
        batch written by the thread of one of its writes (this one, or one
        that this one waits for); the late-outcome thread writes
        a step's outcome that waited OUTCOME_DELAY (everystep.execution);
        each `parallel` branch but the last runs on a thread of its own,
        writing through a connection borrowed for each write. The HeldRun
        does every write, whichever the thread; the Replay decides them."""
        if registry.is_async(run.name):
            return self.loop().call(self.aexecute(run))
        return drive(self._execution(run, None))

    async def aexecute(self, run: db.ClaimedRun) -> Execution:
        """`execute` of an async workflow's run, on the runner's event loop
        (where the worker's async slots call it)."""
        loop = self.loop()
        return await adrive(self._execution(run, loop), loop)

    def preempt(self, token: int) -> None:
        """The async execution `token` is cancelled (its run was): its running
        async steps are cancelled at their next await (from any thread)."""
        replay = self.live.get(token)
        if replay is not None and self._loop is not None:
            self._loop.soon(replay.preempt)

    def _execution(self, run: db.ClaimedRun, loop: aio.Loop | None) -> Rules:
        started = time.perf_counter()
        with HeldRun(self._lent, run, asynchronous=loop is not None) as held:
            replay = Replay(held, run, loop)
            if loop is not None:
                self.live[run.token] = replay
            try:
                # With tracing on, the execution is counted under the claim
                # (a fenced write like any other) and the span continues the
                # trace stored with the run.
                traced = (yield _Io(held.start_traced)) if tracing.enabled() else None
                replay.trace = observe.run_started(replay, traced)
                outcome = yield from replay.run()
            except LostClaim as exc:
                log.warning("claim lost, run abandoned: %s", exc, extra=_log_fields(run, self.name))
                metrics.CLAIMS_LOST.labels(self.name).inc()
                outcome = "abandoned"
            except UnknownWorkflow as exc:
                extra = _log_fields(run, self.name)
                if self.give_back_unknown:
                    log.error("cannot import workflow %s: %s; run given back to the queue for a worker that can, "
                              "and no more of its runs claimed here", run.name, exc, extra=extra)
                    self.successors.cannot_import(run.name, str(exc))
                    outcome = yield from self._give_back(held, extra)
                else:
                    outcome = yield from self._engine_error(held, replay, exc, extra)
            except Exception as exc:
                # The engine itself failed on this run. (SystemExit or the like
                # out of user code is not ours to record: it goes on up.)
                extra = _log_fields(run, self.name)
                log.exception("engine error on run; marking it failed", extra=extra)
                outcome = yield from self._engine_error(held, replay, exc, extra)
            finally:
                self.live.pop(run.token, None)
                replay.stop_tasks()
        observe.run_ended(replay, outcome)
        runs, duration = _run_metrics(run.name, outcome)
        metrics.TALLY.count(runs)
        metrics.TALLY.observe(duration, time.perf_counter() - started)
        return Execution(outcome, held.successor, held.look_again, held.ahead)


    @staticmethod
    def _engine_error(held: HeldRun, replay: Replay, exc: Exception, extra: dict) -> Rules:
        observe.run_ending(replay, RunStatus.FAILED, exc)
        try:
            yield _Io(held.end, (RunStatus.FAILED, None, serde.dumps(serde.encode_exception(exc))))
            return RunStatus.FAILED
        except LostClaim:
            return "abandoned"
        except Exception:
            log.exception("could not mark the run failed; it stays claimed", extra=extra)
            held.look_again = True  # still held here, executed by nobody: replay it
            return "abandoned"

    @staticmethod
    def _give_back(held: HeldRun, extra: dict) -> Rules:
        try:
            yield _Io(held.requeue, ("unknown",))
            return "unknown"
        except LostClaim:
            return "abandoned"
        except Exception:
            log.exception("could not give the run back; it stays claimed", extra=extra)
            held.look_again = True
            return "abandoned"


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_line() -> tuple[str, int] | None:
    """(file, line) of the call into everystep that is being made (the first
    frame outside the package); formatted only if the call is reported, as
    it is taken at every async step call."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


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
    to record; its HeldRun writes it. `loop`: the event loop an async run
    executes on (None: a sync run, on its thread).

    Each call of the API takes its step id when it is called; what it then
    does is a generator of rules (see the module), driven on the run's
    thread or, for an async run, on the loop by the coroutine the call
    returns."""

    def __init__(self, held: HeldRun, run: db.ClaimedRun, loop: aio.Loop | None = None):
        self.held = held
        self.loop = loop
        self.run_id: uuid.UUID = run.id
        self.workflow_name: str = run.name
        self.runner_name: str = held.runner
        self.args = run.args
        self.claimed_at = run.claimed_at  # the database's time of the claim
        self.recorded = recorded_steps(run.steps)
        # Whether the body got its `Cancelled` yet (the request itself is the
        # HeldRun's: from the claim or a write's answer).
        self.cancel_delivered: Cancelled | None = None
        # The calls of the API that took a step id, in all, and since the
        # Cancelled; the bound of the former (@workflow(max_steps=)).
        self.calls = 0
        self.calls_after_cancel = 0
        self.max_steps: int | None = DEFAULT_MAX_STEPS
        self.context = RunContext(run.id, run.name, held.runner, self)
        self.trace: Any = None  # the tracing and error-report hooks' state (everystep.observe)
        # An async run's: the tasks its body started, its async steps' tasks
        # running now, the rules being driven now, and whether it was preempted.
        self._tasks: list[asyncio.Task] = []
        self._steps_running: set[asyncio.Task] = set()
        self._driving = 0
        self._preempted: asyncio.Event | None = None
        # An async run's step calls whose coroutine the body has not awaited
        # (yet): (coroutine, step id, step name, the caller's file:line).
        self._unawaited: dict[object, tuple] = {}

    @property
    def asynchronous(self) -> bool:
        return self.loop is not None

    def _perform(self, rules: Rules) -> Any:
        """A sync run: drive `rules` now, on this thread. An async run: the
        coroutine that drives them on the loop."""
        if self.loop is None:
            return drive(rules)
        return self._adrive(rules)

    @aio.own_scope
    async def _adrive(self, rules: Rules) -> Any:
        self._driving += 1
        try:
            return await adrive(rules, self.loop)
        finally:
            self._driving -= 1

    # -------------------------------------------------------------- the run

    def run(self) -> Rules:
        try:
            fn = registry.resolve(self.workflow_name)
        except TypeError as exc:
            raise EverystepError(str(exc)) from None
        except Exception as exc:  # ImportError, or whatever importing its module raised
            raise UnknownWorkflow(f"{type(exc).__name__}: {first_line(exc)}") from None
        args = serde.from_json(self.args)
        self.max_steps = getattr(fn, "__everystep_max_steps__", DEFAULT_MAX_STEPS)
        if inspect.iscoroutinefunction(fn) != self.asynchronous:
            raise EverystepError(f"{self.workflow_name} is {'not ' if self.asynchronous else ''}an async workflow "
                                 "in this process's code")
        try:
            value = yield _Body(self, fn, args)
        except BaseException as exc:  # noqa: BLE001  (decided below)
            return (yield from self._end(exc, None))
        return (yield from self._end(None, value))

    def _end(self, raised: BaseException | None, value: Any) -> Rules:
        # A halt wins over whatever the body did with it.
        exc = self.held.halt or raised
        if isinstance(exc, LostClaim):
            raise exc
        if isinstance(exc, Parked):
            return "sleeping"  # parked by the statement that recorded it
        if isinstance(exc, Drain):
            yield _Io(self.held.requeue)
            return "requeued"
        if isinstance(exc, Bounded):
            exc = exc.error
        if exc is not None and not isinstance(exc, Exception):
            raise exc  # KeyboardInterrupt, SystemExit: not ours to record
        if self._unawaited:
            exc = self.never_awaited() or exc  # what went wrong first, whatever the body made of it
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
        ended = yield _Io(self.held.end, (status, result, error))
        if ended == RunStatus.CANCELLED and self.cancel_delivered is None:
            # Cancelled by its end: a request that came after the last step
            # call, or the deadline passing since.
            if (yield _Io(self.held.cancel_reason)) == "deadline":
                metrics.TIMEOUTS.labels(self.workflow_name, "deadline").inc()
        return ended

    def outcomes(self) -> Mapping[str, Outcome]:
        if not self.asynchronous:
            self.held.flush()  # (an async run's loop does no I/O: the outcomes as this execution knows them)
        return {
            step_id: Outcome(
                step.name, step.status, serde.from_json(step.result) if step.status == StepStatus.DONE else None,
                serde.decode_exception(step.error) if step.status == StepStatus.FAILED else None,
            )
            for step_id, step in list(self.recorded.items())
        }

    def _next_id(self, scope: Scope, everystep_id: str | None) -> str:
        """The id of this call, unless the run is halted, or this call goes
        past the run's bounds (a halt too: whatever the body does with it,
        every later call raises it again and the run ends with it)."""
        step_id = scope.next_id(everystep_id)
        if self.held.halt is not None:
            raise self.held.halt
        self.calls += 1
        if self.max_steps is not None and self.calls > self.max_steps:
            raise self.held.stop_with(Bounded(EverystepError(
                f"the run went past its max_steps={self.max_steps} at step {step_id!r}: a body that loops for "
                "ever? (raise @workflow(max_steps=...), or None for no bound)")))
        if self.cancel_delivered is not None:
            self.calls_after_cancel += 1
            if self.calls_after_cancel > CANCEL_CLEANUP_CALLS:
                raise self.held.stop_with(Bounded(Cancelled(
                    f"ended at step {step_id!r}: the body went on for {CANCEL_CLEANUP_CALLS} calls after its "
                    f"Cancelled ({self.cancel_delivered}), more than a cleanup")))
        return step_id

    def _code_changed(self, step_id: str, recorded: RecordedStep, doing: str) -> BaseException:
        """The run's halt when the workflow now does something else than what
        was recorded at `step_id`."""
        return self.held.stop_with(WorkflowCodeError(
            f"step {step_id!r} was recorded as {recorded.name} but the workflow now {doing} there; "
            "the workflow code changed in a way that breaks replay"
        ))

    def diverged(self, message: str) -> BaseException:
        """The run's halt when the body does what a replay cannot repeat."""
        return self.held.stop_with(WorkflowCodeError(message))

    def _failure(self, recorded: RecordedStep) -> BaseException:
        """A recorded failure, to raise again; a recorded `Cancelled` is the
        cancel request delivered (by an earlier execution)."""
        exc = serde.decode_exception(recorded.error)
        if isinstance(exc, Cancelled) and self.cancel_delivered is None:
            self.cancel_delivered = exc
        return exc

    # -------------------------------------------------------------- an async run's tasks

    def started_task(self, task: asyncio.Task) -> None:
        """(The loop's task factory:) the body started `task`; it is cancelled
        if it still runs when the execution ends."""
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(task)

    def stop_tasks(self) -> None:
        """At the end of the execution: cancel the tasks the body started and left running."""
        for task in [*self._tasks, *self._steps_running]:
            if not task.done():
                task.cancel()

    def preempt(self) -> None:
        """(On the loop.) The run is cancelled: its async steps running now
        are cancelled at their next await, and its waits end now; the body
        gets `Cancelled` where the rules say (see _step)."""
        self.held.cancel_requested = True
        if self._preempted is None:
            self._preempted = asyncio.Event()
        self._preempted.set()
        for task in list(self._steps_running):
            task.cancel("everystep: the run was cancelled")

    async def paused(self, seconds: float) -> None:
        """An async run's pause: until `seconds` pass or the run is preempted."""
        if self._preempted is None:
            self._preempted = asyncio.Event()
        if self._preempted.is_set():
            return
        try:
            async with asyncio.timeout(seconds):
                await self._preempted.wait()
        except TimeoutError:
            pass

    async def invoke(self, call: _Invoke, loop: aio.Loop) -> Any:
        """An async run's step function: awaited in a task of its own (so that
        a cancel can reach it), or a sync one on a step thread."""
        context = contextvars.copy_context()
        context.run(current_scope.set, None)
        context.run(current_step.set, (call.step_id, call.attempt))
        if not inspect.iscoroutinefunction(call.fn):
            if call.timeout is not None:
                return await timeouts.acall(context, call.fn, call.args, call.kwargs, call.timeout,
                                            self.workflow_name, call.name)
            return await loop.step_call(context, call.fn, call.args, call.kwargs)
        task = asyncio.Task(call.fn(*call.args, **call.kwargs), context=context)
        loop.labels.put(task, f"run {self.run_id} ({self.workflow_name}), step {call.step_id} ({call.name})")
        self._steps_running.add(task)
        try:
            if call.timeout is not None:
                return await timeouts.bounded(task, call.timeout, self.workflow_name, call.name)
            return await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling() or not task.cancelled() or self._preempted is None:
                raise  # the execution itself is cancelled (the worker stops), or the step cancelled itself
            raise Preempted() from None
        finally:
            self._steps_running.discard(task)

    # -------------------------------------------------------------- steps

    def step(self, scope: Scope, fn: Callable, name: str, unsafe: bool, args: tuple, kwargs: dict,
             everystep_id: str | None, retry: RetryPolicy | None = None, timeout: float | None = None,
             rate_limit: str | None = None, transactional: bool = False, write_behind: bool = False) -> Any:
        step_id = self._next_id(scope, everystep_id)
        rules = self._step(scope, step_id, fn, name, unsafe, args, kwargs, retry, timeout, rate_limit,
                           transactional, write_behind)
        if self.loop is None:
            return drive(rules)
        # The body must await what this returns: until it does, the call is
        # kept with where it was made, so that a step never awaited fails the
        # run naming it (rather than a RuntimeWarning about this coroutine).
        key = object()
        coroutine = self._awaited_step(rules, key)
        self._unawaited[key] = (coroutine, step_id, name, _caller_line())
        return coroutine

    @aio.own_scope
    async def _awaited_step(self, rules: Rules, key: object) -> Any:
        self._unawaited.pop(key, None)
        self._driving += 1
        try:
            return await adrive(rules, self.loop)
        finally:
            self._driving -= 1

    def never_awaited(self) -> EverystepError | None:
        """The error that fails a run whose body called async steps without
        awaiting them (they never ran); their coroutines are closed."""
        calls, self._unawaited = list(self._unawaited.values()), {}
        for coroutine, *_ in calls:
            coroutine.close()
        if not calls:
            return None
        _, step_id, name, where = calls[0]
        line = "an unknown line" if where is None else f"{where[0]}:{where[1]}"
        more = f" (and {len(calls) - 1} more step calls never awaited)" if len(calls) > 1 else ""
        return EverystepError(f"step {step_id!r} ({name}) called at {line} was never awaited, so it never ran: "
                              f"write `await {name.rsplit('.', 1)[-1]}(...)`{more}")

    def _step(self, scope: Scope, step_id: str, fn: Callable, name: str, unsafe: bool, args: tuple, kwargs: dict,
              retry: RetryPolicy | None, timeout: float | None = None, rate_limit: str | None = None,
              transactional: bool = False, write_behind: bool = False) -> Rules:
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

        # A plain step's (no `started` mark, retry or transaction of its own)
        # may leave the outcomes before it waiting (HeldRun.carries).
        carry = not (unsafe or attempts or rerun_started or transactional)
        yield from self._boundary(step_id, name, rerun_started, carry)
        if attempts:  # retrying: the back-off recorded with the last failed attempt comes first
            yield from self._wait(scope, attempts[-1]["retry_at"], self.claimed_at)
        args_json = serde.dumps(list(args))
        kwargs_json = serde.dumps(kwargs)
        while True:
            started = (time.perf_counter(), time.time())
            if rate_limit is not None:  # the step starts when it has its token, by the server's clock
                started = (time.perf_counter(), (yield from self._take_token(scope, step_id, name, rate_limit)))
            if unsafe:
                yield from self._record(step_id, name, args_json, kwargs_json, StepStatus.STARTED, None, None,
                                        rerun_started, started)
                rerun_started = True
                if faults.ARMED:
                    yield from self._fault(faults.BEFORE_EFFECT, step_id, name)

            traced = observe.step_started(self, step_id, name)
            failure: Exception | None = None
            invoked = fn
            if transactional:  # its outcome is written in its own transaction, with its writes
                invoked = self.held.transactional(fn, StepTransaction(step_id, name, args_json, kwargs_json, started,
                                                                      rerun_started))
            try:
                value = yield _Invoke(self, invoked, args, kwargs, step_id, name, timeout, len(attempts) + 1)
            except StepTimeout as exc:
                # The attempt is abandoned (sync) or cancelled (async): an
                # unsafe one may have done its effect, so it is never retried.
                failure = exc
                observe.step_ended(self, traced, name, StepStatus.FAILED, exc)
                if unsafe:
                    raise self.held.stop_with(EffectUncertain(
                        f"step {step_id!r} ({name}) is unsafe to repeat and timed out after {exc.timeout:g} s, "
                        "its effect done or not; resolve it with `everystep resolve-step`")) from None
            except Preempted:
                # An async step cancelled at an await because its run was: an
                # unsafe one may have done its effect or not; a safe one failed
                # with the `Cancelled` the body gets.
                observe.step_ended(self, traced, name, StepStatus.FAILED, Cancelled())
                if unsafe:
                    raise self.held.stop_with(EffectUncertain(
                        f"step {step_id!r} ({name}) is unsafe to repeat and was cancelled before it returned; "
                        "resolve it with `everystep resolve-step`")) from None
                yield from self._cancel(step_id, name, rerun_started)
            except Exception as exc:  # noqa: BLE001  (recorded, then re-raised or retried)
                if exc is self.held.halt:
                    raise  # the execution stops here (a transactional step's claim lost): not the step's failure
                failure = exc
                observe.step_ended(self, traced, name, StepStatus.FAILED, exc)
            if failure is None:
                observe.step_ended(self, traced, name, StepStatus.DONE)
                result = serde.encode(value)  # unserializable: EverystepError here, nothing recorded
                if transactional:
                    self._know(step_id, name, StepStatus.DONE, result, None)  # committed with the step's writes
                else:
                    yield from self._record(step_id, name, args_json, kwargs_json, StepStatus.DONE, result, None,
                                            rerun_started, started, write_behind)
                if faults.ARMED:
                    yield from self._fault(faults.AFTER_STEP, step_id, name)
                return value
            error = serde.encode_exception(failure)
            if not isinstance(failure, Terminal):  # a deliberate stop, not a fault: no traceback to read
                yield _Io(self.held.record_traceback, (step_id, len(attempts) + 1, serde.format_traceback(failure)))
            retried = retry is not None and retry.retried(unsafe, failure, len(attempts))
            if retried and not isinstance(failure, Terminal):
                attempt = yield from self._record_attempt(step_id, name, args_json, kwargs_json, error,
                                                          len(attempts) + 1, retry.backoff.wait(len(attempts) + 1),
                                                          started)
                attempts.append(attempt)
                rerun_started = True
                yield from self._wait(scope, attempt["retry_at"], attempt["at"])
                yield from self._deliver_cancel(step_id, name, update=True)  # a cancel request learnt meanwhile
                continue
            yield from self._record(step_id, name, args_json, kwargs_json, StepStatus.FAILED, None, error,
                                    rerun_started, started)
            if faults.ARMED:
                yield from self._fault(faults.AFTER_STEP, step_id, name)
            if isinstance(failure, Terminal):
                raise self.held.stop_with(failure)
            raise failure

    def _take_token(self, scope: Scope, step_id: str, name: str, rate_limit: str) -> Rules:
        """A token of the step's rate limit, each attempt: none there, the run
        waits until the time it was given (parked, its slot given back, unless
        in a parallel branch) and tries again. Returns when it was
        taken (the server's clock, epoch seconds)."""
        while True:
            token = yield _Io(self.held.take_token, (rate_limit,))
            if token is None:
                raise EverystepError(f"step {step_id!r} ({name}) has rate_limit={rate_limit!r}, which is not "
                                     "defined: add it to the config's `rate_limits:` or call "
                                     f"everystep.rate_limit({rate_limit!r}, rate=...)")
            if token.taken_at is not None:
                return token.taken_at
            metrics.RATE_LIMITED.labels(self.workflow_name, rate_limit).inc()
            # However near its token, a run waiting for one gives its slot
            # back: the runs behind it needing no token pass it meanwhile.
            yield from self._wait(scope, token.now + token.wait, token.now, moment=0.0)
            yield from self._deliver_cancel(step_id, name, update=step_id in self.recorded)

    def _record(self, step_id: str, name: str, args: str, kwargs: str, status: str,
                result: Any, error: dict | None, update: bool, started: tuple[float, float],
                write_behind: bool = False) -> Rules:
        """Record a step's outcome (or an unsafe step's `started` mark): as
        this execution knows it now, and in its row (see HeldRun.record_step;
        an outcome that waits for the next write needs no I/O now).
        `write_behind`: a done outcome of a @step(write_behind=True)."""
        self._know(step_id, name, status, result, error)
        row = (step_id, name, args, kwargs, status, result, error, update, started)
        if self.held.defers(status, update):
            self.held.record_step(*row, write_behind=write_behind)
        else:  # a `started` mark, or the outcome that ends one's uncertainty
            yield _Io(self.held.record_step, row, outcome=status != StepStatus.STARTED)

    def _know(self, step_id: str, name: str, status: str, result: Any, error: dict | None) -> None:
        """A step's outcome (or mark) as this execution knows it now."""
        previous = self.recorded.get(step_id)
        attempts = None if previous is None else previous.attempts
        self.recorded[step_id] = RecordedStep(step_id, name, status, result, error, attempts)

    def _fault(self, where: str, step_id: str, name: str) -> Rules:
        """A test armed a fault here (everystep.faults): the execution dies,
        writing nothing more; its step's outcome first, if the fault says so."""
        fault = faults.reached(where, self.run_id, step_id, name)
        if fault is None:
            return
        if fault.durable:
            yield _Io(self.held.flush)
        raise self.held.stop_with(faults.crash(self.held.claim.token, self.run_id, step_id, where))

    def _boundary(self, step_id: str, name: str, update: bool = False, carry: bool = False) -> Rules:
        """Before a new step (or sleep) starts: stop here for a drain or a
        lost claim, write the previous step's outcome (its answer tells of a
        cancel request), and deliver a known cancel request. `update`: the
        step has a row already (`retrying`, or `started` by a step no longer
        unsafe). `carry`: a plain step, before which the outcomes waiting may
        go on waiting (HeldRun.carries)."""
        if self.asynchronous and self.held.nothing_to_write():
            self.held.check()  # at once: no outcome waits, and the fence has no reason to wait
        else:
            yield _Io(self.held.boundary, (carry,))  # the previous step's outcome is written before this step starts
        yield from self._deliver_cancel(step_id, name, update)

    def _deliver_cancel(self, step_id: str, name: str, update: bool) -> Rules:
        """Raise a known cancel request as `Cancelled` (once), recorded as
        this step's failure so that a replay raises it at the same call."""
        if self.held.cancel_requested and self.cancel_delivered is None:
            yield from self._cancel(step_id, name, update)

    def _cancel(self, step_id: str, name: str, update: bool) -> Rules:
        """Raise `Cancelled` at this call, recorded as its failure (the
        request's reason, or 'deadline': the run's deadline passed)."""
        delivery = yield _Io(self.held.deliver_cancel)
        if delivery.deadline:
            metrics.TIMEOUTS.labels(self.workflow_name, "deadline").inc()
        cancelled = Cancelled(delivery.reason)
        self.cancel_delivered = cancelled
        yield from self._record(step_id, name, "[]", "{}", StepStatus.FAILED, None, serde.encode_exception(cancelled),
                                update, (time.perf_counter(), time.time()))
        metrics.CANCELLATIONS.labels(self.workflow_name).inc()
        raise cancelled

    def _record_attempt(self, step_id: str, name: str, args: str, kwargs: str, error: dict, attempt: int,
                        wait: float, started: tuple[float, float]) -> Rules:
        """Record a failed attempt that will be retried after `wait` seconds;
        returns the attempt as recorded (its times by the database's clock)."""
        done = yield _Io(self.held.record_attempt, (step_id, name, args, kwargs, error, attempt, wait, started))
        metrics.STEP_RETRIES.labels(self.workflow_name, name).inc()
        previous = self.recorded.get(step_id) or RecordedStep(step_id, name, StepStatus.RETRYING, None, None, None)
        self.recorded[step_id] = previous._replace(status=StepStatus.RETRYING,
                                                   attempts=[*(previous.attempts or []), done])
        return done

    # -------------------------------------------------------------- time

    def sleep(self, scope: Scope, seconds: float | None, until: Any) -> Any:
        """A durable sleep: a recorded step whose result is the wake time."""
        return self._perform(self._sleep(scope, self._next_id(scope, None), seconds, until))

    def _sleep(self, scope: Scope, step_id: str, seconds: float | None, until: Any) -> Rules:
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded.name != SLEEP:
                raise self._code_changed(step_id, recorded, "sleeps")
            if recorded.status == StepStatus.FAILED:
                raise self._failure(recorded)
            yield from self._wait(scope, float(recorded.result), self.claimed_at)
            return
        yield from self._boundary(step_id, SLEEP)
        done = yield _Io(self.held.record_sleep, (step_id, SLEEP, seconds, until))
        self.recorded[step_id] = RecordedStep(step_id, SLEEP, StepStatus.DONE, done.wake_at, None, None)
        yield from self._wait(scope, done.wake_at, done.now)

    def _parks(self, scope: Scope) -> bool:
        """Whether a wait here may park the run: only the body's own (not a
        parallel branch's), and in an async run only while nothing else of
        it is under way (the rules being driven are this wait's alone)."""
        if scope.prefix != "":
            return False
        return self._driving == 1 if self.asynchronous else self.held.on_own_thread()

    def _wait(self, scope: Scope, wake_at: float, now: float, moment: float = MOMENT) -> Rules:
        """Wait until `wake_at` (database time; `now` is the database's time
        as last seen): up to `moment` seconds where the run is; longer, the
        run is parked `waiting` (this execution ends with Parked) unless a
        cancel request is on it (then it returns, and the next step call gets
        `Cancelled`). Parallel branches always wait where they are."""
        remaining = wake_at - now
        if remaining <= 0:
            return
        if remaining > moment and self._parks(scope):
            yield _Io(self.held.flush)
            yield _Io(self.held.park, (wake_at,))
            return  # the time came meanwhile, or a cancel request is on the run
        yield _Pause(self, remaining)

    # -------------------------------------------------------------- messages and events

    def wait_for(self, scope: Scope, topic: str, timeout: float | None) -> Any:
        """The next message on `topic` for this run, or None once `timeout`
        seconds (from the first time the run reached this wait) have passed.
        Recorded like a step: a `started` row with the deadline, then `done`
        with the message (consumed by this wait in the same statement) or the
        timeout. While nothing comes the run is parked `waiting`, its slot
        given back; a send on the topic makes it due at once."""
        return self._perform(self._wait_for(scope, self._next_id(scope, None), topic, timeout))

    def _wait_for(self, scope: Scope, step_id: str, topic: str, timeout: float | None) -> Rules:
        result = yield from self._recorded_wait(scope, step_id, WAIT, "waits for a message", topic,
                                                f"message:{topic}", timeout, self.held.take_message, topic)
        return serde.from_json(result["message"]) if "message" in result else None

    def _recorded_wait(self, scope: Scope, step_id: str, name: str, doing: str, topic: str, waiting_on: str,
                       timeout: float | None, take: Callable, what: Any) -> Rules:
        """A wait recorded like a step (`name`: WAIT or RESULT): its `started`
        row with `topic` and the deadline, then, once something came or the
        deadline passed, its result (parked meanwhile, see _wait_until_done)."""
        recorded = self.recorded.get(step_id)
        if recorded is not None and recorded.name != name:
            raise self._code_changed(step_id, recorded, doing)
        if recorded is None:
            yield from self._boundary(step_id, name)
            begun = yield _Io(self.held.begin_wait, (step_id, name, topic, timeout))
            recorded = self.recorded[step_id] = RecordedStep(step_id, name, StepStatus.STARTED, begun, None, None)
        if recorded.status == StepStatus.FAILED:
            raise self._failure(recorded)
        if recorded.status == StepStatus.STARTED:
            result = yield from self._wait_until_done(scope, step_id, name, take, what, waiting_on,
                                                      recorded.result.get("deadline"))
            recorded = self.recorded[step_id] = recorded._replace(status=StepStatus.DONE, result=result)
        return recorded.result

    def _wait_until_done(self, scope: Scope, step_id: str, name: str, take: Callable, what: Any,
                         waiting_on: str, deadline: float | None) -> Rules:
        """Until the started wait `step_id` ends (`take`: HeldRun.take_message
        or take_child, about `what`): its recorded result. Parks the run on
        `waiting_on` while nothing came."""
        pause = 0.02
        while True:
            took = yield _Io(take, (step_id, what, deadline))
            if took.result is not None:
                return took.result
            remaining = None if deadline is None else deadline - took.now
            if self._parks(scope) and (remaining is None or remaining > MOMENT):
                if (yield _Io(self.held.park_waiting, (deadline, waiting_on, took.wakes))):
                    yield from self._cancel(step_id, name, update=True)  # a wait's `Cancelled`, recorded as its failure
                continue  # a message came, or the child ended, meanwhile
            if self.held.cancel_requested and self.cancel_delivered is None:
                yield from self._cancel(step_id, name, update=True)
            # A parallel branch, or a moment to go: wait where the run is.
            yield _Pause(self, pause if remaining is None else max(0.0, min(pause, remaining)))
            pause = min(pause * 2, 0.5)

    def set_event(self, scope: Scope, key: str, value_json: str) -> Any:
        """Publish `key` = value for the outside (`everystep.get_event`),
        recorded like a step: a replay does not write it again."""
        return self._perform(self._set_event(self._next_id(scope, None), key, value_json))

    def _set_event(self, step_id: str, key: str, value_json: str) -> Rules:
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded.name != EVENT:
                raise self._code_changed(step_id, recorded, "sets an event")
            return
        yield from self._boundary(step_id, EVENT)
        yield _Io(self.held.set_event, (step_id, EVENT, key, value_json))
        self.recorded[step_id] = RecordedStep(step_id, EVENT, StepStatus.DONE, None, None, None)

    # -------------------------------------------------------------- streams

    def write_stream(self, scope: Scope | None, key: str, value_json: str | None) -> Any:
        """Append to the run's stream `key` (`value_json` None: close it):
        from the body (`scope`), recorded like a step, so a replay does not
        write it again; from inside a step (no scope), at least once, the
        entry tagged with the step and its try. Returns the entry's offset
        (None for the close of a stream closed already)."""
        if scope is not None:
            return self._perform(self._write_stream(self._next_id(scope, None), key, value_json))
        rules = self._write_stream(None, key, value_json, current_step.get())
        if self.asynchronous and aio.on_a_loop():
            return self._adrive(rules)  # an async step's: awaited on the loop
        return drive(rules)  # a sync step's, on its thread

    def _write_stream(self, step_id: str | None, key: str, value_json: str | None,
                      step: tuple[str, int] | None = None) -> Rules:
        if step_id is not None:
            recorded = self.recorded.get(step_id)
            if recorded is not None:
                raise self._code_changed(step_id, recorded, "writes to a stream")
        if self.held.streams_need_io():
            yield _Io(self.held.load_streams)
            yield _Io(self.held.flush_streams)
        if step_id is not None and step_id in self.held.streams.body_writes:
            return self.held.streams.body_writes[step_id]  # written by an earlier execution
        if step is not None:
            return self.held.append_stream(key, value_json, step[0], step[1])
        return self.held.append_stream(key, value_json, step_id, None)
    def set_attributes(self, scope: Scope, attributes_json: str) -> Any:
        """Add or change the run's attributes, recorded like a step: a replay
        does not write them again."""
        return self._perform(self._set_attributes(self._next_id(scope, None), attributes_json))

    def _set_attributes(self, step_id: str, attributes_json: str) -> Rules:
        recorded = self.recorded.get(step_id)
        if recorded is not None:
            if recorded.name != ATTRIBUTES:
                raise self._code_changed(step_id, recorded, "sets attributes")
            return
        yield from self._boundary(step_id, ATTRIBUTES)
        yield _Io(self.held.set_attributes, (step_id, ATTRIBUTES, attributes_json))
        self.recorded[step_id] = RecordedStep(step_id, ATTRIBUTES, StepStatus.DONE, None, None, None)

    # -------------------------------------------------------------- child workflows

    def start_child(self, scope: Scope, child_name: str, args_json: str) -> Any:
        """Schedule a child run once, recorded like a step: a replay returns
        the same child (its id)."""
        return self._perform(self._start_child(self._next_id(scope, None), child_name, args_json))

    def _start_child(self, step_id: str, child_name: str, args_json: str) -> Rules:
        recorded = self.recorded.get(step_id)
        if recorded is None:
            yield from self._boundary(step_id, START)
            result = yield _Io(self.held.start_child,
                               (step_id, START, child_name, args_json, registry.timeout_of(child_name)))
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
        return self._perform(self._child_result(scope, self._next_id(scope, None), child, timeout))

    def _child_result(self, scope: Scope, step_id: str, child: uuid.UUID, timeout: float | None) -> Rules:
        end = yield from self._recorded_wait(scope, step_id, RESULT, "waits for a child", f"child:{child}",
                                             f"child:{child}", timeout, self.held.take_child, child)
        if end.get("timeout"):
            raise TimeoutError(f"child run {child} did not end within the timeout")
        if end["status"] == RunStatus.COMPLETED:
            return serde.from_json(end["result"])
        raise ChildFailed(child, end["status"], None if end["error"] is None else serde.decode_exception(end["error"]))

    def call_child(self, scope: Scope, child_name: str, args_json: str) -> Any:
        """start_child then child_result, their two ids taken now."""
        start_id = self._next_id(scope, None)
        result_id = self._next_id(scope, None)

        def rules() -> Rules:
            child = yield from self._start_child(start_id, child_name, args_json)
            return (yield from self._child_result(scope, result_id, child, None))

        return self._perform(rules())

    # -------------------------------------------------------------- patches

    def patched(self, scope: Scope, patch: str) -> bool:
        """Whether this run takes the new branch of the patch `patch`: the
        decision recorded for it, else True when the run's recorded history
        in this scope goes no further than here (it reaches the patch for the
        first time under the new code), False when it does (it went the old
        way). The decision is recorded like a step, under its own id
        (`<scope>patch:<name>`; the name is checked by the caller), so the positional ids of the steps around it
        do not move, and every later replay decides the same. Its row waits
        for the next write (no I/O here: an async body calls it without await)."""
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
        if not self.asynchronous:
            self.held.check()
        now = (time.perf_counter(), time.time())
        drive(self._record(step_id, PATCH_STEP, "[]", "{}", StepStatus.DONE, not went_further, None, False, now))
        return not went_further

    # -------------------------------------------------------------- parallel

    def fork(self, scope: Scope, branches: tuple, everystep_id: str | None) -> tuple:
        if self.asynchronous:
            raise EverystepError("parallel() runs its branches on threads, which an async workflow has none of: "
                                 "use `await everystep.gather(...)`")
        fork_id = self._next_id(scope, everystep_id)
        self.held.flush()  # the branches' steps come after it
        scopes = [scope.branch(fork_id, i) for i in range(len(branches))]
        results = run_branches(branches, scopes)
        if self.held.halt is not None:
            raise self.held.halt
        return results

    def gather(self, scope: Scope, aws: tuple, everystep_id: str | None) -> Any:
        """everystep.gather in an async body: a fork, awaitable i its branch i."""
        if not self.asynchronous:
            for aw in aws:
                if inspect.iscoroutine(aw):
                    aw.close()
            raise EverystepError("gather() is for async workflows; a sync workflow runs branches with parallel()")
        fork_id = self._next_id(scope, everystep_id)
        return self._gather(scope, fork_id, aws)

    @aio.own_scope
    async def _gather(self, scope: Scope, fork_id: str, aws: tuple) -> list:
        results = await aio.gather(aws, lambda i: scope.branch(fork_id, i))
        if self.held.halt is not None:
            raise self.held.halt
        return results
