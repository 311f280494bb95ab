"""The public API: @workflow, @step, parallel, schedule. Thin; the SQL is in
`db`, the replay in `runner`."""

from __future__ import annotations

import asyncio
import datetime
import functools
import inspect
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar, overload

import psycopg

from everystep import aio, db, registry, reruns, serde, tracing
from everystep import attributes as run_attributes
from everystep.connections import (  # noqa: F401  (atransaction, transaction, use: the API's, from there)
    async_connection,
    atransaction,
    bound_connection,
    transaction,
    transaction_connection,
    use,
)
from everystep.context import SEGMENT, current_scope, run_branches
from everystep.db import dags as dag_store
from everystep.db import queries
from everystep.errors import EverystepError, RunFailed, StepFailure, WorkflowArgumentsError
from everystep.ids import uuid7, uuid7_many
from everystep.retries import Backoff, RetryPolicy
from everystep.schema import (
    DEFAULT_MAX_STEPS,
    MAX_KEY,
    MAX_NAME,
    MAX_PRIORITY,
    MIN_PRIORITY,
    RunStatus,
    StepStatus,
)
from everystep.transactional import astep_session, step_connection, step_session  # noqa: F401  (the API's)

F = TypeVar("F", bound=Callable[..., Any])


@overload
def workflow(fn: F) -> F: ...
@overload
def workflow(*, concurrency: int | None = None, timeout: float | datetime.timedelta | None = None,
             priority: int | None = None, concurrency_per_key: int | None = None,
             max_steps: int | None = DEFAULT_MAX_STEPS) -> Callable[[F], F]: ...


def workflow(fn: Callable | None = None, *, concurrency: int | None = None,
             timeout: float | datetime.timedelta | None = None, priority: int | None = None,
             concurrency_per_key: int | None = None, max_steps: int | None = DEFAULT_MAX_STEPS) -> Any:
    """Mark a function as a workflow, registered under `module.qualname`.
    Called directly, it is a plain function call. `concurrency=N`: at most N
    runs of it running at once across every worker sharing the database (the
    config's `workflows: {name: {concurrency: ...}}` overrides it).
    `timeout`: seconds (> 0, or a timedelta) every run has from the time it
    is due (its schedule, or its delayed start): its deadline, unless
    schedule(deadline=) or its parent's is earlier; a run not finished by
    then is cancelled with the reason 'deadline'.
    `priority=N` (-100..100, higher first): its runs' priority when
    schedule() names none. `concurrency_per_key=N`: at most N of its runs
    running at once per concurrency key (schedule(concurrency_key=...)),
    the keys taken in turn. `max_steps`: a run that calls more steps (sleeps,
    waits, forks, ... each counts; replayed ones too) fails at the call past
    it, whatever the body does with the error (default 100,000; None: no
    bound)."""
    if concurrency is not None and (type(concurrency) is not int or concurrency < 1):
        raise EverystepError(f"concurrency must be a whole number >= 1 or None, got {concurrency!r}")
    if concurrency_per_key is not None and (type(concurrency_per_key) is not int or concurrency_per_key < 1):
        raise EverystepError(f"concurrency_per_key must be a whole number >= 1 or None, got {concurrency_per_key!r}")
    if priority is not None:
        check_priority("@workflow(priority=...)", priority)
    if max_steps is not None and (type(max_steps) is not int or max_steps < 1):
        raise EverystepError(f"max_steps must be a whole number >= 1 or None (no bound), got {max_steps!r}")
    timeout = None if timeout is None else _timeout("@workflow(timeout=...)", timeout)
    if fn is None:
        return functools.partial(workflow, concurrency=concurrency, timeout=timeout, priority=priority,
                                 concurrency_per_key=concurrency_per_key, max_steps=max_steps)
    if "<locals>" in getattr(fn, "__qualname__", ""):
        raise EverystepError(
            f"@workflow {fn.__qualname__} is defined inside a function: a worker finds a workflow by its "
            "module.qualname, which cannot import it; define it at the top level of a module")
    fn.__everystep_concurrency__ = concurrency  # type: ignore[attr-defined]
    fn.__everystep_timeout__ = timeout  # type: ignore[attr-defined]
    fn.__everystep_priority__ = priority  # type: ignore[attr-defined]
    fn.__everystep_concurrency_per_key__ = concurrency_per_key  # type: ignore[attr-defined]
    fn.__everystep_max_steps__ = max_steps  # type: ignore[attr-defined]
    registry.register(fn)
    return fn


def _check_signature(caller: str, name: str, fn: Callable, args: Sequence[Any]) -> None:
    """A run whose arguments do not fit its workflow's parameters could never
    start: refused before anything is written."""
    problem = registry.arguments_problem(fn, args)
    if problem:
        raise WorkflowArgumentsError(f"{caller}: {name}{problem}")


def check_priority(what: str, priority: Any) -> int:
    """A run's priority: a whole number from -100 to 100 (higher runs first)."""
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise EverystepError(f"{what} takes a whole number from {MIN_PRIORITY} to {MAX_PRIORITY} "
                             f"(higher runs first), not {priority!r}")
    return priority


def rate_limit(name: str, rate: float, per: float = 1.0, burst: int | None = None, conn: Any = None) -> None:
    """Set (or change) the fleet-wide rate limit `name`, which
    @step(rate_limit=name) steps take a token of: `rate` tokens every `per`
    seconds, at most `burst` (default: `rate`, rounded up) saved up and taken
    in any `per` seconds. Written in the caller's transaction (`conn`, else
    the bound connection; in autocommit, at once), as the config's
    `rate_limits:` section is by every worker that starts."""
    if not isinstance(name, str) or not name or len(name) > MAX_KEY:
        raise EverystepError(f"rate_limit() takes a name of 1 to {MAX_KEY} characters, not {name!r:.60}")
    for what, value in (("rate", rate), ("per", per)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise EverystepError(f"rate_limit({name!r}): {what} must be a number > 0, not {value!r}")
    if burst is None:
        burst = max(1, math.ceil(rate))
    elif type(burst) is not int or burst < 1:
        raise EverystepError(f"rate_limit({name!r}): burst must be a whole number >= 1, not {burst!r}")
    conn = transaction_connection(conn, "rate_limit()", write=False)  # autocommit: written at once
    db.put_rate_limits(conn, {name: (float(rate), float(per), burst)})


def _check_concurrency_key(what: str, key: Any) -> None:
    if key is not None and (not isinstance(key, str) or not key or len(key) > MAX_KEY):
        raise EverystepError(f"{what} takes a non-empty string of at most {MAX_KEY} characters, not {key!r:.60}")


@overload
def step(fn: F) -> F: ...
@overload
def step(*, unsafe_to_repeat: bool = False, retries: int = 0, backoff: float | Backoff | None = None,
         retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
         timeout: float | datetime.timedelta | None = None,
         rate_limit: str | None = None, transactional: bool = False,
         write_behind: bool = False) -> Callable[[F], F]: ...


def step(fn: Callable | None = None, *, unsafe_to_repeat: bool = False, retries: int = 0,
         backoff: float | Backoff | None = None,
         retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None,
         timeout: float | datetime.timedelta | None = None,
         rate_limit: str | None = None, transactional: bool = False, write_behind: bool = False) -> Any:
    """Mark a unit of durable work. Inside a running workflow each call is
    recorded (or served from the record on replay); outside, a plain call.

    `retries=N`: up to N further attempts after a failed one, waiting
    `backoff` between them (a Backoff, or a number: its initial wait in
    seconds; default Backoff(): 1 s doubling up to 300 s, 20% jitter).
    `retry_on`: the exception types retried (default: every Exception; an
    unsafe_to_repeat step is retried only on the types listed here).
    `timeout`: seconds (> 0, or a timedelta) an attempt may take; past them
    it fails with `everystep.StepTimeout`, an attempt like any other under
    the retry policy (a sync attempt's thread is abandoned, an async one is
    cancelled at its next await); an unsafe_to_repeat step that times out
    is never retried: its run blocks.

    The function may be an `async def`. In an async workflow every step call
    returns an awaitable (`await charge(...)`), whatever the step's kind; a
    sync step's function runs on a thread then. In a sync workflow every step
    call returns the step's value (an async step's function runs on an
    event loop of its own). Outside a workflow a step is the plain function.

    `rate_limit="name"`: each attempt first takes a token of that fleet-wide
    rate limit (config `rate_limits:`, or everystep.rate_limit()); with none
    left the run waits for the next (parked, its slot given back, when that
    is more than a moment away).

    `transactional=True`: exactly once for the step's database writes. The
    step runs in a database transaction that also records its outcome: what
    it writes through `everystep.step_connection()` and its recorded result
    commit together or not at all, fenced by the run's claim like every
    write about it. A failed attempt's writes are rolled back. The step
    holds a connection for its whole length (docs/concepts.md,
    "Transactional steps").

    `write_behind=True`: while every slot of the worker process runs a body,
    the outcome of a call that returned within 2 ms may be written after the
    next step has started (with the run's end, or within 50 ms), so that a
    run of short steps commits once. A worker lost meanwhile runs the call
    again on replay, after steps that followed it may have run: for steps
    whose result no later effect depends on (docs/concepts.md, "Write-behind
    steps"). Sync workflows only; an async run writes as without it."""
    retry = _retry_policy(retries, backoff, retry_on)
    _check_transactional(transactional, unsafe_to_repeat, timeout)
    _check_write_behind(write_behind, unsafe_to_repeat, transactional)
    timeout = None if timeout is None else _timeout("@step(timeout=...)", timeout)
    if rate_limit is not None and (not isinstance(rate_limit, str) or not rate_limit or len(rate_limit) > MAX_KEY):
        raise EverystepError(f"rate_limit must be the name of a rate limit (1 to {MAX_KEY} characters), "
                             f"not {rate_limit!r:.60}")
    if fn is None:
        return functools.partial(step, unsafe_to_repeat=unsafe_to_repeat, retries=retries, backoff=backoff,
                                 retry_on=retry_on, timeout=timeout, rate_limit=rate_limit,
                                 transactional=transactional, write_behind=write_behind)
    name = registry.qualified_name(fn)
    if len(name) > MAX_NAME:
        raise EverystepError(f"step name {name[:60]}... is longer than {MAX_NAME} characters")

    @functools.wraps(fn)
    def call(*args: Any, everystep_id: str | None = None, **kwargs: Any) -> Any:
        scope = current_scope.get()
        if scope is None:
            return fn(*args, **kwargs)
        if rate_limit is None and not transactional and not write_behind:
            return scope.run.replay.step(scope, fn, name, unsafe_to_repeat, args, kwargs, everystep_id, retry,
                                         timeout)
        return scope.run.replay.step(scope, fn, name, unsafe_to_repeat, args, kwargs, everystep_id, retry,
                                     timeout, rate_limit=rate_limit, transactional=transactional,
                                     write_behind=write_behind)

    if inspect.iscoroutinefunction(fn) and hasattr(inspect, "markcoroutinefunction"):  # Python 3.12+
        inspect.markcoroutinefunction(call)
    call.__everystep_step__ = name  # type: ignore[attr-defined]
    call.unsafe_to_repeat = unsafe_to_repeat  # type: ignore[attr-defined]
    call.retry = retry  # type: ignore[attr-defined]
    call.timeout = timeout  # type: ignore[attr-defined]
    call.rate_limit = rate_limit  # type: ignore[attr-defined]
    call.transactional = transactional  # type: ignore[attr-defined]
    return call


def _check_transactional(transactional: Any, unsafe_to_repeat: bool, timeout: Any) -> None:
    if type(transactional) is not bool:
        raise EverystepError(f"transactional must be True or False, not {transactional!r}")
    if transactional and unsafe_to_repeat:
        raise EverystepError("@step(transactional=True) is exactly once for its database writes already; an "
                             "effect outside the database is for a step of its own, @step(unsafe_to_repeat=True)")
    if transactional and timeout is not None:
        raise EverystepError("@step(transactional=True) takes no timeout=: an attempt abandoned at its timeout "
                             "would still hold its transaction; bound its statements with statement_timeout "
                             "(SET LOCAL on step_connection()) instead")


def _check_write_behind(write_behind: Any, unsafe_to_repeat: bool, transactional: bool) -> None:
    if type(write_behind) is not bool:
        raise EverystepError(f"write_behind must be True or False, not {write_behind!r}")
    if write_behind and unsafe_to_repeat:
        raise EverystepError("@step(unsafe_to_repeat=True) writes its outcome before anything else happens; it "
                             "cannot be write_behind=True")
    if write_behind and transactional:
        raise EverystepError("@step(transactional=True) commits its outcome with its own writes; it cannot be "
                             "write_behind=True")


def _retry_policy(retries: Any, backoff: Any, retry_on: Any) -> RetryPolicy | None:
    """The checked retry options of @step (one clear error for a bad one)."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise EverystepError(f"retries must be a whole number >= 0, not {retries!r}")
    if backoff is None:
        backoff = Backoff()
    elif isinstance(backoff, (int, float)) and not isinstance(backoff, bool):
        backoff = Backoff(initial=float(backoff))
    if not isinstance(backoff, Backoff):
        raise EverystepError(f"backoff must be a number of seconds or an everystep.Backoff, not {backoff!r}")
    for field, value in backoff._asdict().items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise EverystepError(f"Backoff {field} must be a finite number >= 0, not {value!r}")
    if backoff.factor < 1 or backoff.jitter > 1:
        raise EverystepError("Backoff factor must be >= 1 and jitter between 0 and 1")
    if retry_on is not None:
        types = retry_on if isinstance(retry_on, tuple) else (retry_on,)
        if not types or not all(isinstance(t, type) and issubclass(t, Exception) for t in types):
            raise EverystepError(f"retry_on must be an Exception class or a tuple of them, not {retry_on!r}")
        retry_on = types
    if retries == 0:
        return None
    return RetryPolicy(retries, backoff, retry_on)


def parallel(*branches: Callable[[], Any] | list[Callable[[], Any]], everystep_id: str | None = None) -> tuple:
    """Run zero-argument callables concurrently and return their results in
    branch order. A list of callables is a sequence branch: run in order,
    returning a tuple. All branches run to completion; one failure is raised
    as is, several as an ExceptionGroup. (An async workflow uses `gather`.)"""
    scope = current_scope.get()
    if scope is None:
        return run_branches(branches, None)
    return scope.run.replay.fork(scope, branches, everystep_id)


def gather(*aws: Awaitable, everystep_id: str | None = None) -> Awaitable[list]:
    """In an async workflow: await the awaitables concurrently and return
    their results as a list in order, like asyncio.gather, but as
    `parallel` does: every one runs to its end; one failure is raised as
    is, several as an ExceptionGroup; a Terminal (or EffectUncertain, or a
    drain) wins. It is a fork with an id of its own: a step call passed to
    it has its id already (taken at the call), any other awaitable i
    records its steps in the branch `<fork>.<i>`. Outside a workflow, the
    same without ids."""
    scope = current_scope.get()
    if scope is None:
        return aio.gather(aws, None)
    return scope.run.replay.gather(scope, aws, everystep_id)


def patched(patch: str) -> bool:
    """Change a workflow's code safely with runs in flight:
    `if everystep.patched("new-discount"): <new code> else: <old code>`.
    True for a run that reaches the patch for the first time under the new
    code, False for a run whose recorded history already went the old way;
    the answer is recorded like a step, so every replay gives the same.
    Outside a workflow: True (plain Python runs the new code)."""
    if not isinstance(patch, str) or not SEGMENT.fullmatch(patch):
        raise EverystepError(
            f"bad patch name {patch!r}: use letters, digits, '_', '-' or ':', not only digits, and no dots"
        )
    scope = current_scope.get()
    if scope is None:
        return True
    return scope.run.replay.patched(scope, patch)


# ---------------------------------------------------------------- scheduling

class ScheduledRun:
    """What `schedule()` returns: the run's id and whether this call created
    it; `result()` (or `await aresult()`) waits for the run's end from outside."""

    __slots__ = ("id", "name", "created")

    def __init__(self, id: uuid.UUID, name: str, created: bool):
        self.id = id
        self.name = name
        self.created = created

    def result(self, timeout: float | datetime.timedelta | None = None, conn: psycopg.Connection | None = None) -> Any:
        """Wait until the run ends and return its result, or raise RunFailed
        (it failed, stopped or was cancelled), or TimeoutError after
        `timeout` seconds (None: for ever). A run `blocked` has not ended: an
        operator may resolve it. Reads with `conn` (or the bound connection),
        each look its own statement: call it once the scheduling transaction
        has committed."""
        looks = _Looks("result()", timeout)
        conn = _reading(conn, "result()")
        while True:
            ended = _ended(self.id, db.load_run(conn, self.id))
            if ended is not None:
                return ended.value()
            time.sleep(looks.pause_or_time_out(self.id))

    async def aresult(self, timeout: float | datetime.timedelta | None = None, conn: Any = None) -> Any:
        """`result()` for asyncio, with an AsyncConnection (or a SQLAlchemy
        AsyncSession), or the one bound."""
        looks = _Looks("aresult()", timeout)
        aconn = await async_connection(conn, "aresult()", write=False)
        while True:
            ended = _ended(self.id, await db.aload_run(aconn, self.id))
            if ended is not None:
                return ended.value()
            await asyncio.sleep(looks.pause_or_time_out(self.id))

    def __repr__(self) -> str:
        return f"<ScheduledRun {self.id} {self.name}{'' if self.created else ' (existing)'}>"


class _End(NamedTuple):
    run_id: uuid.UUID
    row: dict

    def value(self) -> Any:
        if self.row["status"] == RunStatus.COMPLETED:
            return serde.from_json(self.row["result"])
        error = self.row["error"]
        raise RunFailed(self.run_id, self.row["status"], None if error is None else serde.decode_exception(error))


def _ended(run_id: uuid.UUID, row: dict | None) -> _End | None:
    """The run's end, None while it has none."""
    if row is None:
        raise EverystepError(f"no run {run_id}")
    return _End(run_id, row) if row["status"] in db.TERMINAL else None


class _Looks:
    """The pauses between the looks of a wait from outside (20 ms doubling
    up to 500 ms), until its timeout."""

    def __init__(self, what: str, timeout: float | datetime.timedelta | None):
        self.limit = None if timeout is None else time.monotonic() + _seconds(what, timeout)
        self.next = 0.02

    def pause(self) -> float | None:
        """The pause before the next look; None once the timeout passed."""
        left = None if self.limit is None else self.limit - time.monotonic()
        if left is not None and left <= 0:
            return None
        pause, self.next = self.next, min(self.next * 2, 0.5)
        return pause if left is None else min(pause, left)

    def pause_or_time_out(self, run_id: uuid.UUID) -> float:
        pause = self.pause()
        if pause is None:
            raise TimeoutError(f"run {run_id} did not end within the timeout")
        return pause


def _reading(conn: Any, caller: str) -> Any:
    """The connection a read from outside uses: `conn`, else the bound one."""
    conn = conn or bound_connection()
    if conn is None:
        raise EverystepError(f"{caller} needs a connection: pass conn=<psycopg connection> or bind one "
                             "with `everystep.use(conn)`")
    return transaction_connection(conn, caller, write=False)


def schedule(workflow_fn: Callable | str, *args: Any, idempotency_key: str | None = None,
             conn: Any = None, at: datetime.datetime | None = None,
             after: float | datetime.timedelta | None = None,
             deadline: float | datetime.timedelta | datetime.datetime | None = None, priority: int | None = None,
             concurrency_key: str | None = None, attributes: dict[str, Any] | None = None,
             depends_on: Iterable[Any] = ()) -> ScheduledRun:
    """Insert a run of `workflow_fn(*args)` into the caller's transaction
    (`conn`: a psycopg connection or a SQLAlchemy Session or Connection;
    else the bound one, else Django's). Nothing runs now; workers claim the
    run once the transaction commits, and not before `at` (an aware
    datetime) or `after` seconds (or a timedelta) from now, by the
    database's clock. `deadline`: seconds from now (or a timedelta), or an
    aware datetime, by which the run must be finished, else it is cancelled
    with the reason 'deadline' (the earlier of it and the workflow's
    timeout counts). `priority` (-100..100, higher first; default: the
    workflow's, else 0): among due runs the claim takes the highest first.
    `concurrency_key` (a tenant, say): with @workflow(concurrency_per_key=N),
    at most N runs per key at once, the keys taken in turn. `attributes`: a
    flat dict of searchable scalars ({"tenant": "acme"}; everystep.find_runs).
    `depends_on` (runs: ids or handles): a follow-up, that starts once every
    one of them has completed, and is cancelled if one fails, stops or is
    cancelled (docs/dags.md).

    `workflow_fn` may be the workflow's name instead, `module.qualname`
    (e.g. "myapp.flows.provision_vm"), for a producer that does not import
    the workflow's code: the name's syntax and the arguments' encoding are
    checked here, the rest by the worker that runs it (docs/concepts.md,
    "Starting a run by name")."""
    name, args_json, at, after, limit = _run_args("schedule()", workflow_fn, args, idempotency_key, at, after,
                                                  deadline)
    flow = _flow_args("schedule()", workflow_fn, priority, concurrency_key)
    attributes_json = run_attributes.check("schedule(attributes=...)", attributes)
    dependencies = _dependency_ids("schedule()", depends_on)
    conn = transaction_connection(conn, "schedule()")
    queries.run(conn, _existing("schedule()", dependencies))
    with tracing.scheduling(name) as span:
        scheduled = db.insert_run(conn, uuid7(), name, args_json, idempotency_key, span.context, at, after, limit,
                                  *flow, attributes=attributes_json)
        span.scheduled(*scheduled)
    if dependencies and scheduled.created:
        queries.run(conn, dag_store.hold_for_dependencies(scheduled.id, dependencies))
    return ScheduledRun(scheduled.id, name, scheduled.created)


def _dependency_ids(caller: str, depends_on: Iterable[Any]) -> list[uuid.UUID]:
    """A follow-up's dependencies (ids or handles) as run ids, once each."""
    if isinstance(depends_on, (str, uuid.UUID)) or hasattr(depends_on, "run_id") or hasattr(depends_on, "id"):
        depends_on = [depends_on]
    runs: list[uuid.UUID] = []
    for dep in depends_on:
        run = getattr(dep, "run_id", None) or getattr(dep, "id", None) or dep
        run = _run_id(f"{caller.removesuffix('()')}(depends_on=...)", run)
        if run not in runs:
            runs.append(run)
    return runs


def _existing(caller: str, runs: list[uuid.UUID]) -> queries.Plan:
    """Refuse (EverystepError, before anything is written) a dependency that is not a run."""
    if runs:
        missing = set(runs) - (yield from dag_store.runs_exist(runs))
        if missing:
            raise EverystepError(f"{caller.removesuffix('()')}(depends_on=...): no run {sorted(missing)[0]}")


async def aschedule(workflow_fn: Callable | str, *args: Any, idempotency_key: str | None = None,
                    conn: Any = None, at: datetime.datetime | None = None,
                    after: float | datetime.timedelta | None = None,
                    deadline: float | datetime.timedelta | datetime.datetime | None = None,
                    priority: int | None = None, concurrency_key: str | None = None,
                    attributes: dict[str, Any] | None = None, depends_on: Iterable[Any] = ()) -> ScheduledRun:
    """`schedule()` for asyncio: the run is inserted in the transaction of
    `conn`, a psycopg AsyncConnection or a SQLAlchemy AsyncSession or
    AsyncConnection (else the one bound by `everystep.atransaction`)."""
    name, args_json, at, after, limit = _run_args("aschedule()", workflow_fn, args, idempotency_key, at, after,
                                                  deadline)
    flow = _flow_args("aschedule()", workflow_fn, priority, concurrency_key)
    attributes_json = run_attributes.check("aschedule(attributes=...)", attributes)
    dependencies = _dependency_ids("aschedule()", depends_on)
    aconn = await async_connection(conn, "aschedule()")
    await queries.arun(aconn, _existing("aschedule()", dependencies))
    with tracing.scheduling(name) as span:
        scheduled = await db.ainsert_run(aconn, uuid7(), name, args_json, idempotency_key, span.context, at, after,
                                         limit, *flow, attributes=attributes_json)
        span.scheduled(*scheduled)
    if dependencies and scheduled.created:
        await queries.arun(aconn, dag_store.hold_for_dependencies(scheduled.id, dependencies))
    return ScheduledRun(scheduled.id, name, scheduled.created)


def _flow_args(caller: str, workflow_fn: Callable | str, priority: Any,
               concurrency_key: Any) -> tuple[int | None, int, str | None]:
    """schedule()'s priority (None: the workflow's default), the decorator's
    default priority, and the concurrency key, checked."""
    if priority is not None:
        check_priority(f"{caller.removesuffix('()')}(priority=...)", priority)
    _check_concurrency_key(f"{caller.removesuffix('()')}(concurrency_key=...)", concurrency_key)
    return priority, _workflow_option(workflow_fn, "__everystep_priority__") or 0, concurrency_key


def _run_args(caller: str, workflow_fn: Callable | str, args: tuple, idempotency_key: str | None, at: Any,
              after: Any, deadline: Any) -> tuple[str, str, datetime.datetime | None, float | None, db.Deadline]:
    """schedule()'s checks, before anything is inserted: the workflow's name,
    the arguments as JSON, the due time, the deadline."""
    name, workflow_fn = _workflow_target(caller, workflow_fn)
    _check_key(idempotency_key)
    if at is not None and after is not None:
        raise EverystepError(f"{caller} takes at= or after=, not both")
    at = None if at is None else _aware(f"{caller.removesuffix('()')}(at=...)", at)
    after = None if after is None else _seconds(f"{caller.removesuffix('()')}(after=...)", after)
    if workflow_fn is not None:  # a name no code here defines: its worker checks the arguments
        _check_signature(caller, name, workflow_fn, args)
    limit = _deadline(f"{caller.removesuffix('()')}(deadline=...)", deadline, workflow_fn)
    return name, serde.dumps(list(args)), at, after, limit  # unserializable args refused before any insert


def _workflow_target(caller: str, workflow: Any) -> tuple[str, Callable | None]:
    """The workflow a run is scheduled of: an @workflow function, or its
    name (`module.qualname`, or `module:qualname` as the CLI takes it) for a
    producer that does not import its code. Returns the name and the
    function, None when no code in this process registered the name (then
    its arguments and options cannot be checked against it here)."""
    if isinstance(workflow, str):
        name = workflow.replace(":", ".", 1) if workflow.count(":") == 1 else workflow
        if len(name) > MAX_NAME or not _WORKFLOW_NAME.fullmatch(name):
            raise EverystepError(
                f"{caller} takes an @workflow function or the workflow's name, module.qualname "
                f"(e.g. myapp.flows.provision_vm), not {workflow!r:.80}")
        if name.startswith("__main__."):
            raise EverystepError(
                f"{caller}: {name} names a workflow of a script run as __main__, which no worker can import; "
                "name it by the module that defines it")
        return name, registry.WORKFLOWS.get(name)
    name = registry.workflow_name(workflow)
    if name is None:
        raise TypeError(f"{caller} takes an @workflow function or its name, not {workflow!r}")
    if name.startswith("__main__."):
        raise EverystepError(
            f"{caller}: {name.removeprefix('__main__.')} is defined in the script being run (__main__), a name no "
            "worker can import: define the workflow in a module (myapp/flows.py, say), import it from the script, "
            "and give the worker that module (imports:, --import)")
    return name, workflow


def _workflow_option(workflow: Any, option: str) -> Any:
    """An @workflow(...) option of the workflow scheduled (a function, or a
    name this process registered); None when not set, or not known here."""
    if isinstance(workflow, str):
        workflow = _workflow_target("schedule()", workflow)[1]
    return getattr(workflow, option, None)


# A workflow's name: a module's dotted path, then the function's qualname.
_WORKFLOW_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+")


def _deadline(what: str, deadline: Any, workflow_fn: Callable | None) -> db.Deadline:
    """A run's deadline: schedule(deadline=) (seconds from now, a timedelta
    or an aware datetime) and its workflow's timeout."""
    timeout = _workflow_option(workflow_fn, "__everystep_timeout__")
    if deadline is None:
        return db.NO_DEADLINE if timeout is None else db.Deadline(timeout=timeout)
    if isinstance(deadline, datetime.datetime):
        return db.Deadline(at=_aware(what, deadline), timeout=timeout)
    if isinstance(deadline, datetime.date):
        raise EverystepError(f"{what} takes seconds, a timedelta or an aware datetime, not the date {deadline}")
    return db.Deadline(in_=_timeout(what, deadline), timeout=timeout)


def schedule_many(workflow_fn: Callable | str, args_list: Iterable[Sequence[Any]], *,
                  idempotency_keys: Sequence[str | None] | None = None,
                  conn: Any = None, priority: int | None = None,
                  concurrency_key: str | None = None,
                  attributes: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None) -> list[ScheduledRun]:
    """Insert one run of `workflow_fn(*args)` per element of `args_list` (a
    tuple or list of positional arguments each) into the caller's
    transaction, in one statement: for bulk. The same checks as `schedule()`,
    all made before anything is inserted; `idempotency_keys`, when given, has
    one key (or None) per run; `priority` and `concurrency_key` as for
    `schedule()`, the same for every run; `attributes` one dict for every
    run, or a list of one dict (or None) per run.
    Returns the runs in input order."""
    name, args_jsons, keys = _many_args("schedule_many()", workflow_fn, args_list, idempotency_keys)
    flow = _flow_args("schedule_many()", workflow_fn, priority, concurrency_key)
    attributes_jsons = run_attributes.check_many("schedule_many(attributes=...)", attributes, len(args_jsons))
    conn = transaction_connection(conn, "schedule_many()")
    if not args_jsons:
        return []
    ids = uuid7_many(len(args_jsons))
    timeout = _workflow_option(workflow_fn, "__everystep_timeout__")
    return [ScheduledRun(run_id, name, created)
            for run_id, created in db.insert_runs(conn, name, ids, args_jsons, keys, timeout, *flow,
                                                  attributes=attributes_jsons)]


async def aschedule_many(workflow_fn: Callable | str, args_list: Iterable[Sequence[Any]], *,
                         idempotency_keys: Sequence[str | None] | None = None,
                         conn: Any = None, priority: int | None = None,
                         concurrency_key: str | None = None,
                         attributes: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
                         ) -> list[ScheduledRun]:
    """`schedule_many()` for asyncio (`conn` as for `aschedule()`)."""
    name, args_jsons, keys = _many_args("aschedule_many()", workflow_fn, args_list, idempotency_keys)
    flow = _flow_args("aschedule_many()", workflow_fn, priority, concurrency_key)
    attributes_jsons = run_attributes.check_many("aschedule_many(attributes=...)", attributes, len(args_jsons))
    aconn = await async_connection(conn, "aschedule_many()")
    if not args_jsons:
        return []
    ids = uuid7_many(len(args_jsons))
    timeout = _workflow_option(workflow_fn, "__everystep_timeout__")
    return [ScheduledRun(run_id, name, created)
            for run_id, created in await db.ainsert_runs(aconn, name, ids, args_jsons, keys, timeout, *flow,
                                                         attributes=attributes_jsons)]


def _many_args(caller: str, workflow_fn: Callable | str, args_list: Any,
               idempotency_keys: Any) -> tuple[str, list[str], list[str | None]]:
    """schedule_many()'s checks: the workflow's name, each run's arguments as JSON, its key."""
    name, workflow_fn = _workflow_target(caller, workflow_fn)
    if isinstance(args_list, (str, bytes)) or not isinstance(args_list, Iterable):
        raise EverystepError(f"{caller} takes a list of argument tuples, one per run")
    args_list = list(args_list)
    args_jsons = []
    arities = set()  # positional arguments fit or not by their count alone: each count checked once
    for position, args in enumerate(args_list):
        if not isinstance(args, (tuple, list)):
            raise EverystepError(
                f"{caller}: run {position} has arguments {args!r:.60}; each must be a tuple or list "
                "of positional arguments, e.g. [(1,), (2,)]"
            )
        if workflow_fn is not None and len(args) not in arities:
            _check_signature(f"{caller} run {position}", name, workflow_fn, args)
            arities.add(len(args))
        args_jsons.append(serde.dumps(list(args)))
    if idempotency_keys is None:
        return name, args_jsons, [None] * len(args_list)
    if isinstance(idempotency_keys, (str, bytes)):
        raise EverystepError("idempotency_keys must be a list with one key (or None) per run")
    keys = list(idempotency_keys)
    if len(keys) != len(args_list):
        raise EverystepError(
            f"idempotency_keys has {len(keys)} keys for {len(args_list)} runs; give one key (or None) per run"
        )
    for key in keys:
        _check_key(key)
    return name, args_jsons, keys


def _check_key(idempotency_key: str | None) -> None:
    if idempotency_key is not None and (not isinstance(idempotency_key, str) or len(idempotency_key) > MAX_KEY):
        raise EverystepError(f"idempotency_key must be a string of at most {MAX_KEY} characters")


def _aware(what: str, when: Any) -> datetime.datetime:
    if not isinstance(when, datetime.datetime):
        raise EverystepError(f"{what} takes a datetime with a timezone, not {when!r}")
    if when.tzinfo is None or when.utcoffset() is None:
        raise EverystepError(f"{what} takes a datetime with a timezone (an aware datetime), not the naive {when}")
    return when


def _timeout(what: str, timeout: Any) -> float:
    """A timeout option: a finite number of seconds > 0, or a timedelta."""
    try:
        seconds = _seconds(what, timeout)
    except EverystepError:
        seconds = 0.0
    if seconds <= 0:
        raise EverystepError(f"{what} takes a number of seconds > 0 or a timedelta, not {timeout!r}")
    return seconds


def _seconds(what: str, delay: Any) -> float:
    if isinstance(delay, datetime.timedelta):
        delay = delay.total_seconds()
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay) or delay < 0:
        raise EverystepError(f"{what} takes a number of seconds >= 0 or a timedelta, not {delay!r}")
    return float(delay)


# ---------------------------------------------------------------- time and control

def sleep(seconds: float | datetime.timedelta) -> Any:
    """Inside a workflow body: a durable sleep, recorded like a step. Until
    the time comes the run is `waiting` and holds no worker slot (a wait of
    a moment is waited where the run is); a replay after the time returns at
    once. In an async workflow: `await everystep.sleep(...)`. Outside a
    workflow: time.sleep."""
    seconds = _seconds("sleep()", seconds)
    scope = current_scope.get()
    if scope is None:
        time.sleep(seconds)
        return None
    return scope.run.replay.sleep(scope, seconds, None)


def sleep_until(when: datetime.datetime) -> Any:
    """Like `sleep`, until an aware datetime (by the database's clock)."""
    when = _aware("sleep_until()", when)
    scope = current_scope.get()
    if scope is None:
        time.sleep(max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds()))
        return None
    return scope.run.replay.sleep(scope, None, when)


# ---------------------------------------------------------------- messages and events

def _run_id(what: str, run_id: Any) -> uuid.UUID:
    try:
        return run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise EverystepError(f"{what} takes a run id, not {run_id!r}") from None


def _name(what: str, kind: str, text: Any) -> str:
    if not isinstance(text, str) or not 1 <= len(text) <= MAX_KEY:
        raise EverystepError(f"{what} takes a {kind} of 1 to {MAX_KEY} characters, not {text!r}")
    return text


def _in_body(what: str) -> Any:
    scope = current_scope.get()
    if scope is None:
        raise EverystepError(f"{what} can only be called in a workflow body (not outside a run, nor inside a step)")
    return scope


def send(run_id: uuid.UUID | str, topic: str, payload: Any = None, idempotency_key: str | None = None,
         conn: Any = None) -> bool:
    """Send a message to a run, in the caller's transaction (like
    `schedule()`): the run sees it only if the transaction commits. Its
    `everystep.wait_for(topic)` returns it; one sent before the wait is
    reached is kept for it. With an idempotency key, the same key sends once
    per run. Returns True if this call stored the message, False if the key
    had sent it already. An unknown or finished run, or a payload that
    cannot be stored, is an EverystepError with nothing written."""
    run_id, topic, payload_json = _message_args("send()", run_id, topic, payload, idempotency_key)
    conn = transaction_connection(conn, "send()")
    return _sent("send()", run_id, db.send_message(conn, run_id, topic, payload_json, idempotency_key))


async def asend(run_id: uuid.UUID | str, topic: str, payload: Any = None, idempotency_key: str | None = None,
                conn: Any = None) -> bool:
    """`send()` for asyncio (`conn` as for `aschedule()`)."""
    run_id, topic, payload_json = _message_args("asend()", run_id, topic, payload, idempotency_key)
    aconn = await async_connection(conn, "asend()")
    return _sent("asend()", run_id, await db.asend_message(aconn, run_id, topic, payload_json, idempotency_key))


def _message_args(caller: str, run_id: Any, topic: Any, payload: Any, idempotency_key: Any) -> tuple:
    run_id = _run_id(caller, run_id)
    topic = _name(caller, "topic", topic)
    if idempotency_key is not None:
        _name(caller, "idempotency_key", idempotency_key)
    return run_id, topic, serde.dumps(payload)  # refuse what cannot be stored before any write


def _sent(caller: str, run_id: uuid.UUID, sent: db.Sent) -> bool:
    if sent.status is None:
        raise EverystepError(f"{caller}: no run {run_id}")
    if sent.status in db.TERMINAL:
        raise EverystepError(f"{caller}: run {run_id} is {sent.status}; it takes no more messages")
    return sent.created


def wait_for(topic: str, timeout: float | datetime.timedelta | None = None) -> Any:
    """In a workflow body: the next message sent to this run on `topic`
    (`everystep.send`), or None once `timeout` seconds have passed since the
    run first reached this call. Recorded like a step: each message is
    consumed by exactly one wait, and a replay returns the same messages in
    the same order. While it waits the run is parked (`waiting`) without a
    worker slot, and is claimed again when a message arrives or the timeout
    passes."""
    topic = _name("wait_for()", "topic", topic)
    if timeout is not None:
        timeout = _seconds("wait_for()", timeout)
    scope = _in_body("wait_for()")
    return scope.run.replay.wait_for(scope, topic, timeout)


def set_event(key: str, value: Any) -> Any:
    """In a workflow body: publish `value` under `key` for the outside to read
    with `everystep.get_event` (the last value set wins). Recorded like a
    step: a replay does not write it again. In an async workflow: `await
    everystep.set_event(...)`."""
    key = _name("set_event()", "key", key)
    value_json = serde.dumps(value)
    scope = _in_body("set_event()")
    return scope.run.replay.set_event(scope, key, value_json)


def set_attributes(attributes: dict[str, Any]) -> Any:
    """In a workflow body: add or change the run's searchable attributes
    (as schedule(attributes=) takes them; at most 20 in all). Recorded like a
    step: a replay does not write them again. In an async workflow: `await
    everystep.set_attributes(...)`."""
    attributes_json = run_attributes.check("set_attributes()", attributes)
    if attributes_json is None:
        raise EverystepError("set_attributes() takes a non-empty dict, e.g. {'tenant': 'acme'}")
    scope = _in_body("set_attributes()")
    return scope.run.replay.set_attributes(scope, attributes_json)


def get_event(run_id: uuid.UUID | str, key: str, timeout: float | datetime.timedelta | None = None,
              conn: Any = None) -> Any:
    """The value a run published under `key` (`everystep.set_event`),
    waiting up to `timeout` seconds for it (None: until it is set or the run
    ends); None if it is not set by then. Reads with `conn` (or the bound
    connection), outside any transaction it is in being a problem: each look
    is its own statement. An unknown run is an EverystepError."""
    run_id, key = _run_id("get_event()", run_id), _name("get_event()", "key", key)
    looks = _Looks("get_event()", timeout)
    conn = _reading(conn, "get_event()")
    while True:
        found = _event("get_event()", run_id, db.get_event(conn, run_id, key))
        pause = None if found is not None else looks.pause()
        if pause is None:
            return None if found is None else found.value
        time.sleep(pause)


async def aget_event(run_id: uuid.UUID | str, key: str, timeout: float | datetime.timedelta | None = None,
                     conn: Any = None) -> Any:
    """`get_event()` for asyncio (`conn`: an AsyncConnection, a SQLAlchemy
    AsyncSession or AsyncConnection, or the one bound)."""
    run_id, key = _run_id("aget_event()", run_id), _name("aget_event()", "key", key)
    looks = _Looks("aget_event()", timeout)
    aconn = await async_connection(conn, "aget_event()", write=False)
    while True:
        found = _event("aget_event()", run_id, await db.aget_event(aconn, run_id, key))
        pause = None if found is not None else looks.pause()
        if pause is None:
            return None if found is None else found.value
        await asyncio.sleep(pause)


class _Found(NamedTuple):
    value: Any


def _event(caller: str, run_id: uuid.UUID, event: db.EventValue) -> _Found | None:
    """What a look at an event found: its value (None once it can never be set); None: look again."""
    if event.status is None:
        raise EverystepError(f"{caller}: no run {run_id}")
    if event.found:
        return _Found(serde.from_json(event.value))
    if event.status in db.TERMINAL:
        return _Found(None)  # it can never be set now
    return None


# ---------------------------------------------------------------- child workflows

class ChildHandle:
    """What `everystep.start` returns: the child run's id, and `result()`."""

    __slots__ = ("id", "name")

    def __init__(self, id: uuid.UUID, name: str):
        self.id = id
        self.name = name

    def result(self, timeout: float | datetime.timedelta | None = None) -> Any:
        """In the parent's body: wait until the child run ends and return its
        result, or raise ChildFailed (it failed — `.error` is its error — was
        stopped, or was cancelled), or TimeoutError after `timeout` seconds.
        Recorded like a step; meanwhile the parent is parked without a slot
        and the child's end wakes it. In an async workflow: `await
        handle.result()`."""
        if timeout is not None:
            timeout = _seconds("result()", timeout)
        scope = _in_body("result()")
        return scope.run.replay.child_result(scope, self.id, timeout)

    def __repr__(self) -> str:
        return f"<ChildHandle {self.id} {self.name}>"


def start(child_workflow: Callable, *args: Any) -> Any:
    """In a workflow body: schedule a child run of `child_workflow(*args)`,
    once (recorded like a step: a replay returns the same handle), and
    return its ChildHandle (in an async workflow: `await everystep.start(...)`).
    Cancelling the parent cancels its unfinished children."""
    name, args_json = _child("start()", child_workflow, args)
    scope = _in_body("start()")
    started = scope.run.replay.start_child(scope, name, args_json)
    if scope.run.replay.asynchronous:
        return _handle(started, name)
    return ChildHandle(started, name)


@aio.own_scope
async def _handle(started: Awaitable[uuid.UUID], name: str) -> ChildHandle:
    return ChildHandle(await started, name)


def call(child_workflow: Callable, *args: Any) -> Any:
    """`start(child_workflow, *args).result()`: run a child workflow and wait
    for its result (in an async workflow: `await everystep.call(...)`)."""
    name, args_json = _child("call()", child_workflow, args)
    scope = _in_body("call()")
    return scope.run.replay.call_child(scope, name, args_json)


def _child(what: str, child_workflow: Callable, args: tuple) -> tuple[str, str]:
    name = registry.workflow_name(child_workflow)
    if name is None:
        raise TypeError(f"{what} takes an @workflow function, not {child_workflow!r}")
    return name, serde.dumps(list(args))


def cancel(run_id: uuid.UUID | str, reason: str | None = None, conn: Any = None) -> str:
    """Cancel a run, in the caller's transaction (like `schedule()`). A
    scheduled, waiting or blocked run is `cancelled` at once; a running one
    is asked to stop: its body gets `Cancelled` at its next step call (a
    running async step is cancelled at its next await) and the run ends
    `cancelled`. Returns the run's status after the call: `cancelled`,
    `running` (the request is recorded), or the end it had already reached
    (nothing changed). Raises EverystepError for an unknown run."""
    run_id = _cancel_args("cancel()", run_id, reason)
    conn = transaction_connection(conn, "cancel()")
    return _cancelled(run_id, db.cancel_run(conn, run_id, reason))


async def acancel(run_id: uuid.UUID | str, reason: str | None = None, conn: Any = None) -> str:
    """`cancel()` for asyncio (`conn` as for `aschedule()`)."""
    run_id = _cancel_args("acancel()", run_id, reason)
    aconn = await async_connection(conn, "acancel()")
    return _cancelled(run_id, await db.acancel_run(aconn, run_id, reason))


def _cancel_args(caller: str, run_id: Any, reason: Any) -> uuid.UUID:
    if reason is not None and not isinstance(reason, str):
        raise EverystepError(f"{caller} takes a reason string, not {reason!r}")
    return _run_id(caller, run_id)


def _cancelled(run_id: uuid.UUID, outcome: db.CancelOutcome) -> str:
    if outcome.status is None:
        raise EverystepError(f"no run {run_id}")
    return outcome.status


# ---------------------------------------------------------------- operators

_UNSET: Any = object()


def resolve_step(conn: psycopg.Connection, run_id: uuid.UUID | str, step_id: str, *, result: Any = _UNSET,
                 error: str | None = None, discard: bool = False) -> None:
    """Resolve the `started` step of a blocked run, and put the run back to
    `scheduled`. Exactly one of: `result=` (the effect happened; record this
    result), `error=` (it happened and failed with this message), or
    `discard=True` (it did not happen; delete the started row)."""
    if (result is not _UNSET) + (error is not None) + bool(discard) != 1:
        raise EverystepError("resolve_step takes exactly one of result=, error= or discard=True")
    run_id = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(run_id)
    if discard:
        status, result_json, error_json = None, None, None
    elif error is not None:
        failure = StepFailure(error, type="everystep.errors.StepFailure", args=[error])
        status, result_json, error_json = StepStatus.FAILED, None, serde.dumps(serde.encode_exception(failure))
    else:
        status, result_json, error_json = StepStatus.DONE, serde.dumps(result), None
    try:
        db.resolve_step(conn, run_id, step_id, status, result_json, error_json)
    except db.ResolveRefused as refused:
        raise EverystepError(str(refused)) from None


def rerun(run_id: uuid.UUID | str, from_step: str, conn: Any = None) -> uuid.UUID:
    """Schedule a new run of the same workflow and args as the ended run
    `run_id`, with the recorded outcomes of the steps before `from_step`
    copied (replay serves them: only `from_step` and what follows execute),
    in the caller's transaction (like `schedule()`); returns the new run's
    id. The new run's `rerun_of` is `run_id`, which keeps its row and steps.
    Audited (action `rerun`, source `api`). Raises EverystepError, writing
    nothing, for an unknown run or step, a run still in flight, and an
    unsafe step before `from_step` whose outcome is unknown. See
    everystep.reruns for which steps are "before"."""
    run_id = _run_id("rerun()", run_id)
    conn = transaction_connection(conn, "rerun()")
    return reruns.rerun_in(conn, run_id, from_step, _local_actor(), "api")[0]


def _local_actor() -> str:
    """Who calls, for the audit trail: the process's user on this host."""
    import os  # noqa: PLC0415
    import socket  # noqa: PLC0415

    return f"{os.environ.get('USER') or os.getuid()}@{socket.gethostname()}"
