"""Sealed workflows: declared graphs of runs that start as their
dependencies complete (docs/dags.md).

    from everystep import dags

    with everystep.transaction(conn):
        wave = dags.create("publish-wave:2026-08-02", workflows=("myapp.publishing.*",), actor="api")
        prep = wave.add(prepare, {"article_id": "a-123"}, key="prepare")
        wave.add(publish, {"article_id": "a-123"}, key="publish", depends_on=[prep])
        wave.seal(actor="api")

A member is an ordinary run of a @workflow, created `waiting` on its
dependencies (waiting_on 'dependencies', due 9999-12-31: the end of time
that drivers can read, as 'infinity' is not): no claim sees it.
It is released (due at once) in the transaction that ends its last
dependency, or by the seal when it depends on nothing; a dependency that
ends failed, stopped or cancelled cancels it (everystep_settle,
0031_dags.sql). Follow-ups outside any graph: schedule(fn, *args,
depends_on=[run, ...]).

From asyncio: `await dags.acreate(...)`, `await wave.aadd(...)`, `await
wave.aseal()`, aget, acancel, arerun: the same checks and statements (the
plans of everystep.db.dags), in an AsyncConnection's transaction.
"""

from __future__ import annotations

import fnmatch
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psycopg

from everystep import api, db, registry, reruns, serde
from everystep.connections import async_connection, transaction_connection
from everystep.context import current
from everystep.db import dags as store
from everystep.db import queries
from everystep.db.queries import Plan
from everystep.errors import EverystepError
from everystep.ids import uuid7
from everystep.schema import MAX_KEY, TERMINAL, RunStatus, StepStatus

STATUSES = ("open", "running", "completed", "failed", "cancelled")


class DagError(EverystepError):
    """A graph refused what was asked of it; nothing was written."""


class DagNotFound(DagError):
    """No graph has this key (or it has no such member)."""


class DagSealed(DagError):
    """The graph is sealed (or cancelled): nothing can be added, it cannot be sealed again."""


class DependencyError(DagError):
    """A dependency that is not an earlier member of the graph (or, for a follow-up, not a run)."""


@dataclass(frozen=True)
class Member:
    """A member as added: its key in its graph and its run."""
    dag: str
    key: str
    run_id: uuid.UUID


@dataclass(frozen=True)
class MemberState:
    run_id: uuid.UUID
    status: str | None  # the run's status (None: the run was pruned)
    depends_on: tuple[str, ...]  # member keys
    cancel_reason: str | None = None


@dataclass(frozen=True)
class DagState:
    key: str
    status: str  # open running completed failed cancelled
    members: dict[str, MemberState]  # by key, in the order they were added
    workflows: tuple[str, ...] | None
    created_at: Any
    sealed_at: Any
    sealed_by: str | None
    cancelled_at: Any


def _check_key(what: str, key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise DagError(f"{what} must be a non-empty string, not {key!r}")
    if len(key) > MAX_KEY:
        raise DagError(f"{what} is {len(key)} characters long; at most {MAX_KEY}")
    return key


def _patterns(workflows: Any) -> list[str] | None:
    if workflows is None:
        return None
    if isinstance(workflows, str):
        workflows = (workflows,)
    patterns = list(workflows)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise DagError(f"workflows= takes module.qualname patterns (* and ?), not {workflows!r}")
    return patterns


class Dag:
    """A graph by its key: add members while it is open, then seal it."""

    def __init__(self, key: str, workflows: list[str] | None, conn: Any = None):
        self.key = key
        self.workflows = None if workflows is None else tuple(workflows)
        self._conn = conn

    def __repr__(self) -> str:
        return f"<Dag {self.key}>"

    def add(self, workflow_fn: Callable, *args: Any, key: str, depends_on: Iterable[Member | str] = (),
            priority: int | None = None, deadline: Any = None, concurrency_key: str | None = None,
            conn: Any = None) -> Member:
        """Add a run of `workflow_fn(*args)` under `key`, waiting for the
        members `depends_on` (handles or keys of members added before it) and
        for the seal. Refused (DagError, nothing written): a sealed or
        cancelled graph, a key taken or too long, a workflow outside the
        graph's `workflows`, a dependency that is not an earlier member."""
        keys = self._member_args("Dag.add()", workflow_fn, key, depends_on)
        conn = transaction_connection(conn or self._conn, "Dag.add()")
        found = queries.run(conn, self._admitting(key, keys))
        run = api.schedule(workflow_fn, *args, conn=conn, deadline=deadline, priority=priority,
                           concurrency_key=concurrency_key)
        queries.run(conn, self._enrolling(key, keys, found, run.id))
        return Member(self.key, key, run.id)

    async def aadd(self, workflow_fn: Callable, *args: Any, key: str, depends_on: Iterable[Member | str] = (),
                   priority: int | None = None, deadline: Any = None, concurrency_key: str | None = None,
                   conn: Any = None) -> Member:
        """`add` for asyncio (`conn`: as for `aschedule()`)."""
        keys = self._member_args("Dag.aadd()", workflow_fn, key, depends_on)
        aconn = await async_connection(conn or self._conn, "Dag.aadd()")
        found = await queries.arun(aconn, self._admitting(key, keys))
        run = await api.aschedule(workflow_fn, *args, conn=aconn, deadline=deadline, priority=priority,
                                  concurrency_key=concurrency_key)
        await queries.arun(aconn, self._enrolling(key, keys, found, run.id))
        return Member(self.key, key, run.id)

    def _member_args(self, caller: str, workflow_fn: Callable, key: Any, depends_on: Iterable[Member | str]
                     ) -> list[str]:
        """add()'s checks before any statement: the member's key, its
        workflow, and the keys of its dependencies."""
        _check_key("a member's key", key)
        name = registry.workflow_name(workflow_fn)
        if name is None:
            raise TypeError(f"{caller} takes an @workflow function, not {workflow_fn!r}")
        if self.workflows is not None and not any(fnmatch.fnmatchcase(name, p) for p in self.workflows):
            raise DagError(f"graph {self.key!r} may run {', '.join(self.workflows)}, not {name}")
        return self._dependency_keys(depends_on)

    def _admitting(self, key: str, keys: list[str]) -> Plan:
        """Lock the open graph and find the member's dependencies (key -> run
        id); refused when it is sealed, `key` is taken or a dependency unknown."""
        locked = yield from store.lock_dag(self.key)
        if locked is None:
            raise DagNotFound(f"no graph {self.key!r}")
        if locked[0] is not None or locked[1] is not None:
            raise DagSealed(f"graph {self.key!r} is {'cancelled' if locked[1] else 'sealed'}: nothing can be added")
        found = yield from store.named_members(self.key, keys, [], key)
        if key in found:
            raise DagError(f"graph {self.key!r} has a member {key!r} already")
        unknown = [k for k in keys if k not in found]
        if unknown:
            raise DependencyError(f"graph {self.key!r} has no member {unknown[0]!r} (a dependency must be added "
                                  "before its dependents)")
        return found

    def _enrolling(self, key: str, keys: list[str], found: dict[str, uuid.UUID], run: uuid.UUID) -> Plan:
        """The member's run, just scheduled, waits for its dependencies and the seal."""
        yield from store.hold_for_dependencies(run, [found[k] for k in keys], sealed=False)
        position = yield from store.take_member_position(self.key)
        yield from store.add_member(self.key, key, position, run, keys)

    def _dependency_keys(self, depends_on: Iterable[Member | str]) -> list[str]:
        if isinstance(depends_on, (str, Member)):
            depends_on = [depends_on]
        keys: list[str] = []
        for dep in depends_on:
            if isinstance(dep, Member):
                if dep.dag != self.key:
                    raise DependencyError(f"{dep.key!r} is a member of graph {dep.dag!r}, not of {self.key!r}")
                dep = dep.key
            elif not isinstance(dep, str):
                raise DependencyError(f"depends_on= takes members of graph {self.key!r} (handles or keys), "
                                      f"not {dep!r}")
            if dep not in keys:
                keys.append(dep)
        return keys

    def seal(self, actor: str | None = None, conn: Any = None) -> None:
        """Seal the graph: nothing can be added any more, and the members
        that depend on nothing start. Refused (DagError): a graph sealed or
        cancelled already, or empty. Audited (`dag-seal`, with `actor`)."""
        _write(conn or self._conn, "Dag.seal()", self._sealing(actor))

    async def aseal(self, actor: str | None = None, conn: Any = None) -> None:
        """`seal` for asyncio."""
        await _awrite(conn or self._conn, "Dag.aseal()", self._sealing(actor))

    def _sealing(self, actor: str | None) -> Plan:
        locked = yield from store.lock_dag(self.key)
        if locked is None:
            raise DagNotFound(f"no graph {self.key!r}")
        sealed_at, cancelled_at, members = locked
        if sealed_at is not None or cancelled_at is not None:
            raise DagSealed(f"graph {self.key!r} is {'cancelled' if cancelled_at else 'sealed'} already")
        if members == 0:
            raise DagError(f"graph {self.key!r} has no member: add some before sealing it")
        released = yield from store.seal_dag(self.key, actor)
        yield from db.audit_entry(actor or api._local_actor(), "api", "dag-seal", target=self.key,
                                  details={"members": members, "released": released})


def _write(conn: Any, caller: str, plan: Plan) -> Any:
    """Run `plan` in the caller's transaction (a sync connection)."""
    return queries.run(transaction_connection(conn, caller), plan)


async def _awrite(conn: Any, caller: str, plan: Plan) -> Any:
    """Run `plan` in the caller's transaction (an AsyncConnection, or a SQLAlchemy AsyncSession)."""
    return await queries.arun(await async_connection(conn, caller), plan)


def create(key: str, *, workflows: Iterable[str] | None = None, actor: str | None = None, conn: Any = None) -> Dag:
    """The graph `key` (at most 255 characters), created open unless it
    exists (then that one, sealed or not: race-safe like an idempotency
    key). `workflows`: the module.qualname patterns (* and ?) its members
    may use (None: any)."""
    row = _write(conn, "dags.create()", store.create_dag(_check_key("a graph's key", key), _patterns(workflows),
                                                         actor))
    return Dag(row.key, row.workflows, conn)


async def acreate(key: str, *, workflows: Iterable[str] | None = None, actor: str | None = None,
                  conn: Any = None) -> Dag:
    """`create` for asyncio (`conn`: as for `aschedule()`); the Dag's
    `aadd` and `aseal` default to the same connection."""
    row = await _awrite(conn, "dags.acreate()", store.create_dag(_check_key("a graph's key", key),
                                                                 _patterns(workflows), actor))
    return Dag(row.key, row.workflows, conn)


def _status(sealed: bool, cancelled: bool, statuses: list[str | None]) -> str:
    """A graph's status from its members' (the same rules as list_dags in db/sql/dags.sql)."""
    if cancelled:
        return "cancelled"
    if not sealed:
        return "open"
    if any(s in (RunStatus.FAILED, RunStatus.STOPPED) for s in statuses):
        return "failed"
    if all(s == RunStatus.COMPLETED for s in statuses):
        return "completed"
    if all(s in TERMINAL for s in statuses):
        return "cancelled"
    return "running"


def get(key: str, conn: Any = None) -> DagState:
    """The graph `key` and its members (DagNotFound if there is none)."""
    return queries.run(api._reading(conn, "dags.get()"), _state(key))


async def aget(key: str, conn: Any = None) -> DagState:
    """`get` for asyncio."""
    return await queries.arun(await async_connection(conn, "dags.aget()", write=False), _state(key))


def _state(key: str) -> Plan:
    row = yield from store.dag(key)
    if row is None:
        raise DagNotFound(f"no graph {key!r}")
    members = {m["key"]: MemberState(m["run_id"], m["status"], tuple(m["depends_on"]), m["cancel_reason"])
               for m in (yield from store.dag_members(key))}
    return DagState(row.key, _status(row.sealed_at is not None, row.cancelled_at is not None,
                                     [m.status for m in members.values()]),
                    members, None if row.workflows is None else tuple(row.workflows), row.created_at,
                    row.sealed_at, row.sealed_by, row.cancelled_at)


def list_dags(conn: psycopg.Connection, status: str | None = None, limit: int | None = 100) -> list[dict]:
    """Graphs newest first (key, status, members, completed, created_at, sealed_at)."""
    if status is not None and status not in STATUSES:
        raise DagError(f"a graph's status is one of {', '.join(STATUSES)}, not {status!r}")
    return store.list_dags(conn, status, limit)


def cancel(key: str, reason: str | None = None, conn: Any = None, actor: str | None = None,
           source: str = "api") -> None:
    """Cancel the graph: every member not ended yet is cancelled (at once
    when it is not running; at its next step when it is), and so are the
    follow-ups waiting for them."""
    _write(conn, "dags.cancel()", _cancelling(key, reason, actor, source))


async def acancel(key: str, reason: str | None = None, conn: Any = None, actor: str | None = None,
                  source: str = "api") -> None:
    """`cancel` for asyncio."""
    await _awrite(conn, "dags.acancel()", _cancelling(key, reason, actor, source))


def _cancelling(key: str, reason: str | None, actor: str | None, source: str) -> Plan:
    if not (yield from store.cancel_dag(key, reason)):
        raise DagNotFound(f"no graph {key!r}")
    yield from db.audit_entry(actor or api._local_actor(), source, "dag-cancel", target=key,
                              details={"reason": reason})


def rerun(key: str, member: str, conn: Any = None, actor: str | None = None, source: str = "api") -> uuid.UUID:
    """Re-run a member that failed, stopped or was cancelled, from its
    failed step (steps before it copied, see everystep.reruns): the re-run
    takes the member's place, and the members cancelled because of it wait
    again for their dependencies, to start when the re-run completes.
    Returns the new run's id. Refused (DagError) for an unknown graph or
    member, a cancelled graph, a member not ended or completed."""
    return _write(conn, "dags.rerun()", _rerunning(key, member, actor or api._local_actor(), source))


async def arerun(key: str, member: str, conn: Any = None, actor: str | None = None,
                 source: str = "api") -> uuid.UUID:
    """`rerun` for asyncio."""
    return await _awrite(conn, "dags.arerun()", _rerunning(key, member, actor or api._local_actor(), source))


def _rerunning(key: str, member: str, actor: str, source: str) -> Plan:
    row = yield from store.dag(key)
    if row is None:
        raise DagNotFound(f"no graph {key!r}")
    if row.cancelled_at is not None:
        raise DagError(f"graph {key!r} is cancelled")
    found = yield from store.member_run(key, member)
    if found is None:
        raise DagNotFound(f"graph {key!r} has no member {member!r}")
    old, status = found
    if status not in (RunStatus.FAILED, RunStatus.STOPPED, RunStatus.CANCELLED):
        raise DagError(f"member {member!r} of graph {key!r} is {status}: only a failed, stopped or cancelled "
                       "member is re-run")
    source_run = yield from db.rerun_source(old)
    failed = [s["step_id"] for s in (source_run[1] if source_run else []) if s["status"] == StepStatus.FAILED]
    if failed:
        new = (yield from reruns.rerunning(old, failed[-1], actor, source))[0]
    else:  # it failed outside any step: run it again from the start
        new = yield from db.insert_rerun(old, uuid7(), [])
        yield from db.audit_entry(actor, source, "rerun", run=new, target=str(old), details={"rerun_of": str(old)})
    yield from store.replace_member_run(key, member, old, new)
    yield from db.audit_entry(actor, source, "dag-rerun", run=new, target=key,
                              details={"member": member, "rerun_of": str(old)})
    return new


@api.step
def _upstream(dep_key: str) -> Any:
    """The dependency's result, read once and recorded (a replay serves it)."""
    run = current()
    with run.replay.held.lent.pool.connection() as conn:
        found = store.upstream_result(conn, run.workflow_id, dep_key)
    if found is None:
        raise DagError(f"run {run.workflow_id} is not a member of a graph with a member {dep_key!r}")
    status, result, is_dependency = found
    if not is_dependency:
        raise DagError(f"{dep_key!r} is not a dependency of this member")
    if status != RunStatus.COMPLETED:
        raise DagError(f"dependency {dep_key!r} is {status}, not completed")
    return serde.from_json(result)


def upstream(dep_key: str) -> Any:
    """Inside a member: the result of its completed dependency `dep_key`,
    recorded like a step (a replay gets the same value)."""
    if current() is None:
        raise EverystepError("dags.upstream() is called inside a member of a graph")
    return _upstream(_check_key("a dependency's key", dep_key))


def member_of(conn: psycopg.Connection, run_id: uuid.UUID) -> tuple[str, str] | None:
    """(graph key, member key) of a run that is a member, else None."""
    return store.dag_of_run(conn, run_id)
