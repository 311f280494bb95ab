"""The public API: @workflow, @step, parallel, schedule. Thin; the SQL is in
`store`, the replay in `runner`."""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar, overload

import psycopg

from everystep import registry, serde, store, tracing
from everystep.context import current_scope, run_branches
from everystep.errors import EverystepError, StepFailure
from everystep.ids import uuid7, uuid7_many

F = TypeVar("F", bound=Callable[..., Any])


def workflow(fn: F) -> F:
    """Mark a function as a workflow, registered under `module.qualname`.
    Called directly, it is a plain function call."""
    registry.register(fn)
    return fn


@overload
def step(fn: F) -> F: ...
@overload
def step(*, unsafe_to_repeat: bool = False) -> Callable[[F], F]: ...


def step(fn: Callable | None = None, *, unsafe_to_repeat: bool = False) -> Any:
    """Mark a unit of durable work. Inside a running workflow each call is
    recorded (or served from the record on replay); outside, a plain call."""
    if fn is None:
        return functools.partial(step, unsafe_to_repeat=unsafe_to_repeat)
    name = registry.qualified_name(fn)
    if len(name) > registry.MAX_NAME:
        raise EverystepError(f"step name {name[:60]}... is longer than {registry.MAX_NAME} characters")

    @functools.wraps(fn)
    def call(*args: Any, everystep_id: str | None = None, **kwargs: Any) -> Any:
        scope = current_scope.get()
        if scope is None:
            return fn(*args, **kwargs)
        return scope.run.replay.step(scope, fn, name, unsafe_to_repeat, args, kwargs, everystep_id)

    call.__everystep_step__ = name  # type: ignore[attr-defined]
    call.unsafe_to_repeat = unsafe_to_repeat  # type: ignore[attr-defined]
    return call


def parallel(*branches: Callable[[], Any] | list[Callable[[], Any]], everystep_id: str | None = None) -> tuple:
    """Run zero-argument callables concurrently and return their results in
    branch order. A list of callables is a sequence branch: run in order,
    returning a tuple. All branches run to completion; one failure is raised
    as is, several as an ExceptionGroup."""
    scope = current_scope.get()
    if scope is None:
        return run_branches(branches, None)
    return scope.run.replay.fork(scope, branches, everystep_id)


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
             conn: psycopg.Connection | None = None) -> ScheduledRun:
    """Insert a run of `workflow_fn(*args)` into the caller's transaction.
    Nothing runs now; workers claim the run once the transaction commits."""
    name = registry.workflow_name(workflow_fn)
    if name is None:
        raise TypeError(f"schedule() takes an @workflow function, not {workflow_fn!r}")
    _check_key(idempotency_key)
    args_json = serde.dumps(list(args))  # refuse unserializable args before any insert
    conn = transaction_connection(conn, "schedule()")
    run_id, created = tracing.traced_schedule(
        name, lambda trace_context: store.insert_run(conn, uuid7(), name, args_json, idempotency_key, trace_context))
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
            for run_id, created in store.insert_runs(conn, name, ids, args_jsons, keys)]


def _check_key(idempotency_key: str | None) -> None:
    if idempotency_key is not None and (not isinstance(idempotency_key, str) or len(idempotency_key) > 255):
        raise EverystepError("idempotency_key must be a string of at most 255 characters")


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
    """Adapts Django's connection to the `execute(...).fetchone()` calls of store."""

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
        status, result_json, error_json = "failed", None, serde.dumps(serde.encode_exception(failure))
    else:
        status, result_json, error_json = "done", serde.dumps(result), None
    try:
        store.resolve_step(conn, run_id, step_id, status, result_json, error_json)
    except store.ResolveRefused as refused:
        raise EverystepError(str(refused)) from None
