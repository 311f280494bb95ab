"""asyncio in the engine: the event loop a runner executes its async runs on,
the scopes of the tasks a workflow body starts, `gather`, and the watch for
calls that block the loop. Knows nothing about the database.

Step ids are positional, so what a body runs concurrently must take its ids
in an order that does not depend on the loop. A step call takes its id when
it is called (the coroutine it returns has it already); a task that a body
starts (`asyncio.create_task`, `asyncio.gather` or `ensure_future` of a
coroutine that is not a step call) is a fork of one branch, taking the next
id of its scope when it is created: its steps are `<id>.0.1`, `<id>.0.2`;
`everystep.gather` is a fork whose awaitable i is the branch `<id>.<i>`,
like `parallel`'s. What would let the body depend on the order in which
things complete (`asyncio.wait`, `asyncio.as_completed`) over its tasks
stops the run with WorkflowCodeError: a replay serves recorded steps at once,
in another order than the first run saw.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from everystep import metrics
from everystep.context import Scope, current_scope, joined

log = logging.getLogger("everystep")

# The loop's heartbeat (seconds), and how long it may go without one before
# the watch says which run holds it up.
TICK = 0.05
BLOCKED = 0.5

# The code of the coroutines that carry the scope they were called in (a
# step call's, everystep.gather's): a task made of one takes no id.
_OWN_SCOPE: set[Any] = set()


def own_scope(fn: Callable) -> Callable:
    """Mark a coroutine function whose coroutines carry their scope already."""
    _OWN_SCOPE.add(fn.__code__)
    return fn


class WorkflowTask(asyncio.Task):
    """A task started in a workflow body. Its completion may be awaited
    (directly, with asyncio.gather or everystep.gather), not watched in the
    order tasks complete (asyncio.wait, asyncio.as_completed)."""

    everystep_scope: Scope | None = None

    def add_done_callback(self, fn: Callable, *, context: contextvars.Context | None = None) -> None:
        scope = self.everystep_scope
        if scope is not None and _watches_completion_order(fn):
            raise scope.run.replay.diverged(
                "asyncio.wait and asyncio.as_completed over the tasks or steps of a workflow body make the body "
                "depend on the order they complete in, which a replay does not repeat (it serves recorded steps "
                "at once); await them with everystep.gather or asyncio.gather, or put the race inside a step"
            )
        super().add_done_callback(fn, context=context)


def _watches_completion_order(fn: Callable) -> bool:
    """Whether `fn` is the callback of asyncio.wait or as_completed."""
    if getattr(fn, "__module__", None) != "asyncio.tasks":
        return False
    outer = getattr(fn, "__qualname__", "").split(".")[0]
    return outer in ("_wait", "as_completed", "_AsCompletedIterator")


def task_factory(loop: asyncio.AbstractEventLoop, coro: Coroutine, **kwargs: Any) -> asyncio.Task:
    """The runner's loop's task factory: a task created in a workflow body
    (or a branch of one) takes the next id of its scope and records its steps
    in a scope of its own, unless it is a step call (which has its id)."""
    context = kwargs.pop("context", None) or contextvars.copy_context()
    scope = context.get(current_scope)
    if scope is None:
        return asyncio.Task(coro, loop=loop, context=context, **kwargs)
    if getattr(coro, "cr_code", None) not in _OWN_SCOPE:
        branch = scope.branch(scope.next_id(None), 0)
        context.run(current_scope.set, branch)
    task = WorkflowTask(coro, loop=loop, context=context, **kwargs)
    task.everystep_scope = scope
    scope.run.replay.started_task(task)
    return task


@own_scope
async def gather(aws: Iterable[Awaitable], scopes: Callable[[int], Scope] | None) -> list:
    """Await every awaitable concurrently, each to its end, and return their
    results in order; raise one failure as is, several as an ExceptionGroup
    (a halt of the run first). With `scopes`, awaitable i that is not a step
    call records its steps in the scope `scopes(i)`."""
    tasks = []
    for i, aw in enumerate(aws):
        if asyncio.isfuture(aw):
            tasks.append(aw)
            continue
        if not asyncio.iscoroutine(aw):
            if not hasattr(aw, "__await__"):
                for task in tasks:
                    task.cancel()
                raise TypeError(f"gather() takes awaitables, not {aw!r}")
            aw = _awaited(aw)
        context = contextvars.copy_context()
        if scopes is not None and aw.cr_code not in _OWN_SCOPE:
            context.run(current_scope.set, scopes(i))
        tasks.append(asyncio.Task(aw, context=context))
    results: list[Any] = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)
    try:
        for i, task in enumerate(tasks):
            try:
                results[i] = await task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise
                errors[i] = asyncio.CancelledError()
            except BaseException as exc:  # noqa: BLE001  (combined below)
                errors[i] = exc
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        raise
    return list(joined(results, errors, "gathered awaitables"))


async def _awaited(aw: Awaitable) -> Any:
    return await aw


# ---------------------------------------------------------------- the loop

class Labels:
    """What each task of the loop is doing, for the watch's log line: the run
    (and the step) it executes."""

    def __init__(self) -> None:
        self._labels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def put(self, task: asyncio.Task, label: str) -> None:
        self._labels[task] = label

    def get(self, task: asyncio.Task | None) -> str | None:
        try:
            return None if task is None else self._labels.get(task)
        except TypeError:
            return None


class Loop:
    """An event loop on a thread of its own, for one runner's async runs, and
    the thread pools beside it: `io`, the engine's writes about those runs
    (a few threads for all of them: a run that waits holds none);
    `outcomes`, as many threads again for the outcomes of unsafe steps only,
    so that they never queue behind the other writes (the time between a
    `started` mark and its outcome's commit is the time a crash blocks the
    run); and `steps`, the sync steps that async workflows call (also the
    loop's default executor, so asyncio.to_thread in a step uses it)."""

    def __init__(self, runner: str, io_threads: int, step_threads: int):
        self.runner = runner
        self.loop = asyncio.new_event_loop()
        self.loop.set_task_factory(task_factory)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix=f"everystep-{runner}-io")
        self.outcomes = ThreadPoolExecutor(io_threads, thread_name_prefix=f"everystep-{runner}-outcomes")
        self.steps = ThreadPoolExecutor(step_threads, thread_name_prefix=f"everystep-{runner}-steps")
        self.loop.set_default_executor(self.steps)
        self.labels = Labels()
        self._beat = time.monotonic()
        self._closed = False
        self._lag = metrics.LOOP_LAG.labels(runner)
        self._blocks = metrics.LOOP_BLOCKED.labels(runner)
        self.thread = threading.Thread(target=self._run, name=f"everystep-{runner}-loop", daemon=True)
        self.thread.start()
        self._watch = threading.Thread(target=self._watch_forever, name=f"everystep-{runner}-loop-watch",
                                       daemon=True)
        self._watch.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._heartbeat, time.monotonic())
        self.loop.run_forever()

    def submit(self, coro: Coroutine) -> Future:
        """Run `coro` on the loop; its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine) -> Any:
        """Run `coro` on the loop and wait for its result on this thread."""
        return self.submit(coro).result()

    def soon(self, fn: Callable, *args: Any) -> None:
        """Call `fn(*args)` on the loop's thread."""
        if not self._closed:
            self.loop.call_soon_threadsafe(fn, *args)

    async def io_call(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` (a blocking call of the engine's) on an I/O thread."""
        return await self.loop.run_in_executor(self.io, fn, *args)

    async def outcome_call(self, fn: Callable, *args: Any) -> Any:
        """`io_call` of the write that ends an unsafe step's uncertainty, on
        a thread of its own lane."""
        return await self.loop.run_in_executor(self.outcomes, fn, *args)

    async def step_call(self, context: contextvars.Context, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """A sync step's function, in `context`, on a step thread."""
        return await self.loop.run_in_executor(self.steps, functools.partial(context.run, fn, *args, **kwargs))

    def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs on the loop, stop it and its threads."""
        if self._closed:
            return
        self._closed = True

        def cancel_all() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_later(0.05, self.loop.stop)

        try:
            self.loop.call_soon_threadsafe(cancel_all)
        except RuntimeError:
            pass  # closed already
        self.thread.join(timeout)
        self.io.shutdown(wait=False, cancel_futures=True)
        self.outcomes.shutdown(wait=False, cancel_futures=True)
        self.steps.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ the watch

    def _heartbeat(self, expected: float) -> None:
        now = time.monotonic()
        self._lag.observe(max(0.0, now - expected))
        self._beat = now
        if not self._closed:
            self.loop.call_at(now + TICK, self._heartbeat, now + TICK)

    def _watch_forever(self) -> None:
        """Says, once per stall, which run holds the loop up: a blocking
        call in async code delays every async run of the process."""
        reported = 0.0
        while not self._closed:
            time.sleep(TICK)
            beat = self._beat
            stalled = time.monotonic() - beat
            if stalled < BLOCKED or beat == reported:
                continue
            reported = beat
            self._blocks.inc()
            task = asyncio.current_task(self.loop) if self.thread.is_alive() else None
            log.warning(
                "the event loop has been blocked for %.1f s by %s%s: a blocking call in async code holds up every "
                "async run of this process; await an async API instead, or make the step a sync one",
                stalled, self.labels.get(task) or "code outside any run", _where(self.thread.ident),
                extra={"runner": self.runner},
            )


def _where(thread_id: int | None) -> str:
    """ ' at file:line in function', the innermost frame of the thread."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return ""
    code = frame.f_code
    return f" at {os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


def on_a_loop() -> bool:
    """Whether this thread is running an event loop now (an async step's task)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
