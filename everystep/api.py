"""The public API: @workflow, @step, parallel, schedule. Thin; the SQL is in
`db`, the replay in `runner`."""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar, overload

import psycopg

from everystep import db, registry, serde, tracing
from everystep.context import SEGMENT, current_scope, run_branches
from everystep.errors import EverystepError, StepFailure
from everystep.ids import uuid7, uuid7_many
from everystep.retries import Backoff, RetryPolicy
from everystep.schema import MAX_KEY, MAX_NAME, StepStatus

F = TypeVar("F", bound=Callable[..., Any])


@overload
def workflow(fn: F) -> F: ...
@overload
def workflow(*, concurrency: int | None = None) -> Callable[[F], F]: ...


def workflow(fn: Callable | None = None, *, concurrency: int | None = None) -> Any:
    """Mark a function as a workflow, registered under `module.qualname`.
    Called directly, it is a plain function call. `concurrency=N`: at most N
    runs of it running at once across every worker sharing the database (the
    config's `workflows: {name: {concurrency: ...}}` overrides it)."""
    if concurrency is not None and (type(concurrency) is not int or concurrency < 1):
        raise EverystepError(f"concurrency must be a whole number >= 1 or None, got {concurrency!r}")
    if fn is None:
        return functools.partial(workflow, concurrency=concurrency)
    fn.__everystep_concurrency__ = concurrency  # type: ignore[attr-defined]
    registry.register(fn)
    return fn


@overload
def step(fn: F) -> F: ...
@overload
def step(*, unsafe_to_repeat: bool = False, retries: int = 0, backoff: float | Backoff | None = None,
         retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None) -> Callable[[F], F]: ...


def step(fn: Callable | None = None, *, unsafe_to_repeat: bool = False, retries: int = 0,
         backoff: float | Backoff | None = None,
         retry_on: type[BaseException] | tuple[type[BaseException], ...] | None = None) -> Any:
    """Mark a unit of durable work. Inside a running workflow each call is
    recorded (or served from the record on replay); outside, a plain call.

    `retries=N`: up to N further attempts after a failed one, waiting
    `backoff` between them (a Backoff, or a number: its initial wait in
    seconds; default Backoff(): 1 s doubling up to 300 s, 20% jitter).
    `retry_on`: the exception types retried (default: every Exception; an
    unsafe_to_repeat step is retried only on the types listed here)."""
    retry = _retry_policy(retries, backoff, retry_on)
    if fn is None:
        return functools.partial(step, unsafe_to_repeat=unsafe_to_repeat, retries=retries, backoff=backoff,
                                 retry_on=retry_on)
    name = registry.qualified_name(fn)
    if len(name) > MAX_NAME:
        raise EverystepError(f"step name {name[:60]}... is longer than {MAX_NAME} characters")

    @functools.wraps(fn)
    def call(*args: Any, everystep_id: str | None = None, **kwargs: Any) -> Any:
        scope = current_scope.get()
        if scope is None:
            return fn(*args, **kwargs)
        return scope.run.replay.step(scope, fn, name, unsafe_to_repeat, args, kwargs, everystep_id, retry)

    call.__everystep_step__ = name  # type: ignore[attr-defined]
    call.unsafe_to_repeat = unsafe_to_repeat  # type: ignore[attr-defined]
    call.retry = retry  # type: ignore[attr-defined]
    return call


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
    as is, several as an ExceptionGroup."""
    scope = current_scope.get()
    if scope is None:
        return run_branches(branches, None)
    return scope.run.replay.fork(scope, branches, everystep_id)


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
    """What `schedule()` returns: the run's id and whether this call created it."""

    __slots__ = ("id", "name", "created")

    def __init__(self, id: uuid.UUID, name: str, created: bool):
        self.id = id
        self.name = name
        self.created = created

    def __repr__(self) -> str:
        return f"<ScheduledRun {self.id} {self.name}{'' if self.created else ' (existing)'}>"


_bound: ContextVar[psycopg.Connection | None] = ContextVar("everystep_connection", default=None)


@contextlib.contextmanager
def use(conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """Bind `conn` as the connection `schedule()` writes into, in this context."""
    token = _bound.set(conn)
    try:
        yield conn
    finally:
        _bound.reset(token)


@contextlib.contextmanager
def transaction(conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """Open a transaction on `conn` and bind it for `schedule()`: the runs are
    scheduled when the block commits, and vanish if it rolls back."""
    with conn.transaction(), use(conn):
        yield conn


def schedule(workflow_fn: Callable, *args: Any, idempotency_key: str | None = None,
             conn: psycopg.Connection | None = None, at: datetime.datetime | None = None,
             after: float | datetime.timedelta | None = None) -> ScheduledRun:
    """Insert a run of `workflow_fn(*args)` into the caller's transaction.
    Nothing runs now; workers claim the run once the transaction commits,
    and not before `at` (an aware datetime) or `after` seconds (or a
    timedelta) from now, by the database's clock."""
    name = registry.workflow_name(workflow_fn)
    if name is None:
        raise TypeError(f"schedule() takes an @workflow function, not {workflow_fn!r}")
    _check_key(idempotency_key)
    if at is not None and after is not None:
        raise EverystepError("schedule() takes at= or after=, not both")
    at = None if at is None else _aware("schedule(at=...)", at)
    after = None if after is None else _seconds("schedule(after=...)", after)
    args_json = serde.dumps(list(args))  # refuse unserializable args before any insert
    conn = transaction_connection(conn, "schedule()")
    run_id, created = tracing.traced_schedule(
        name, lambda trace_context: db.insert_run(conn, uuid7(), name, args_json, idempotency_key,
                                                       trace_context, at, after))
    return ScheduledRun(run_id, name, created)


def schedule_many(workflow_fn: Callable, args_list: Iterable[Sequence[Any]], *,
                  idempotency_keys: Sequence[str | None] | None = None,
                  conn: psycopg.Connection | None = None) -> list[ScheduledRun]:
    """Insert one run of `workflow_fn(*args)` per element of `args_list` (a
    tuple or list of positional arguments each) into the caller's
    transaction, in one statement: for bulk. The same checks as `schedule()`,
    all made before anything is inserted; `idempotency_keys`, when given, has
    one key (or None) per run. Returns the runs in input order."""
    name = registry.workflow_name(workflow_fn)
    if name is None:
        raise TypeError(f"schedule_many() takes an @workflow function, not {workflow_fn!r}")
    if isinstance(args_list, (str, bytes)) or not isinstance(args_list, Iterable):
        raise EverystepError("schedule_many() takes a list of argument tuples, one per run")
    args_list = list(args_list)
    args_jsons = []
    for position, args in enumerate(args_list):
        if not isinstance(args, (tuple, list)):
            raise EverystepError(
                f"schedule_many(): run {position} has arguments {args!r:.60}; each must be a tuple or list "
                "of positional arguments, e.g. [(1,), (2,)]"
            )
        args_jsons.append(serde.dumps(list(args)))
    if idempotency_keys is None:
        keys: list[str | None] = [None] * len(args_list)
    else:
        if isinstance(idempotency_keys, (str, bytes)):
            raise EverystepError("idempotency_keys must be a list with one key (or None) per run")
        keys = list(idempotency_keys)
        if len(keys) != len(args_list):
            raise EverystepError(
                f"idempotency_keys has {len(keys)} keys for {len(args_list)} runs; give one key (or None) per run"
            )
        for key in keys:
            _check_key(key)
    conn = transaction_connection(conn, "schedule_many()")
    if not args_list:
        return []
    ids = uuid7_many(len(args_list))
    return [ScheduledRun(run_id, name, created)
            for run_id, created in db.insert_runs(conn, name, ids, args_jsons, keys)]


def _check_key(idempotency_key: str | None) -> None:
    if idempotency_key is not None and (not isinstance(idempotency_key, str) or len(idempotency_key) > MAX_KEY):
        raise EverystepError(f"idempotency_key must be a string of at most {MAX_KEY} characters")


def transaction_connection(conn: psycopg.Connection | None, caller: str, write: bool = True) -> Any:
    """The connection `caller` works in: `conn`, else the one bound by
    everystep.transaction/use, else Django's. One that writes needs an open
    transaction, so what it writes commits or rolls back with the caller's work."""
    conn = conn or _bound.get() or _django_connection()
    if conn is None:
        raise EverystepError(
            f"{caller} found no transaction: pass conn=<psycopg connection>, bind one with "
            "`with everystep.transaction(conn):` or `everystep.use(conn)`, or configure Django"
        )
    if write and isinstance(conn, psycopg.Connection):
        if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            raise EverystepError(
                f"{caller} needs an open transaction: this connection is in autocommit mode outside "
                "a transaction block; use `with everystep.transaction(conn):` or `with conn.transaction():`"
            )
    return conn


def _aware(what: str, when: Any) -> datetime.datetime:
    if not isinstance(when, datetime.datetime):
        raise EverystepError(f"{what} takes a datetime with a timezone, not {when!r}")
    if when.tzinfo is None or when.utcoffset() is None:
        raise EverystepError(f"{what} takes a datetime with a timezone (an aware datetime), not the naive {when}")
    return when


def _seconds(what: str, delay: Any) -> float:
    if isinstance(delay, datetime.timedelta):
        delay = delay.total_seconds()
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay) or delay < 0:
        raise EverystepError(f"{what} takes a number of seconds >= 0 or a timedelta, not {delay!r}")
    return float(delay)


# ---------------------------------------------------------------- time and control

def sleep(seconds: float | datetime.timedelta) -> None:
    """Inside a workflow body: a durable sleep, recorded like a step. Until
    the time comes the run is `waiting` and holds no worker slot (a wait of
    a moment is waited on the thread); a replay after the time returns at
    once. Outside a workflow: time.sleep."""
    seconds = _seconds("sleep()", seconds)
    scope = current_scope.get()
    if scope is None:
        time.sleep(seconds)
        return
    scope.run.replay.sleep(scope, seconds, None)


def sleep_until(when: datetime.datetime) -> None:
    """Like `sleep`, until an aware datetime (by the database's clock)."""
    when = _aware("sleep_until()", when)
    scope = current_scope.get()
    if scope is None:
        time.sleep(max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds()))
        return
    scope.run.replay.sleep(scope, None, when)


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
         conn: psycopg.Connection | None = None) -> bool:
    """Send a message to a run, in the caller's transaction (like
    `schedule()`): the run sees it only if the transaction commits. Its
    `everystep.wait_for(topic)` returns it; one sent before the wait is
    reached is kept for it. With an idempotency key, the same key sends once
    per run. Returns True if this call stored the message, False if the key
    had sent it already. An unknown or finished run, or a payload that
    cannot be stored, is an EverystepError with nothing written."""
    run_id = _run_id("send()", run_id)
    topic = _name("send()", "topic", topic)
    if idempotency_key is not None:
        _name("send()", "idempotency_key", idempotency_key)
    payload_json = serde.dumps(payload)  # refuse what cannot be stored before any write
    conn = transaction_connection(conn, "send()")
    sent = db.send_message(conn, run_id, topic, payload_json, idempotency_key)
    if sent.status is None:
        raise EverystepError(f"send(): no run {run_id}")
    if sent.status in db.TERMINAL:
        raise EverystepError(f"send(): run {run_id} is {sent.status}; it takes no more messages")
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


def set_event(key: str, value: Any) -> None:
    """In a workflow body: publish `value` under `key` for the outside to read
    with `everystep.get_event` (the last value set wins). Recorded like a
    step: a replay does not write it again."""
    key = _name("set_event()", "key", key)
    value_json = serde.dumps(value)
    scope = _in_body("set_event()")
    scope.run.replay.set_event(scope, key, value_json)


def get_event(run_id: uuid.UUID | str, key: str, timeout: float | datetime.timedelta | None = None,
              conn: psycopg.Connection | None = None) -> Any:
    """The value a run published under `key` (`everystep.set_event`),
    waiting up to `timeout` seconds for it (None: until it is set or the run
    ends); None if it is not set by then. Reads with `conn` (or the bound
    connection), outside any transaction it is in being a problem: each look
    is its own statement. An unknown run is an EverystepError."""
    run_id = _run_id("get_event()", run_id)
    key = _name("get_event()", "key", key)
    limit = None if timeout is None else time.monotonic() + _seconds("get_event()", timeout)
    conn = conn or _bound.get()
    if conn is None:
        raise EverystepError("get_event() needs a connection: pass conn=<psycopg connection> or bind one "
                             "with `everystep.use(conn)`")
    pause = 0.02
    while True:
        status, found, value = db.get_event(conn, run_id, key)
        if status is None:
            raise EverystepError(f"get_event(): no run {run_id}")
        if found:
            return serde.from_json(value)
        if status in db.TERMINAL:
            return None  # it can never be set now
        left = None if limit is None else limit - time.monotonic()
        if left is not None and left <= 0:
            return None
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, 0.5)


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
        and the child's end wakes it."""
        if timeout is not None:
            timeout = _seconds("result()", timeout)
        scope = _in_body("result()")
        return scope.run.replay.child_result(scope, self.id, timeout)

    def __repr__(self) -> str:
        return f"<ChildHandle {self.id} {self.name}>"


def start(child_workflow: Callable, *args: Any) -> ChildHandle:
    """In a workflow body: schedule a child run of `child_workflow(*args)`,
    once (recorded like a step: a replay returns the same handle). Cancelling
    the parent cancels its unfinished children."""
    name = registry.workflow_name(child_workflow)
    if name is None:
        raise TypeError(f"start() takes an @workflow function, not {child_workflow!r}")
    args_json = serde.dumps(list(args))
    scope = _in_body("start()")
    return ChildHandle(scope.run.replay.start_child(scope, name, args_json), name)


def call(child_workflow: Callable, *args: Any) -> Any:
    """`start(child_workflow, *args).result()`: run a child workflow and wait for its result."""
    return start(child_workflow, *args).result()


def cancel(run_id: uuid.UUID | str, reason: str | None = None, conn: psycopg.Connection | None = None) -> str:
    """Cancel a run, in the caller's transaction (like `schedule()`). A
    scheduled, waiting or blocked run is `cancelled` at once; a running one
    is asked to stop: its body gets `Cancelled` at its next step call and the
    run ends `cancelled`. Returns the run's status after the call: `cancelled`,
    `running` (the request is recorded), or the end it had already reached
    (nothing changed). Raises EverystepError for an unknown run."""
    if reason is not None and not isinstance(reason, str):
        raise EverystepError(f"cancel() takes a reason string, not {reason!r}")
    try:
        run_id = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise EverystepError(f"cancel() takes a run id, not {run_id!r}") from None
    conn = transaction_connection(conn, "cancel()")
    outcome = db.cancel_run(conn, run_id, reason)
    if outcome.status is None:
        raise EverystepError(f"no run {run_id}")
    return outcome.status


def _django_connection() -> Any:
    """Django's connection, when Django is installed and configured."""
    try:
        from django.conf import settings  # noqa: PLC0415  (optional integration)
        from django.db import connection  # noqa: PLC0415
    except ImportError:
        return None
    if not settings.configured:
        return None
    return _DjangoCursorConnection(connection)


class _DjangoCursorConnection:
    """Adapts Django's connection to the `execute(...).fetchone()` calls of everystep.db."""

    def __init__(self, connection: Any):
        self.connection = connection

    def execute(self, query: str, params: Any = None) -> Any:
        cursor = self.connection.cursor()
        cursor.execute(query, params)
        return cursor


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
