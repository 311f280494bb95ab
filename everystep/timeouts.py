"""A step attempt bounded by its `@step(timeout=...)`.

CPython cannot stop a thread, so a sync attempt with a timeout runs on a
thread of its own (a daemon) while the run's thread waits for it at most
`timeout` seconds. Past that the attempt is abandoned: the run goes on at
once (its slot is not held by the attempt any more), the thread runs on to
whatever end, and what it returns or raises then is dropped, never
recorded. Each abandoned thread still running is counted in the gauge
`everystep_step_threads_abandoned{workflow}` (and logged when abandoned and
when it ends), so a step that never returns shows as a leak rather than a
silent one. An own thread, not a pool's: a hung attempt cannot starve the
steps of other runs.

An async attempt is a task: at its timeout it is cancelled (CancelledError
at its next await) and the run goes on without waiting for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from everystep import metrics
from everystep.context import current_run
from everystep.errors import StepTimeout

log = logging.getLogger("everystep")


def _start(context: contextvars.Context, fn: Callable, args: tuple, kwargs: dict, workflow: str,
           step: str) -> concurrent.futures.Future:
    """Run fn(*args, **kwargs) in `context` on a new daemon thread: its future."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()

    def attempt() -> None:
        try:
            value = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001  (handed to the waiter, or dropped once abandoned)
            future.set_exception(exc)
        else:
            future.set_result(value)

    threading.Thread(target=attempt, name=f"everystep-step {step}", daemon=True).start()
    return future


def _abandon(future: concurrent.futures.Future, workflow: str, step: str, timeout: float) -> StepTimeout:
    """The attempt behind `future` timed out: count its thread until it ends."""
    gauge = metrics.ABANDONED_STEP_THREADS.labels(workflow)
    gauge.inc()
    run = current_run.get()
    extra = {"workflow": workflow, **({"run": str(run.workflow_id)} if run is not None else {})}
    log.warning("step %s timed out after %g s; its thread is abandoned (its result will be ignored)",
                step, timeout, extra=extra)

    def ended(_: concurrent.futures.Future) -> None:
        gauge.dec()
        log.info("an abandoned attempt of step %s ended; its result was ignored", step, extra=extra)

    future.add_done_callback(ended)
    return timed_out(workflow, step, timeout)


def timed_out(workflow: str, step: str, timeout: float) -> StepTimeout:
    metrics.TIMEOUTS.labels(workflow, "step").inc()
    return StepTimeout(step, timeout)


def call(fn: Callable, args: tuple, kwargs: dict, timeout: float, workflow: str, step: str) -> Any:
    """A sync step's attempt on the calling thread's behalf, at most `timeout` seconds."""
    future = _start(contextvars.copy_context(), fn, args, kwargs, workflow, step)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        raise _abandon(future, workflow, step, timeout) from None


async def acall(context: contextvars.Context, fn: Callable, args: tuple, kwargs: dict, timeout: float,
                workflow: str, step: str) -> Any:
    """A sync step's attempt for an async run, at most `timeout` seconds (the loop never blocks)."""
    future = _start(context, fn, args, kwargs, workflow, step)
    waited = asyncio.wrap_future(future)
    done, _ = await asyncio.wait({waited}, timeout=timeout)
    if not done:
        waited.add_done_callback(_retrieve)
        raise _abandon(future, workflow, step, timeout)
    return waited.result()


async def bounded(task: asyncio.Task, timeout: float, workflow: str, step: str) -> Any:
    """An async step's attempt (its task), at most `timeout` seconds: then it
    is cancelled (at its next await) and StepTimeout raised, without waiting
    for the task to unwind."""
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()  # the caller is cancelled: so is its attempt
        raise
    if not done:
        task.cancel("everystep: the step timed out")
        task.add_done_callback(_retrieve)
        raise timed_out(workflow, step, timeout)
    return task.result()


def run_coroutine(coro: Coroutine, timeout: float | None, workflow: str, step: str) -> Any:
    """An async step called by a sync workflow, on an event loop of its own."""
    if timeout is None:
        return asyncio.run(coro)

    async def attempt() -> Any:
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if done:
            return task.result()
        task.cancel("everystep: the step timed out")
        try:
            await task  # cancelled at its next await: the loop closes after it
        except BaseException:  # noqa: BLE001  (the attempt timed out, whatever it did then)
            pass
        raise timed_out(workflow, step, timeout)

    return asyncio.run(attempt())


def _retrieve(future: asyncio.Future) -> None:
    """Read what an abandoned attempt ended with, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
