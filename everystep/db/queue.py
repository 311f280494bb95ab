"""The queue: waiting for runs, claiming them, concurrency limits, taking
back what a runner holds, crash counting, the group-committed step rows and
ends of runs, requeues. Statements: sql/queue.sql.

Fencing: every claim of a run gives it a new execution token (a sequence
value on its row), and every write about a held run is conditional on the run
still being `running`, claimed by the writer and carrying the writer's token.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import psycopg
from psycopg import errors

from everystep.db import libpq, queries
from everystep.db.rows import (
    BatchEnd,
    Claim,
    ClaimedRun,
    Ended,
    EndedRuns,
    EndWrite,
    StepRow,
    StepWrite,
    TokenTake,
    Written,
)
from everystep.db.session import Executor

# How many runs at the head of the queue the maintenance sweep looks at for
# the strays of a version before 0032 between its looks at the whole queue
# (sort_lanes; everystep.maintenance.STRAYS_INTERVAL).
STRAYS_HEAD = 1000
# The queue tables a compaction rewrites, in its order.
QUEUE_TABLES = ("everystep_ready", "everystep_timer", "everystep_blocked")

# ---------------------------------------------------------------- waiting for runs


def wait_for_runs(conn: psycopg.Connection, runner: str) -> None:
    """Register a worker as waiting for runs (it has a free slot), so that
    scheduling transactions notify. Taking the wake lock exclusively waits
    for the scheduling transactions in flight: a claim after this returns
    sees their runs, and every later one sees the registration. Own
    transaction (the control connection is in autocommit)."""
    with conn.transaction():
        conn.execute(queries.get("wake_lock_exclusive"), {})
        conn.execute(queries.get("register_waiting"), {"runner": runner})


def stop_waiting(conn: psycopg.Connection, runner: str) -> None:
    """The worker's slots are full: scheduling needs not wake it."""
    conn.execute(queries.get("stop_waiting"), {"runner": runner})


# ---------------------------------------------------------------- claiming


def routes_of(patterns: list[str] | tuple[str, ...] | None) -> list[str] | None:
    """The LIKE patterns of shell-style workflow name patterns (`*` any run
    of characters, `?` one character), or None for "every workflow"."""
    if patterns is None:
        return None
    like = []
    for pattern in patterns:
        escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        like.append(escaped.replace("*", "%").replace("?", "_"))
    return like


# On a pickup's path: libpq directly saves a claim 30 us of psycopg's Python.
# A listening connection's notifications then wait in libpq's queue
# (db.notifications reads it).
_CLAIM = libpq.hot("claim")


def claim(conn: psycopg.Connection, runner: str, limit: int, routes: list[str] | None = None,
          skipped: Sequence[str] = ()) -> list[ClaimedRun]:
    """Claim up to `limit` ready runs, highest priority first, then in the
    order they became ready, with their recorded steps; only of workflows
    matching `routes` (LIKE patterns, see `routes_of`; None: all) and not in
    `skipped` (workflow names the claimer cannot import). When none is
    ready, the blocked runs that have room are admitted (`unblock`) and
    claimed."""
    values = {"runner": runner, "limit": limit, "routes": libpq.array_literal(routes),
              "skipped": libpq.array_literal(list(skipped))}
    runs = libpq.claimed_runs(conn, libpq.run(conn, _CLAIM, values), first_column=0)
    if not runs and limit > 0 and unblock(conn):
        runs = libpq.claimed_runs(conn, libpq.run(conn, _CLAIM, values), first_column=0)
    runs.sort(key=lambda r: r.id)  # UUIDv7: creation order
    return runs


def claim_before_commit(conn: psycopg.Connection, runner: str, limit: int, routes: list[str] | None = None,
                        skipped: Sequence[str] = ()) -> tuple[list[ClaimedRun], Callable[[], None]]:
    """`claim`, with the claimed runs as soon as the claim ran, before its
    commit: the worker starts them while the commit's WAL flush goes on.
    `confirm()` waits for the commit (raising a connection error if the
    connection broke meanwhile: whether the claim committed is then
    unknown); it is to be called before anything else runs on `conn`, and
    an execution of a run reads and writes nothing about it before. When
    no run is claimed, the commit has returned already (confirm does nothing)."""
    values = {"runner": runner, "limit": limit, "routes": libpq.array_literal(routes),
              "skipped": libpq.array_literal(list(skipped))}
    for attempt in (1, 2):
        result, confirm = libpq.run_before_commit(conn, _CLAIM, values)
        try:
            runs = libpq.claimed_runs(conn, result, first_column=0)
        except BaseException:
            confirm()
            raise
        if runs:
            runs.sort(key=lambda r: r.id)  # UUIDv7: creation order
            return runs, confirm
        confirm()  # nothing to start: the connection is free again at once
        if attempt == 2 or limit <= 0 or not unblock(conn):
            break
    return [], libpq.committed


def unblock(conn: psycopg.Connection) -> int:
    """Admit the blocked runs that have room (0032_ready.sql: the catch-up
    of a release and an admission that ran at once); how many."""
    return conn.execute(queries.get("unblock"), {}, prepare=True).fetchone()[0]


def apply_limits(conn: psycopg.Connection, limits: dict[str, int | None],
                 per_key: dict[str, int | None] | None = None,
                 priorities: dict[str, int | None] | None = None) -> None:
    """Write the concurrency limit of each workflow (None: no limit), in one
    transaction: its row and its slots 1..N. Lowering a limit drops the slots
    above it; a run still running in one finishes. `per_key`: the per-key
    limits (concurrency_per_key) of the workflows it names (None: none);
    `priorities`: their default priorities (None: 0, no row)."""
    limited = {name: n for name, n in limits.items() if n is not None}
    with conn.transaction():
        conn.execute(queries.get("drop_limits"), {"names": [name for name, n in limits.items() if n is None]})
        if limited:
            params = {"names": list(limited), "counts": list(limited.values())}
            conn.execute(queries.get("put_limits"), params)
            conn.execute(queries.get("drop_slots_above"), params)
            conn.execute(queries.get("add_slots"), params)
            conn.execute(queries.get("notify"), {})  # a raised limit may make runs claimable
        if per_key:
            keyed = {name: n for name, n in per_key.items() if n is not None}
            conn.execute(queries.get("drop_key_limits"), {"names": [name for name, n in per_key.items() if n is None]})
            if keyed:
                conn.execute(queries.get("put_key_limits"), {"names": list(keyed), "counts": list(keyed.values())})
                conn.execute(queries.get("notify"), {})
        if priorities:
            given = {name: p for name, p in priorities.items() if p is not None}
            conn.execute(queries.get("drop_priorities"),
                         {"names": [name for name, p in priorities.items() if p is None]})
            if given:
                conn.execute(queries.get("put_priorities"), {"names": list(given), "priorities": list(given.values())})
        sort_lanes(conn)


def sort_lanes(conn: psycopg.Connection, whole_queue: bool = False) -> int:
    """After the limits change, and at every sweep of the maintenance child:
    the runs a worker of a version before 0032 claimed itself are held (0040;
    looked for among the first STRAYS_HEAD runs of the ready order and of the
    due timers, where the claims meet them, or in the whole queue), the
    ready runs of a workflow limited since they were admitted take a slot or
    wait for one, and the blocked runs that have room are admitted
    (0032_ready.sql). Returns how many runs moved."""
    with conn.transaction():
        return conn.execute(queries.get("resort"), {"head": None if whole_queue else STRAYS_HEAD}).fetchone()[0]


def sweep_keys(conn: psycopg.Connection) -> int:
    """The maintenance child's sweep of the fair queues' keys: those with no
    run admitted, running or blocked go (a tenant gone for good costs the
    pumps nothing). Returns how many went."""
    with conn.transaction():
        return len(conn.execute(queries.get("idle_keys"), {}).fetchall())


def queue_dead_tuples(conn: psycopg.Connection) -> tuple[bool, int]:
    """Whether this role may vacuum the queue's tables, and the dead row
    versions they hold (queue.sql, queue_dead_tuples, says why it matters)."""
    with conn.transaction():
        owned, dead = conn.execute(queries.get("queue_dead_tuples"), {}).fetchone()
    return bool(owned), dead


def vacuum_queue(conn: psycopg.Connection) -> None:
    """VACUUM the queue's tables (a statement that cannot run in a transaction:
    the connection is in autocommit for it); not while the connection is in
    a transaction (the next sweep does it)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        return
    autocommit = conn.autocommit
    conn.autocommit = True
    try:
        conn.execute(queries.get("vacuum_queue"), {})
    finally:
        conn.autocommit = autocommit


def compact_queue(conn: psycopg.Connection, dead: int, live: int, wait_ms: int) -> list[str]:
    """The queue tables that hold `dead` dead row versions or more and `live`
    live ones at most, rewritten with their live rows alone, each waiting at
    most `wait_ms` for its lock (queue.sql, compact_queue, says when it
    matters). Each in a transaction of its own: a claim locks the timers,
    then the ready runs, so a rewrite of the timers that came after the
    ready table's in one transaction waited for claims that waited for
    that transaction, and gave up. Returns the tables rewritten."""
    rewritten = []
    for queue in QUEUE_TABLES:
        with conn.transaction():
            if conn.execute(queries.get("compact_queue"),
                            {"queue": queue, "dead": dead, "live": live, "wait_ms": wait_ms}).fetchone():
                rewritten.append(queue)
    return rewritten


def limits(conn: psycopg.Connection) -> dict[str, int]:
    """The concurrency limits in force, by workflow name."""
    return dict(conn.execute(queries.get("limits"), {}).fetchall())


def key_limits(conn: psycopg.Connection) -> dict[str, int]:
    """The per-key concurrency limits in force, by workflow name."""
    return dict(conn.execute(queries.get("key_limits"), {}).fetchall())


def priorities(conn: psycopg.Connection) -> dict[str, int]:
    """The default priorities the workers wrote, by workflow name."""
    return dict(conn.execute(queries.get("priorities"), {}).fetchall())


# ---------------------------------------------------------------- rate limits


def put_rate_limits(conn: Executor, limits: dict[str, tuple[float, float, int]]) -> None:
    """Write rate limits by name: (rate, per, burst). A new bucket starts
    full; a changed one keeps its tokens (at most the new burst)."""
    if limits:
        conn.execute(queries.get("put_rate_limits"), {
            "names": list(limits), "rates": [float(r) for r, _, _ in limits.values()],
            "pers": [float(p) for _, p, _ in limits.values()], "bursts": [int(b) for _, _, b in limits.values()]})


def rate_limits(conn: Executor) -> dict[str, tuple[float, float, int]]:
    """The rate limits in force: (rate, per, burst) by name."""
    return {name: (rate, per, burst)
            for name, rate, per, burst in conn.execute(queries.get("rate_limits"), {}).fetchall()}


def take_token(conn: Executor, name: str) -> TokenTake | None:
    """Take one token of rate limit `name` (see TokenTake); None if there is
    no such rate limit."""
    row = conn.execute(queries.get("take_token"), {"name": name}).fetchone()
    if row is None:
        return None
    return TokenTake(0.0 if row[0] else float(row[1]), float(row[2]), None if row[3] is None else float(row[3]))


# ---------------------------------------------------------------- what a runner holds


def reclaim_held(conn: psycopg.Connection, runner: str, executing: list[int] = ()) -> list[ClaimedRun]:
    """Claim again, with new tokens, the runs `running` under this runner's
    name that none of its live executions (`executing`: their tokens) holds:
    left by its previous incarnation, or claimed by a write whose answer was
    lost. Oldest first."""
    rows = conn.execute(queries.get("reclaim_held"), {"runner": runner, "executing": list(executing)}).fetchall()
    runs = [ClaimedRun(*row) for row in rows]
    runs.sort(key=lambda r: r.id)
    return runs


def held_claims(conn: psycopg.Connection, runner: str) -> list[Claim]:
    """The runs `running` under this runner's name, with their tokens."""
    return [Claim(*row) for row in conn.execute(queries.get("held_claims"), {"runner": runner})]


def cancel_requests(conn: psycopg.Connection, runner: str, tokens: list[int]) -> list[int]:
    """The executions among `tokens` (the runner's) whose run has a cancel request."""
    return [row[0] for row in conn.execute(queries.get("cancel_requests"), {"runner": runner, "tokens": tokens})]


def running_claimers(conn: psycopg.Connection) -> list[str]:
    """Every distinct claimer of a running run."""
    return [row[0] for row in conn.execute(queries.get("running_claimers"), {})]


def count_crashes(
    conn: psycopg.Connection, claimer: str, claims: list[Claim], max_crashes: int, poison_error: str
) -> list[uuid.UUID]:
    """Count one crash (a claim that ended with its worker dead) for each of
    these runs still held under `claimer` with the same token. The count
    restarts when the run recorded new steps since its last crash. Runs that
    reach `max_crashes` are failed with `poison_error`; returns them."""
    if not claims:
        return []
    with conn.transaction():
        rows = conn.execute(queries.get("count_crashes"), {
            "ids": [c.id for c in claims], "tokens": [c.token for c in claims], "claimer": claimer}).fetchall()
        poisoned = [run_id for run_id, crashes in rows if crashes >= max_crashes]
        if not poisoned:
            return []
        failed = conn.execute(queries.get("fail_poisoned"),
                              {"error": poison_error, "ids": poisoned, "claimer": claimer}).fetchall()
    return [row[0] for row in failed]


# ---------------------------------------------------------------- group commit
# The step rows and run ends of many executions of one runner (every run
# thread of a worker process) in one statement and one commit: see
# everystep.writer. Each row is fenced by its own execution's token; a row
# whose fence fails is reported to its own execution only.

_RECORD_STEPS = libpq.hot("record_steps")
_END_RUNS = libpq.hot("end_runs")


def _step_columns(rows: list[StepRow | None]) -> dict[str, str]:
    """The columns of step rows as array parameters (None rows: all NULL)."""
    return {field: libpq.array_literal([None if row is None else row[i] for row in rows])
            for i, field in enumerate(StepRow._fields)}


def record_steps(conn: psycopg.Connection, runner: str, steps: list[StepWrite]) -> list[Written | bool]:
    """Write step rows of `runner`'s executions in one statement: for each,
    Written, or False (not held by its execution, or the row exists)."""
    result = libpq.run(conn, _RECORD_STEPS, {
        "runs": libpq.array_literal([w.run for w in steps]), "tokens": libpq.array_literal([w.token for w in steps]),
        "runner": runner, **_step_columns([w.row for w in steps])})
    seen = {int(result.get_value(i, 0)): result.get_value(i, 1) == b"t" for i in range(result.ntuples)}
    return [Written(seen[n]) if n in seen else False for n in range(1, len(steps) + 1)]


def end_runs(conn: psycopg.Connection, runner: str, ends: list[EndWrite], routes: list[str] | None,
             skipped: Sequence[str] = ()) -> EndedRuns:
    """End runs of `runner`'s executions in one statement, claiming their
    successors. `routes`, `skipped`: the workflows a successor may be of,
    and may not be (see `claim`)."""
    result = libpq.run(conn, _END_RUNS, {
        "runs": libpq.array_literal([e.run for e in ends]), "tokens": libpq.array_literal([e.token for e in ends]),
        "statuses": libpq.array_literal([e.status for e in ends]),
        "results": libpq.array_literal([e.result for e in ends]),
        "errors": libpq.array_literal([e.error for e in ends]),
        "claims": libpq.array_literal([int(e.claim) for e in ends]), "runner": runner,
        "routes": libpq.array_literal(routes), "skipped": libpq.array_literal(list(skipped)),
        **_step_columns([e.last_step for e in ends])})
    successors = libpq.claimed_runs(conn, result, first_column=3)
    receivers, statuses, exists, released, priorities = {}, {}, set(), 0, []
    for i in range(result.ntuples):
        kind = result.get_value(i, 0)
        if kind == b"c":  # in the order of `successors`
            # NULL: a run scheduled after the statement began (its snapshot
            # does not see it; the claim's does), taken as of the default priority.
            priority = result.get_value(i, 1)
            priorities.append(0 if priority is None else int(priority))
        elif kind == b"h":
            receivers[int(result.get_value(i, 1))] = int(result.get_value(i, 2))
        elif kind == b"e":
            statuses[int(result.get_value(i, 1))] = result.get_value(i, 2).decode()
        elif kind == b"s":
            exists.add(int(result.get_value(i, 1)))
        elif kind == b"r":
            released = int(result.get_value(i, 1))
    # In the queue's order (priority, then UUIDv7: the oldest) to the first
    # asking: a slot goes on with the first, a run claimed ahead waits.
    successors = [run for _, run in sorted(zip(priorities, successors), key=lambda pair: (-pair[0], pair[1].id))]
    asking = sorted(receivers)
    given = dict(zip(asking, successors))  # one each first: every slot asking goes on
    ahead = dict(zip([n for n in asking if receivers[n] > 1], successors[len(given):]))
    return EndedRuns([BatchEnd(statuses.get(n), n in exists, given.get(n), ahead.get(n))
                      for n in range(1, len(ends) + 1)], released)


def record_step(conn: psycopg.Connection, run: uuid.UUID, runner: str, token: int, row: StepRow) -> Written | bool:
    """Record one step's outcome (`done`/`failed`), or the `started` mark of
    an unsafe-to-repeat step, with the token of the execution that wrote it:
    record_steps with one step. The unique (workflow, step_id) makes this
    insert the claim on the step: False if the run is not held by this
    execution or the row exists."""
    return record_steps(conn, runner, [StepWrite(run, token, row)])[0]


def finish_run(
    conn: psycopg.Connection, run: uuid.UUID, runner: str, token: int, status: str, result: str | None,
    error: str | None, last_step: StepRow | None = None, claim: int = 0, routes: list[str] | None = None,
) -> Ended | None:
    """End one held run (completed/failed/stopped/blocked, or cancelled) with
    the row of its last step when that is not written yet and claim `claim`
    runs (True: one) for the slot it frees: end_runs with one end.
    Returns the end and the runs claimed, or None if the run was not held by
    this execution (nothing was written). Raises UniqueViolation (nothing
    written) if the last step's row exists already. `routes`: as for `claim`."""
    (end,) = end_runs(conn, runner, [EndWrite(run, token, status, result, error, last_step, claim)],
                      routes).finished
    if end.step_exists:
        raise errors.UniqueViolation(f"step {last_step.step_id!r} of run {run} exists already")
    if end.status is None:
        return None
    return Ended(end.status, [run for run in (end.successor, end.ahead) if run is not None])


# ---------------------------------------------------------------- requeues


def requeue_held(conn: Executor, runner: str, claims: list[Claim], why: str = "drained") -> list[uuid.UUID]:
    """Put runs held by these executions of `runner` back to `scheduled`
    (drain, a dead claimer's runs); returns those that matched. Each
    execution ended so is recorded in everystep_execution as `why`
    (drained, swept, escaped)."""
    rows = conn.execute(queries.get("requeue_held"), {
        "ids": [c.id for c in claims], "tokens": [c.token for c in claims], "runner": runner,
        "why": why}).fetchall()
    return [row[0] for row in rows]


def requeue_claimer(conn: psycopg.Connection, claimer: str) -> list[uuid.UUID]:
    """Requeue every running run of a claimer whose lock the caller holds and
    none of whose executions can write any more (a worker's own shutdown)."""
    return [row[0] for row in conn.execute(queries.get("requeue_claimer"), {"claimer": claimer}).fetchall()]


def requeue_from_dead_claimers(conn: psycopg.Connection, claims: list[tuple[uuid.UUID, str | None]]) -> list[uuid.UUID]:
    """Put `running` runs back to `scheduled`, each only if it is still claimed
    by the given claimer (one the caller found dead and whose lock it holds).
    Returns the runs that matched."""
    rows = conn.execute(queries.get("requeue_from_dead_claimers"), {
        "ids": [run for run, _ in claims], "claimers": [claimer for _, claimer in claims]}).fetchall()
    return [row[0] for row in rows]


def next_due_in(conn: psycopg.Connection) -> float | None:
    """Seconds until the earliest waiting run becomes due, by the database's
    clock (<= 0: one is due now), or None when nothing waits."""
    row = conn.execute(queries.get("next_due_in"), {}, prepare=True).fetchone()
    return None if row[0] is None else float(row[0])
