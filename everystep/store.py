"""Every SQL statement everystep runs, as named functions. Nobody else writes SQL.

Fencing: every claim of a run gives it a new execution token (a sequence
value on its row), and every write about a held run is conditional on the run
still being `running`, claimed by the writer and carrying the writer's token
(`_HELD`). Step rows are written under a `FOR SHARE` lock of the run row, so a
concurrent requeue either waits for the step's commit or makes the insert match
nothing — an execution that lost its claim cannot slip a write in, not even one
of the same worker. A write about a held run that matches nothing (its function
returns False, None or an empty list) is explained by `why_not_written`.

Durability: every connection the engine writes runs and steps on commits
synchronously (`prepare_session`), whatever the server, role or URL says: a
claim, a step row and a run's end are on disk before anyone acts on them.
"""

from __future__ import annotations

import datetime
import json
import uuid
import weakref
from collections.abc import Callable
from importlib import resources
from typing import Any, NamedTuple

import psycopg
from psycopg import errors, pq, sql

from everystep.schema import TERMINAL, RunStatus, StepStatus

# Notifications go to a channel per schema, so deployments sharing a database
# (or test schemas) do not wake each other's workers.
_NOTIFY = "pg_notify('everystep:' || current_schema(), '')"
# What scheduling calls instead: notify only when a worker is waiting for
# runs, once per transaction (0008_perf.sql says why).
_WAKE = "everystep_wake()"
# Taken shared by every scheduling transaction (in everystep_wake), and
# exclusive by a worker registering as waiting.
_WAKE_LOCK = "hashtextextended('everystep:wake:' || current_schema(), 0)"

# The 64-bit advisory-lock key of a runner name, scoped to the schema so two
# deployments sharing a database (or two test schemas) never collide.
_LOCK_KEY = "hashtextextended('everystep:' || current_schema() || ':' || %s, 0)"
# A run held by one execution, found by its primary key. "Running" is written
# so that no index on status can serve it: seeing few running rows, the
# planner would otherwise walk the running entries of the status index — dead
# ones included, thousands of them between two vacuums under load — rather
# than look the run up.
_RUNNING = "({table}status = 'running') IS TRUE"
_HELD = f"id = %(run)s AND {_RUNNING.format(table='')} AND claimed_by = %(runner)s AND claim_token = %(token)s::bigint"
# A new execution token, for every claim.
_NEW_TOKEN = "nextval('everystep_claim_token')"
# Which runs a claim may take, and in which order: the one place of the claim
# predicate, shared by `claim` and the successor claim of `finish_run`. Ready
# (`scheduled`) and `waiting` runs alike, once due by the database's clock,
# in (due_at, id) order: the partial index everystep_workflow_ready makes it a
# range scan that never reads a run not due yet, and stops at the first
# unlocked one.
_CLAIMABLE = "status IN ('scheduled', 'waiting') AND due_at <= now()"
_CLAIM_ORDER = "ORDER BY due_at, w.id"
# The claimable runs of one workflow ({name}), for the claims of limited
# workflows: _CLAIMABLE with the due time compared as (name, due_at), which
# only everystep_workflow_due_by_name (name, due_at, id) can serve. Given a
# name, the planner cannot tell how many claimable runs are that workflow's;
# walking the ready index for them would read every claimable run of every
# other workflow first, at every claim.
_CLAIMABLE_OF = "status IN ('scheduled', 'waiting') AND w.name = {name} AND (w.name, w.due_at) <= ({name}, now())"

# What the writes about a held run execute on: a connection, or a cursor of
# one (the runner reuses one cursor for all the writes of an execution).
Executor = psycopg.Connection | psycopg.Cursor


# Errors that mean "the database is away for now" (a restart, a failover to a
# server still read-only, a network cut): reconnect and retry, never give up a run.
CONNECTION_ERRORS = (psycopg.OperationalError, psycopg.errors.ReadOnlySqlTransaction)


class ClaimedRun(NamedTuple):
    id: uuid.UUID
    name: str
    args: Any  # stored JSON, not yet decoded
    steps: list  # [[step_id, name, status, result, error, attempts], ...] as stored
    token: int  # the execution token of this claim
    cancel_requested: bool = False  # a cancel request was on the run when it was claimed
    claimed_at: float = 0.0  # the database's time of the claim (epoch seconds)


class Claim(NamedTuple):
    """A run held by a claimer, as its row says: which run, which execution."""
    id: uuid.UUID
    token: int | None  # None: claimed before execution tokens existed


# ---------------------------------------------------------------- migrations

def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply the shipped migrations not yet applied, in one transaction, under
    an advisory lock so concurrent migrators queue up. Returns what it applied."""
    files = sorted(
        (f for f in resources.files("everystep.migrations").iterdir() if f.name.endswith(".sql")),
        key=lambda f: f.name,
    )
    applied = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('everystep:migrate:' || current_schema(), 0))")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS everystep_migration ("
            " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {row[0] for row in conn.execute("SELECT name FROM everystep_migration")}
        for f in files:
            name = f.name.removesuffix(".sql")
            if name in done:
                continue
            conn.execute(f.read_text())
            conn.execute("INSERT INTO everystep_migration (name) VALUES (%s)", (name,))
            applied.append(name)
    return applied


# ---------------------------------------------------------------- scheduling

def insert_run(
    conn: psycopg.Connection, run_id: uuid.UUID, name: str, args_json: str, idempotency_key: str | None,
    trace_context: str | None = None, at: datetime.datetime | None = None, after: float | None = None,
) -> tuple[uuid.UUID, bool]:
    """Insert a run into the caller's transaction and notify the
    workers waiting for runs, if any (delivered at commit; see everystep_wake). It is due `at` a time, or
    `after` seconds from now by the database's clock, or at once; a run not
    due yet is `waiting`. With an idempotency key, an existing run of the same
    (name, key) is returned instead: (id, created).
    `trace_context`: the scheduling span's context as JSON, when tracing is on."""
    if at is None and after is None:  # due at once: due_at takes its default, now()
        insert = (" INSERT INTO everystep_workflow (id, name, args, idempotency_key, status, trace_context)"
                  " VALUES (%(id)s, %(name)s, %(args)s::jsonb, %(key)s, 'scheduled', %(trace)s::jsonb)")
    else:
        insert = (" INSERT INTO everystep_workflow (id, name, args, idempotency_key, status, trace_context, due_at)"
                  " SELECT %(id)s, %(name)s, %(args)s::jsonb, %(key)s,"
                  "  CASE WHEN due.at > now() THEN 'waiting' ELSE 'scheduled' END, %(trace)s::jsonb,"
                  "  greatest(due.at, now())"
                  " FROM (SELECT coalesce(%(at)s::timestamptz, now() + make_interval(secs => %(after)s::float8))"
                  "  AS at) AS due")
    row = conn.execute(
        f"WITH ins AS ({insert}"
        " ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING"
        " RETURNING id)"
        f" SELECT id, {_WAKE} FROM ins",
        {"id": run_id, "name": name, "args": args_json, "key": idempotency_key, "at": at, "after": after,
         "trace": trace_context},
    ).fetchone()
    if row is not None:
        return row[0], True
    existing = conn.execute(
        "SELECT id FROM everystep_workflow WHERE name = %s AND idempotency_key = %s",
        (name, idempotency_key),
    ).fetchone()
    if existing is None:
        # Only possible when the conflicting row is invisible to this
        # transaction's snapshot (REPEATABLE READ or SERIALIZABLE).
        raise psycopg.errors.SerializationFailure(
            f"a run with idempotency key {idempotency_key!r} exists but is not visible to this transaction"
        )
    return existing[0], False


def insert_runs(
    conn: psycopg.Connection, name: str, run_ids: list[uuid.UUID], args_jsons: list[str],
    idempotency_keys: list[str | None],
) -> list[tuple[uuid.UUID, bool]]:
    """Insert many scheduled runs of one workflow in one statement (one
    notification at most). Returns (id, created) in input order; a key that
    exists already, or repeats within the batch, gives the first run's id.
    The arrays go in binary (no array literal for the server to parse), and
    only the ids of created runs with a key come back."""
    p = "%b" if isinstance(conn, psycopg.Connection) else "%s"  # binary where psycopg 3 binds them
    keyed_created = conn.execute(
        "WITH ins AS ("
        " INSERT INTO everystep_workflow (id, name, args, idempotency_key, status)"
        f" SELECT id, {p}, args::jsonb, key, 'scheduled'"
        f" FROM unnest({p}::uuid[], {p}::text[], {p}::text[]) AS t(id, args, key)"
        " ON CONFLICT (name, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING"
        " RETURNING id, idempotency_key IS NOT NULL AS keyed)"
        f" SELECT ARRAY(SELECT id FROM ins WHERE keyed), {_WAKE}",
        (name, run_ids, args_jsons, idempotency_keys),
    ).fetchone()[0]
    if not keyed_created and all(key is None for key in idempotency_keys):
        return [(run_id, True) for run_id in run_ids]
    created = set(keyed_created)
    missing = [key for run_id, key in zip(run_ids, idempotency_keys) if key is not None and run_id not in created]
    existing = {}
    if missing:
        existing = dict(conn.execute(
            "SELECT idempotency_key, id FROM everystep_workflow WHERE name = %s AND idempotency_key = ANY(%s)",
            (name, missing),
        ).fetchall())
    runs = []
    for run_id, key in zip(run_ids, idempotency_keys):
        if key is None or run_id in created:
            runs.append((run_id, True))
        elif key in existing:
            runs.append((existing[key], False))
        else:
            # Only possible when the conflicting row is invisible to this
            # transaction's snapshot (REPEATABLE READ or SERIALIZABLE).
            raise psycopg.errors.SerializationFailure(
                f"a run with idempotency key {key!r} exists but is not visible to this transaction"
            )
    return runs


def wait_for_runs(conn: psycopg.Connection, runner: str) -> None:
    """Register a worker as waiting for runs (it has a free slot), so that
    scheduling transactions notify. Taking the wake lock exclusively waits
    for the scheduling transactions in flight: a claim after this returns
    sees their runs, and every later one sees the registration. Own
    transaction (the control connection is in autocommit)."""
    with conn.transaction():
        conn.execute(f"SELECT pg_advisory_xact_lock({_WAKE_LOCK})")
        conn.execute("INSERT INTO everystep_waiting (runner) VALUES (%s) ON CONFLICT DO NOTHING", (runner,))


def stop_waiting(conn: psycopg.Connection, runner: str) -> None:
    """The worker's slots are full: scheduling needs not wake it."""
    conn.execute("DELETE FROM everystep_waiting WHERE runner = %s", (runner,))


# ---------------------------------------------------------------- liveness

def try_lock(conn: psycopg.Connection, runner: str) -> bool:
    """Take the runner's session-level advisory lock if it is free."""
    return conn.execute(f"SELECT pg_try_advisory_lock({_LOCK_KEY})", (runner,)).fetchone()[0]


def unlock(conn: psycopg.Connection, runner: str) -> None:
    conn.execute(f"SELECT pg_advisory_unlock({_LOCK_KEY})", (runner,))


def prepare_session(conn: psycopg.Connection) -> None:
    """Make this session's commits wait for their WAL flush when the server,
    the role, the database or the URL turned that off: the engine's claims,
    step rows and run ends must be on disk before anyone acts on them (a
    claim lost to a server crash would let a second worker run the same step
    at the same time). Stronger settings (remote_apply, ...) are kept."""
    conn.execute(
        "SELECT set_config('synchronous_commit', 'on', false) WHERE current_setting('synchronous_commit') = 'off'"
    )


# The planner settings of the sessions that claim runs: a worker's control
# session, and its writer's (everystep.writer), which claims successors.
# Their claim statements (the CTEs of _PICK) take PostgreSQL 2-3 ms to plan,
# several times what they take to run, and under plan_cache_mode `auto` it
# plans them afresh at every execution: they are planned once (generic).
# A generic plan is made with the statistics of the moment, which may say
# that a few runs are claimable when thousands are: then fetching them all
# through a bitmap and sorting them looks cheaper than walking the ready index
# in order to the first unlocked one, and every claim pays for it. Without
# bitmap scans the index walk is the plan. (Turning sorts off instead makes
# the small sorts of _PICK's window functions look dear, with worse plans.)
_CLAIMING_SETTINGS = {"plan_cache_mode": "force_generic_plan", "enable_bitmapscan": "off"}


def prepare_claiming_session(conn: psycopg.Connection) -> None:
    conn.execute("SELECT " + ", ".join(f"set_config('{name}', '{value}', false)"
                                       for name, value in _CLAIMING_SETTINGS.items()))


def reset_claiming_session(conn: psycopg.Connection) -> None:
    """Back to the defaults, before the session goes back to a pool."""
    for name in _CLAIMING_SETTINGS:
        conn.execute(f"RESET {name}")


# Inside a transaction: its commit waits for the WAL flush (see prepare_session).
_DURABLE_TRANSACTION = (
    "SELECT set_config('synchronous_commit', 'on', true) WHERE current_setting('synchronous_commit') = 'off'"
)


class _TransactionPooledCursor(psycopg.Cursor):
    """Every statement outside a transaction runs in one of its own that
    starts by making its commit synchronous; no statement is prepared."""

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool | None = None) -> _TransactionPooledCursor:
        conn = self.connection
        if conn.autocommit and conn.info.transaction_status == pq.TransactionStatus.IDLE:
            with conn.transaction():
                super().execute(_DURABLE_TRANSACTION, prepare=False)
                return super().execute(query, params, prepare=False, binary=binary)
        return super().execute(query, params, prepare=False, binary=binary)


class TransactionPooledConnection(psycopg.Connection):
    """A connection through a pooler in transaction mode (PgBouncer's
    `pool_mode = transaction`): consecutive transactions may run on different
    server sessions, so nothing may rely on session state. No prepared
    statement (PgBouncer before 1.21 does not carry them across server
    sessions), and no session setting: each write sets synchronous_commit for
    its own transaction. The worker's pool uses it when the control session
    has a direct URL of its own."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.cursor_factory = _TransactionPooledCursor


def prepare_control_session(conn: psycopg.Connection, idle: int, interval: int, count: int) -> None:
    """Set up a worker's control connection (lock, LISTEN, claims, requeues).

    Server-side TCP keepalives make the server drop the session of a vanished
    host, and so free its lock, in seconds (no effect over a Unix socket).
    Its commits are synchronous like every engine session's (`prepare_session`),
    and it plans like a claiming session (`prepare_claiming_session`)."""
    user_timeout_ms = (idle + interval * count) * 1000
    conn.execute(
        "SELECT set_config('tcp_keepalives_idle', %s, false), set_config('tcp_keepalives_interval', %s, false),"
        " set_config('tcp_keepalives_count', %s, false), set_config('tcp_user_timeout', %s, false)",
        (str(idle), str(interval), str(count), str(user_timeout_ms)),
    )
    prepare_session(conn)
    prepare_claiming_session(conn)


def listen(conn: psycopg.Connection) -> str:
    """LISTEN for runs becoming claimable; returns the channel."""
    channel = "everystep:" + conn.execute("SELECT current_schema()").fetchone()[0]
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
    return channel


def ping(conn: psycopg.Connection) -> None:
    conn.execute("SELECT 1")


def running_claimers(conn: psycopg.Connection) -> list[str]:
    """Every distinct claimer of a running run."""
    return [
        row[0]
        for row in conn.execute(
            "SELECT DISTINCT claimed_by FROM everystep_workflow WHERE status = 'running' AND claimed_by IS NOT NULL"
        )
    ]


# ---------------------------------------------------------------- claiming

# A run and its recorded steps, as claimed (the steps as one JSON array).
# ARRAY(...) rather than json_agg: no aggregate to set up on every claim, and
# most claimed runs have no steps.
_RUN_WITH_STEPS = (
    "w.id, w.name, w.args, to_json(ARRAY(SELECT json_build_array(s.step_id, s.name, s.status, s.result, s.error,"
    " s.attempts) FROM everystep_step s WHERE s.workflow_id = w.id)), w.claim_token,"
    " w.cancel_requested_at IS NOT NULL, extract(epoch FROM now())::float8"
)


# Which claimable runs a claim takes, and the slots of limited workflows it
# takes with them: the CTEs `free` .. `picked` that end in `picked(id, slot,
# token)`, shared by `claim` and the successor claim of `finish_run`.
# Claimable runs are those of _CLAIMABLE, in _CLAIM_ORDER. The OFFSET 0 keeps
# the two (NOT) EXISTS tests subplans run per row: turned into joins, they
# let the planner (which cannot know that everystep_limit is small or empty)
# read and sort every claimable run instead of walking the ready index to the
# first unlocked entry. {gate}: a condition
# that must hold for anything to be picked; %(limit)s: how many runs at most;
# %(routes)s: LIKE patterns of the workflow names this claimer runs (NULL: all).
#
# A slot is free when its last run is not running in it any more. A claim
# that committed after this statement's snapshot was taken has written its
# newer token on the slot row: the row lock then re-checks the condition on
# that version, against the run as the snapshot shows it, whose token is
# older than the slot's (or NULL) — busy. The scalar subquery keeps the check
# a subplan re-evaluated on that recheck (an anti-join would not be). A
# claim locks no more free slots than it may claim runs, and only slots of
# workflows with claimable runs, so concurrent claims do not lock each other
# out of slots they could use. {own}: for the successor claim, the slot of
# the run this statement ends is free too (the snapshot still shows it running).
_PICK = (
    "free AS (SELECT s.name, s.slot FROM everystep_slot s"
    " WHERE {gate} ((SELECT count(*) FROM everystep_workflow h WHERE h.id = s.run_id"
    "  AND ((h.status = 'running' AND h.slot = s.slot) OR coalesce(h.claim_token, 0) < s.token)) = 0{own})"
    "  AND EXISTS (SELECT 1 FROM everystep_workflow w WHERE {claimable_of_slot} AND {routed}"
    "   OFFSET 0)"
    " LIMIT %(limit)s FOR UPDATE OF s SKIP LOCKED),"
    " room AS (SELECT name, count(*) AS n FROM free GROUP BY name),"
    " {unlimited},"
    " limited AS (SELECT w.id, w.name, w.due_at FROM room CROSS JOIN LATERAL"
    "  (SELECT w.id, w.name, w.due_at FROM everystep_workflow w"
    "   WHERE {claimable_of_room} AND {routed}"
    "   {claim_order} LIMIT least(room.n, %(limit)s) FOR UPDATE OF w SKIP LOCKED) w),"
    " ranked AS (SELECT id, name, due_at, row_number() OVER (PARTITION BY name ORDER BY due_at, id) AS k"
    "  FROM (SELECT * FROM unlimited UNION ALL SELECT * FROM limited) AS candidate),"
    " numbered AS (SELECT name, slot, row_number() OVER (PARTITION BY name ORDER BY slot) AS k FROM free),"
    " first AS (SELECT r.id, f.name AS slot_name, f.slot FROM ranked r"
    "  LEFT JOIN numbered f ON f.name = r.name AND f.k = r.k ORDER BY r.due_at, r.id LIMIT %(limit)s),"
    f" picked AS MATERIALIZED (SELECT id, slot_name, slot, {_NEW_TOKEN} AS token FROM first),"
    " took AS (UPDATE everystep_slot s SET run_id = p.id, token = p.token FROM picked p"
    "  WHERE s.name = p.slot_name AND s.slot = p.slot)"
)
# The claimable runs of workflows without a limit (part of _PICK, and all of
# _PICK_UNLIMITED).
_UNLIMITED = (
    "unlimited AS (SELECT w.id, w.name, w.due_at FROM everystep_workflow w"
    "  WHERE {gate} {claimable} AND {routed}"
    "  AND NOT EXISTS (SELECT 1 FROM everystep_limit l WHERE l.name = w.name OFFSET 0)"
    "  {claim_order} LIMIT %(limit)s FOR UPDATE OF w SKIP LOCKED)"
)
# _PICK for runs of unlimited workflows only: no slots, and a plan about half
# the size, which is what PostgreSQL sets up again at every execution.
_PICK_UNLIMITED = (
    _UNLIMITED + f", picked AS MATERIALIZED (SELECT id, NULL::varchar AS slot_name, NULL::integer AS slot,"
    f" {_NEW_TOKEN} AS token FROM unlimited)"
)
_ROUTED = "(%(routes)s::text[] IS NULL OR w.name LIKE ANY(%(routes)s::text[]))"
# Setting a picked run running under its new token and slot.
_TAKE_PICKED = (
    "UPDATE everystep_workflow w SET status = 'running', claimed_by = %(runner)s, claim_token = p.token,"
    " slot = p.slot FROM picked p WHERE w.id = p.id AND w.id = ANY(ARRAY(SELECT id FROM picked))"
)


def _pick(gate: str = "", own: str = "", unlimited_only: bool = False) -> str:
    """_PICK (or _PICK_UNLIMITED) with its shared parts filled in."""
    parts = {"gate": gate, "routed": _ROUTED, "claimable": _CLAIMABLE, "claim_order": _CLAIM_ORDER}
    if unlimited_only:
        return _PICK_UNLIMITED.format(**parts)
    return _PICK.format(own=own, unlimited=_UNLIMITED.format(**parts), **parts,
                        claimable_of_slot=_CLAIMABLE_OF.format(name="s.name"),
                        claimable_of_room=_CLAIMABLE_OF.format(name="room.name"))


_CLAIM = "WITH " + _pick() + " " + _TAKE_PICKED + f" RETURNING {_RUN_WITH_STEPS}"


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


def _array_literal(items: list | None) -> str | None:
    """An array literal of `items` (a None item: NULL; None: no array) for the
    hot statements' text parameters."""
    if items is None:
        return None
    return "{" + ",".join(
        "NULL" if item is None else '"' + str(item).replace("\\", "\\\\").replace('"', '\\"') + '"'
        for item in items
    ) + "}"


def claim(conn: psycopg.Connection, runner: str, limit: int, routes: list[str] | None = None) -> list[ClaimedRun]:
    """Claim up to `limit` scheduled runs, oldest first, with their recorded
    steps: of unlimited workflows, and of limited ones as far as they have
    free slots; only of workflows matching `routes` (LIKE patterns, see
    `routes_of`; None: all)."""
    rows = conn.execute(_CLAIM, {"runner": runner, "limit": limit, "routes": routes}, prepare=True).fetchall()
    runs = [ClaimedRun(*row) for row in rows]
    runs.sort(key=lambda r: r.id)  # UUIDv7: creation order
    return runs


def apply_limits(conn: psycopg.Connection, limits: dict[str, int | None]) -> None:
    """Write the concurrency limit of each workflow (None: no limit), in one
    transaction: its row and its slots 1..N. Lowering a limit drops the slots
    above it; a run still running in one finishes."""
    limited = {name: n for name, n in limits.items() if n is not None}
    with conn.transaction():
        conn.execute("DELETE FROM everystep_limit WHERE name = ANY(%s)",
                     ([name for name, n in limits.items() if n is None],))
        if not limited:
            return
        names, counts = list(limited), list(limited.values())
        conn.execute(
            "INSERT INTO everystep_limit (name, concurrency) SELECT * FROM unnest(%s::text[], %s::int[])"
            " ON CONFLICT (name) DO UPDATE SET concurrency = EXCLUDED.concurrency, updated_at = now()"
            " WHERE everystep_limit.concurrency <> EXCLUDED.concurrency",
            (names, counts),
        )
        conn.execute(
            "DELETE FROM everystep_slot s USING unnest(%s::text[], %s::int[]) AS l(name, n)"
            " WHERE s.name = l.name AND s.slot > l.n",
            (names, counts),
        )
        conn.execute(
            "INSERT INTO everystep_slot (name, slot) SELECT l.name, generate_series(1, l.n)"
            " FROM unnest(%s::text[], %s::int[]) AS l(name, n) ON CONFLICT DO NOTHING",
            (names, counts),
        )
        conn.execute(f"SELECT {_NOTIFY}")  # a raised limit may make runs claimable


def limits(conn: psycopg.Connection) -> dict[str, int]:
    """The concurrency limits in force, by workflow name."""
    return dict(conn.execute("SELECT name, concurrency FROM everystep_limit ORDER BY name").fetchall())


def reclaim_held(conn: psycopg.Connection, runner: str, executing: list[int] = ()) -> list[ClaimedRun]:
    """Claim again, with new tokens, the runs `running` under this runner's
    name that none of its live executions (`executing`: their tokens) holds:
    left by its previous incarnation, or claimed by a write whose answer was
    lost. Oldest first."""
    rows = conn.execute(
        f"UPDATE everystep_workflow w SET claim_token = {_NEW_TOKEN}"
        " WHERE w.status = 'running' AND w.claimed_by = %s"
        "  AND (w.claim_token IS NULL OR w.claim_token <> ALL(%s::bigint[]))"
        f" RETURNING {_RUN_WITH_STEPS}",
        (runner, list(executing)),
    ).fetchall()
    runs = [ClaimedRun(*row) for row in rows]
    runs.sort(key=lambda r: r.id)
    return runs


def held_claims(conn: psycopg.Connection, runner: str) -> list[Claim]:
    """The runs `running` under this runner's name, with their tokens."""
    return [Claim(*row) for row in conn.execute(
        "SELECT id, claim_token FROM everystep_workflow WHERE status = 'running' AND claimed_by = %s", (runner,)
    )]


def count_crashes(
    conn: psycopg.Connection, claimer: str, claims: list[Claim], max_crashes: int, poison_error: str
) -> list[uuid.UUID]:
    """Count one crash (a claim that ended with its worker dead) for each of
    these runs still held under `claimer` with the same token. The count
    restarts when the run recorded new steps since its last crash. Runs that
    reach `max_crashes` are failed with `poison_error`; returns them."""
    if not claims:
        return []
    ids, tokens = [c.id for c in claims], [c.token for c in claims]
    with conn.transaction():
        rows = conn.execute(
            "INSERT INTO everystep_crash (workflow_id, crashes, steps_seen)"
            " SELECT w.id, 1, (SELECT count(*) FROM everystep_step s WHERE s.workflow_id = w.id)"
            " FROM everystep_workflow w JOIN unnest(%s::uuid[], %s::bigint[]) AS c(id, token) ON w.id = c.id"
            " WHERE w.status = 'running' AND w.claimed_by = %s AND w.claim_token IS NOT DISTINCT FROM c.token"
            " ON CONFLICT (workflow_id) DO UPDATE SET"
            "  crashes = CASE WHEN everystep_crash.steps_seen = EXCLUDED.steps_seen"
            "            THEN everystep_crash.crashes + 1 ELSE 1 END,"
            "  steps_seen = EXCLUDED.steps_seen"
            " RETURNING workflow_id, crashes",
            (ids, tokens, claimer),
        ).fetchall()
        poisoned = [run_id for run_id, crashes in rows if crashes >= max_crashes]
        if not poisoned:
            return []
        failed = conn.execute(
            "UPDATE everystep_workflow SET status = 'failed', completed_at = now(), error = %s::jsonb"
            " WHERE id = ANY(%s) AND status = 'running' AND claimed_by = %s RETURNING id",
            (poison_error, poisoned, claimer),
        ).fetchall()
    return [row[0] for row in failed]


# ---------------------------------------------------------------- the hot path
#
# The two statements of every step and every end of a run go straight to
# libpq's PQexecPrepared, which releases the GIL for the whole round trip:
# psycopg's execute costs ~45 us of Python per statement here (a cursor,
# parameter adaptation, generators), about a tenth of all the CPU a step
# takes, and on a small machine the workers' CPU is taken from the database.
# The parameters are text or NULL; rows are read from their text.


class _Hot(NamedTuple):
    name: bytes  # of the prepared statement, on each connection that runs it
    sql: bytes  # with $1, $2, ... in the order of `params`
    params: tuple[str, ...]
    query: str  # with %(param)s, for connections that cannot keep a prepared statement


def _hot(name: str, query: str, params: tuple[str, ...]) -> _Hot:
    numbered = query
    for position, param in enumerate(params, 1):
        numbered = numbered.replace(f"%({param})s", f"${position}")
    return _Hot(f"everystep_{name}".encode(), numbered.encode(), params, query)


# The hot statements prepared on each connection (gone with the connection).
_prepared: weakref.WeakKeyDictionary[psycopg.Connection, set[bytes]] = weakref.WeakKeyDictionary()


def _run_hot(on: Executor, statement: _Hot, values: dict[str, Any]) -> pq.abc.PGresult:
    """Execute a hot statement, preparing it on first use on this connection."""
    conn = on.connection if isinstance(on, psycopg.Cursor) else on
    if isinstance(conn, TransactionPooledConnection):
        cursor = conn.cursor()
        cursor.execute(statement.query, {param: None if (value := values[param]) is None else str(value)
                                         for param in statement.params})
        return cursor.pgresult
    pgconn = conn.pgconn
    prepared = _prepared.setdefault(conn, set())
    params = [None if (value := values[param]) is None else str(value).encode() for param in statement.params]
    if statement.name not in prepared:
        _check(conn, pgconn.prepare(statement.name, statement.sql))
        prepared.add(statement.name)
    result = pgconn.exec_prepared(statement.name, params)
    if result.error_field(pq.DiagnosticField.SQLSTATE) == b"26000":
        # Deallocated: psycopg drops every prepared statement of a connection
        # after a ROLLBACK or a DISCARD ALL on it. Prepare it again.
        prepared.clear()
        return _run_hot(on, statement, values)
    return _check(conn, result)


def _check(conn: psycopg.Connection, result: pq.abc.PGresult) -> pq.abc.PGresult:
    if result.status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
        return result
    # The connection is lost (the server crashed or restarted under it): the
    # write is retried on another. libpq reports that without an SQLSTATE,
    # sometimes before it marks the connection bad.
    if conn.pgconn.status == pq.ConnStatus.BAD or result.error_field(pq.DiagnosticField.SQLSTATE) is None:
        raise errors.OperationalError(conn.pgconn.get_error_message(conn.info.encoding))
    raise errors.error_from_result(result, encoding=conn.info.encoding)


def _claimed_runs(on: Executor, result: pq.abc.PGresult, first_column: int) -> list[ClaimedRun]:
    """The runs in a result whose columns from `first_column` on are those of
    _RUN_WITH_STEPS (a NULL id: no run), read from their text."""
    encoding = (on.connection if isinstance(on, psycopg.Cursor) else on).info.encoding
    runs = []
    for row in range(result.ntuples):
        run_id, name, args, steps, token, cancel, now = (result.get_value(row, first_column + i) for i in range(7))
        if run_id is not None:
            runs.append(ClaimedRun(uuid.UUID(run_id.decode()), name.decode(encoding), json.loads(args.decode(encoding)),
                                   json.loads(steps.decode(encoding)), int(token), cancel == b"t", float(now)))
    return runs


# ---------------------------------------------------------------- writes about a held run (fenced)

class StepRow(NamedTuple):
    """A step row as the runner writes it: JSON as text, times as epoch seconds."""
    step_id: str
    name: str
    args: str
    kwargs: str
    status: str  # done, failed, or started (an unsafe step's mark)
    result: str | None
    error: str | None
    started_at: float
    finished_at: float | None  # None while `started`


class Written(NamedTuple):
    """A fenced step write went through; the run's row said whether a cancel
    is requested (learnt with the write, at no extra round trip)."""
    cancel_requested: bool


# The step columns of the hot statements, from parameters named after StepRow's fields.
_STEP_COLUMNS = "step_id, name, args, kwargs, status, result, error, claim_token, started_at, finished_at"
_STEP_VALUES = (
    "%(step_id)s, %(name)s, %(args)s::jsonb, %(kwargs)s::jsonb, %(status)s, %(result)s::jsonb, %(error)s::jsonb,"
    " claim_token, to_timestamp(%(started_at)s::float8), to_timestamp(%(finished_at)s::float8)"
)
def complete_started_step(conn: Executor, run: uuid.UUID, runner: str, token: int, row: StepRow) -> Written | bool:
    """Update a `started` (or `retrying`) step row in place with its outcome
    (the row may be an earlier execution's, when the unsafe mark was removed
    from the code); its recorded attempts stay."""
    found = conn.execute(
        "UPDATE everystep_step s SET name = %(name)s, args = %(args)s::jsonb, kwargs = %(kwargs)s::jsonb,"
        " status = %(status)s, result = %(result)s::jsonb, error = %(error)s::jsonb, claim_token = w.claim_token,"
        " started_at = to_timestamp(%(started_at)s::float8), finished_at = to_timestamp(%(finished_at)s::float8)"
        " FROM (SELECT id, claim_token, cancel_requested_at FROM everystep_workflow WHERE " + _HELD + " FOR SHARE) w"
        " WHERE s.workflow_id = w.id AND s.step_id = %(step_id)s AND s.status IN ('started', 'retrying')"
        " RETURNING w.cancel_requested_at IS NOT NULL",
        {"run": run, "runner": runner, "token": token, **row._asdict()},
        prepare=True,
    ).fetchone()
    return False if found is None else Written(found[0])


class Attempt(NamedTuple):
    cancel_requested: bool
    attempt: dict  # {"attempt": n, "error": {...}, "at": epoch, "retry_at": epoch}, database time


def record_attempt(conn: Executor, run: uuid.UUID, runner: str, token: int, row: StepRow, attempt: int,
                   wait: float) -> Attempt | bool:
    """Record failed attempt number `attempt` (its error in `row.error`) of a
    step that is tried again after `wait` seconds: the step's row is
    `retrying` (inserted, or updated from an earlier attempt's `retrying` or
    an unsafe step's `started`) and the attempt, timed by the database's
    clock, is appended to its attempts. False if the run is not held by this
    execution, or the row holds an outcome or this attempt already."""
    found = conn.execute(
        "WITH w AS (SELECT id, claim_token, cancel_requested_at FROM everystep_workflow WHERE " + _HELD + " FOR SHARE),"
        " a AS (SELECT jsonb_build_object('attempt', %(attempt)s::int, 'error', %(error)s::jsonb,"
        "  'at', extract(epoch FROM now()), 'retry_at', extract(epoch FROM now()) + %(wait)s::float8) AS attempt)"
        f" INSERT INTO everystep_step AS s (workflow_id, {_STEP_COLUMNS}, attempts)"
        f" SELECT id, {_STEP_VALUES}, jsonb_build_array(a.attempt) FROM w, a"
        " ON CONFLICT (workflow_id, step_id) DO UPDATE SET status = 'retrying', attempts = coalesce(s.attempts, '[]')"
        "  || EXCLUDED.attempts, error = EXCLUDED.error, claim_token = EXCLUDED.claim_token,"
        "  started_at = EXCLUDED.started_at, finished_at = EXCLUDED.finished_at"
        " WHERE s.status IN ('retrying', 'started')"
        "  AND NOT coalesce(s.attempts, '[]') @> jsonb_build_array(jsonb_build_object('attempt', %(attempt)s::int))"
        " RETURNING (SELECT cancel_requested_at IS NOT NULL FROM w), (SELECT attempt FROM a)",
        {"run": run, "runner": runner, "token": token, "attempt": attempt, "wait": wait, **row._asdict()},
    ).fetchone()
    return False if found is None else Attempt(found[0], found[1])


def cancel_reason(conn: Executor, run: uuid.UUID) -> str | None:
    """The reason given with a run's cancel request."""
    row = conn.execute("SELECT cancel_reason FROM everystep_workflow WHERE id = %s", (run,)).fetchone()
    return None if row is None else row[0]


def step_row(conn: Executor, run: uuid.UUID, step_id: str) -> tuple | None:
    """(name, status) of one recorded step, or None."""
    return conn.execute(
        "SELECT name, status FROM everystep_step WHERE workflow_id = %s AND step_id = %s", (run, step_id)
    ).fetchone()


# Why a fenced write matched nothing (see why_not_written).
WRITTEN = "written"  # this execution's own earlier attempt wrote it (its answer was lost)
LOST = "lost"  # the run is not held by this execution any more
OTHER = "other"  # the run is held, but the row was written by another execution


def why_not_written(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str | None,
                    status: str) -> str:
    """Explain a fenced write that matched nothing: WRITTEN, LOST or OTHER.
    For a step (`step_id`): whether its row with `status` is this execution's
    own; for the end of the run (`step_id` None): whether this execution ended
    it with `status`."""
    if step_id is None:
        # The end of a run with a cancel request is `cancelled`, whatever status it was asked for.
        row = conn.execute(
            "SELECT status = %s OR status = 'cancelled', status = 'running' FROM everystep_workflow"
            " WHERE id = %s AND claimed_by = %s AND claim_token = %s",
            (status, run, runner, token),
        ).fetchone()
        return WRITTEN if row and row[0] else OTHER if row and row[1] else LOST
    row = conn.execute(
        f"SELECT EXISTS (SELECT 1 FROM everystep_workflow WHERE {_HELD}),"
        " (SELECT claim_token = %(token)s AND status = %(status)s FROM everystep_step"
        "  WHERE workflow_id = %(run)s AND step_id = %(step_id)s)",
        {"run": run, "runner": runner, "token": token, "step_id": step_id, "status": status},
    ).fetchone()
    held, mine = row
    return WRITTEN if mine else OTHER if held else LOST


# ---------------------------------------------------------------- group commit
# The step rows and run ends of many executions of one runner (every run
# thread of a worker process) in one statement and one commit: see
# everystep.writer. Each row is fenced by its own execution's token; a row
# whose fence fails is reported to its own execution only.

class StepWrite(NamedTuple):
    run: uuid.UUID
    token: int
    row: StepRow


class EndWrite(NamedTuple):
    run: uuid.UUID
    token: int
    status: str
    result: str | None
    error: str | None
    last_step: StepRow | None
    claim: bool  # claim a successor for the slot this end frees


class BatchEnd(NamedTuple):
    status: str | None  # the run's end as written; None: not written (see why_not_written)
    step_exists: bool  # not written because its last step's row is there already
    successor: ClaimedRun | None  # claimed for this slot (it is this execution's to run, even if status is None)


# The SET clause that ends a run. A cancel request that reached the row
# before the end wins over every other end: the run is `cancelled` (what
# the body returned or raised is kept in result/error).
_ENDING = (
    "status = CASE WHEN w.cancel_requested_at IS NULL THEN h.status ELSE 'cancelled' END,"
    " result = h.result::jsonb, error = h.error::jsonb,"
    " completed_at = CASE WHEN h.status = 'blocked' AND w.cancel_requested_at IS NULL THEN NULL ELSE now() END"
)

# The input rows of a batch: one per write, numbered n = 1, 2, ... in order.
_BATCH_STEP_ARRAYS = (
    "%(step_id)s::text[], %(name)s::text[], %(args)s::text[], %(kwargs)s::text[], %(status)s::text[],"
    " %(result)s::text[], %(error)s::text[], %(started_at)s::float8[], %(finished_at)s::float8[]"
)
_BATCH_STEP_NAMES = "step_id, step_name, args, kwargs, step_status, step_result, step_error, started_at, finished_at"
# A step row's values from a batch's input row `i`, with its execution's token.
_BATCH_STEP_VALUES = (
    "i.step_id, i.step_name, i.args::jsonb, i.kwargs::jsonb, i.step_status, i.step_result::jsonb,"
    " i.step_error::jsonb, i.token, to_timestamp(i.started_at), to_timestamp(i.finished_at)"
)

# Step rows of several runs, each fenced by its own execution's token (the
# FOR SHARE of its run row keeps a requeue and the write from both winning);
# returns the input rows written, with the cancel request seen on their run.
_RECORD_STEPS = (
    "WITH i AS (SELECT * FROM unnest(%(runs)s::uuid[], %(tokens)s::bigint[], " + _BATCH_STEP_ARRAYS + ")"
    "  WITH ORDINALITY AS i(run, token, " + _BATCH_STEP_NAMES + ", n)),"
    " w AS (SELECT id, claim_token, cancel_requested_at FROM everystep_workflow"
    f"  WHERE id = ANY(%(runs)s::uuid[]) AND {_RUNNING.format(table='')} AND claimed_by = %(runner)s FOR SHARE),"
    f" ins AS (INSERT INTO everystep_step (workflow_id, {_STEP_COLUMNS})"
    f"  SELECT i.run, {_BATCH_STEP_VALUES} FROM i JOIN w ON w.id = i.run AND w.claim_token = i.token"
    "  ON CONFLICT (workflow_id, step_id) DO NOTHING RETURNING workflow_id, step_id)"
    " SELECT i.n, w.cancel_requested_at IS NOT NULL FROM ins JOIN i ON i.run = ins.workflow_id"
    "  AND i.step_id = ins.step_id JOIN w ON w.id = i.run"
)

# Ending several runs, each fenced by its own token, each with the row of its
# last step when it has one (not ended if that row is there already), and
# claiming one successor per ended run that asks for one (the CTEs of _PICK,
# gated and counted by `held`: the runs this statement's snapshot shows held
# by their executions). The claim runs first, before the ending UPDATE can
# wait on a row lock: a snapshot grown stale in such a wait would make the
# claim lock runs other claimers took meanwhile, and hold those locks to the
# commit (a failed recheck keeps its lock), stalling their ends in turn.
# Rows: ('c', claimed run...) for the successors; ('h', n) for the ends that
# asked for one, in order (the successors are theirs in that order); ('e', n,
# status) for the ends written; ('s', n) for ends whose last step's row exists.
_BATCH_RUN = "NULL::uuid, NULL::varchar, NULL::jsonb, NULL::json, NULL::bigint, NULL::boolean, NULL::float8"


def _end_runs(unlimited_only: bool) -> str:
    """_END_RUNS; `unlimited_only`: successors of unlimited workflows only
    (_PICK_UNLIMITED), with a row ('l') when a limited workflow has runs to
    claim, for which the caller goes back to the whole statement."""
    return (
        "WITH i AS (SELECT * FROM unnest(%(runs)s::uuid[], %(tokens)s::bigint[], %(statuses)s::text[],"
        "  %(results)s::text[], %(errors)s::text[], %(claims)s::boolean[], " + _BATCH_STEP_ARRAYS + ")"
        "  WITH ORDINALITY AS i(run, token, status, result, error, claim, " + _BATCH_STEP_NAMES + ", n)),"
        " fenced AS MATERIALIZED (SELECT i.*, w.name AS workflow, w.slot, i.step_id IS NOT NULL AND EXISTS (SELECT 1"
        "  FROM everystep_step s WHERE s.workflow_id = i.run AND s.step_id = i.step_id) AS step_exists"
        "  FROM i JOIN everystep_workflow w ON w.id = i.run"
        f"  WHERE w.id = ANY(%(runs)s::uuid[]) AND {_RUNNING.format(table='w.')} AND w.claimed_by = %(runner)s"
        "  AND w.claim_token = i.token),"
        " held AS (SELECT * FROM fenced WHERE NOT step_exists), "
        + _pick(gate="EXISTS (SELECT 1 FROM held WHERE held.claim) AND",
                own=" OR EXISTS (SELECT 1 FROM held WHERE held.workflow = s.name AND held.slot = s.slot)",
                unlimited_only=unlimited_only,
                ).replace("%(limit)s", "(SELECT count(*) FROM held WHERE held.claim)")
        + ", claimed AS (" + _TAKE_PICKED + f" RETURNING {_RUN_WITH_STEPS}),"
        f" ended AS (UPDATE everystep_workflow w SET {_ENDING}"
        f"  FROM held h WHERE w.id = h.run AND w.id = ANY(%(runs)s::uuid[]) AND {_RUNNING.format(table='w.')}"
        "  AND w.claimed_by = %(runner)s"
        "  AND w.claim_token = h.token RETURNING h.n, w.id, w.status, w.name, w.slot, w.parent_id),"
        f" step AS (INSERT INTO everystep_step (workflow_id, {_STEP_COLUMNS})"
        f"  SELECT i.run, {_BATCH_STEP_VALUES} FROM ended JOIN i USING (n) WHERE i.step_id IS NOT NULL"
        "  ON CONFLICT (workflow_id, step_id) DO NOTHING),"
        # Children that ended wake their parents; a parent parked on one of them is due.
        " woke AS (UPDATE everystep_workflow p SET wakes = p.wakes + 1, due_at = CASE"
        "  WHEN p.status = 'waiting' AND p.waiting_on = ANY(e.waits) THEN now() ELSE p.due_at END"
        "  FROM (SELECT parent_id, array_agg('child:' || id) AS waits FROM ended WHERE parent_id IS NOT NULL"
        "   GROUP BY parent_id) e WHERE p.id = e.parent_id"
        "  RETURNING p.status = 'waiting' AND p.waiting_on = ANY(e.waits) AS due)"
        " SELECT 'c', NULL::bigint, NULL::text, claimed.* FROM claimed"
        f" UNION ALL SELECT 'h', n, NULL, {_BATCH_RUN} FROM held WHERE claim"
        f" UNION ALL SELECT 'e', n, status, {_BATCH_RUN} FROM ended"
        f" UNION ALL SELECT 's', n, NULL, {_BATCH_RUN} FROM fenced WHERE step_exists"
        # A limited run that ended freed a slot no successor took, or a parent became due: wake the claimers.
        f" UNION ALL SELECT 'n', NULL, ({_NOTIFY})::text, {_BATCH_RUN}"
        "  WHERE EXISTS (SELECT FROM ended WHERE ended.slot IS NOT NULL AND NOT EXISTS (SELECT FROM picked"
        "   WHERE picked.slot_name = ended.name AND picked.slot = ended.slot))"
        "  OR EXISTS (SELECT FROM woke WHERE due)"
        + (f" UNION ALL SELECT 'l', NULL, NULL, {_BATCH_RUN} WHERE EXISTS (SELECT 1 FROM everystep_limit l"
           f"  WHERE EXISTS (SELECT 1 FROM everystep_workflow w WHERE {_CLAIMABLE_OF.format(name='l.name')}"
           f"  AND {_ROUTED} OFFSET 0))" if unlimited_only else "")
    )


_END_RUNS = _end_runs(unlimited_only=False)
_RECORD_STEPS_HOT = _hot("record_steps", _RECORD_STEPS, (
    "runs", "tokens", "runner", *StepRow._fields))
_END_RUNS_PARAMS = ("runs", "tokens", "statuses", "results", "errors", "claims", "runner", "routes", *StepRow._fields)
_END_RUNS_HOT = _hot("end_runs", _END_RUNS, _END_RUNS_PARAMS)
_END_UNLIMITED_RUNS_HOT = _hot("end_unlimited_runs", _end_runs(unlimited_only=True), _END_RUNS_PARAMS)


def _step_columns(rows: list[StepRow | None]) -> dict[str, str]:
    """The columns of step rows as array parameters (None rows: all NULL)."""
    return {field: _array_literal([None if row is None else row[i] for row in rows])
            for i, field in enumerate(StepRow._fields)}


def record_steps(conn: psycopg.Connection, runner: str, steps: list[StepWrite]) -> list[Written | bool]:
    """Write step rows of `runner`'s executions in one statement: for each,
    Written, or False (not held by its execution, or the row exists)."""
    result = _run_hot(conn, _RECORD_STEPS_HOT, {
        "runs": _array_literal([w.run for w in steps]), "tokens": _array_literal([w.token for w in steps]),
        "runner": runner, **_step_columns([w.row for w in steps])})
    seen = {int(result.get_value(i, 0)): result.get_value(i, 1) == b"t" for i in range(result.ntuples)}
    return [Written(seen[n]) if n in seen else False for n in range(1, len(steps) + 1)]


class EndedRuns(NamedTuple):
    finished: list[BatchEnd]  # for each end
    limited_waiting: bool  # (unlimited_only) a limited workflow has runs to claim: use the whole claim


def end_runs(conn: psycopg.Connection, runner: str, ends: list[EndWrite], routes: list[str] | None,
             unlimited_only: bool = False) -> EndedRuns:
    """End runs of `runner`'s executions in one statement, claiming their
    successors. `routes`: the workflows a successor may be of (see `claim`);
    `unlimited_only`: of workflows without a concurrency limit only (a
    smaller statement, see _end_runs)."""
    result = _run_hot(conn, _END_UNLIMITED_RUNS_HOT if unlimited_only else _END_RUNS_HOT, {
        "runs": _array_literal([e.run for e in ends]), "tokens": _array_literal([e.token for e in ends]),
        "statuses": _array_literal([e.status for e in ends]), "results": _array_literal([e.result for e in ends]),
        "errors": _array_literal([e.error for e in ends]),
        "claims": _array_literal(["t" if e.claim else "f" for e in ends]), "runner": runner,
        "routes": _array_literal(routes), **_step_columns([e.last_step for e in ends])})
    successors = _claimed_runs(conn, result, first_column=3)
    receivers, statuses, exists, limited_waiting = [], {}, set(), False
    for i in range(result.ntuples):
        kind = result.get_value(i, 0)
        if kind == b"h":
            receivers.append(int(result.get_value(i, 1)))
        elif kind == b"e":
            statuses[int(result.get_value(i, 1))] = result.get_value(i, 2).decode()
        elif kind == b"s":
            exists.add(int(result.get_value(i, 1)))
        elif kind == b"l":
            limited_waiting = True
    successors.sort(key=lambda r: r.id)  # UUIDv7: the oldest to the first asking
    given = dict(zip(sorted(receivers), successors))
    return EndedRuns([BatchEnd(statuses.get(n), n in exists, given.get(n)) for n in range(1, len(ends) + 1)],
                     limited_waiting)


def record_step(conn: psycopg.Connection, run: uuid.UUID, runner: str, token: int, row: StepRow) -> Written | bool:
    """Record one step's outcome (`done`/`failed`), or the `started` mark of
    an unsafe-to-repeat step, with the token of the execution that wrote it:
    record_steps with one step. The unique (workflow, step_id) makes this
    insert the claim on the step: False if the run is not held by this
    execution or the row exists."""
    return record_steps(conn, runner, [StepWrite(run, token, row)])[0]


class Ended(NamedTuple):
    status: str  # the run's end as written: `cancelled` when a cancel request was on the row
    claimed: list[ClaimedRun]  # the successor claimed for the slot, if any


def finish_run(
    conn: psycopg.Connection, run: uuid.UUID, runner: str, token: int, status: str, result: str | None,
    error: str | None, last_step: StepRow | None = None, claim: bool = False, routes: list[str] | None = None,
) -> Ended | None:
    """End one held run (completed/failed/stopped/blocked, or cancelled) with
    the row of its last step when that is not written yet and, with `claim`,
    claim the next run for the slot it frees: end_runs with one end.
    Returns the end and the runs claimed, or None if the run was not held by
    this execution (nothing was written). Raises UniqueViolation (nothing
    written) if the last step's row exists already. `routes`: as for `claim`."""
    (end,) = end_runs(conn, runner, [EndWrite(run, token, status, result, error, last_step, claim)],
                      routes).finished
    if end.step_exists:
        raise errors.UniqueViolation(f"step {last_step.step_id!r} of run {run} exists already")
    if end.status is None:
        return None
    return Ended(end.status, [end.successor] if end.successor else [])


# Counting one more traced execution of a held run, and reading the trace
# context it continues: only with tracing on.
_START_TRACED_EXECUTION = _hot("start_traced_execution", (
    "UPDATE everystep_workflow SET trace_context = jsonb_set(coalesce(trace_context, '{}'), '{executions}',"
    "  to_jsonb(coalesce((trace_context->>'executions')::integer, 0) + 1))"
    f" WHERE {_HELD} RETURNING trace_context::text"
), ("run", "runner", "token"))


def start_traced_execution(conn: Executor, run: uuid.UUID, runner: str, token: int) -> tuple[dict, int] | None:
    """Count one more traced execution of a held run and return (its stored
    trace context, the number of this execution), or None if the run is not
    held by this execution. On the hot path's libpq calls: it comes with every
    traced execution."""
    result = _run_hot(conn, _START_TRACED_EXECUTION, {"run": run, "runner": runner, "token": token})
    if result.ntuples == 0:
        return None
    stored = json.loads(result.get_value(0, 0).decode())
    return stored, stored["executions"]


def requeue_held(conn: Executor, runner: str, claims: list[Claim]) -> list[uuid.UUID]:
    """Put runs held by these executions of `runner` back to `scheduled`
    (drain, a dead claimer's runs); returns those that matched."""
    rows = conn.execute(
        "WITH q AS (UPDATE everystep_workflow w SET status = 'scheduled', claimed_by = NULL"
        " FROM unnest(%s::uuid[], %s::bigint[]) AS c(id, token)"
        " WHERE w.id = c.id AND w.status = 'running' AND w.claimed_by = %s"
        "  AND w.claim_token IS NOT DISTINCT FROM c.token RETURNING w.id)"
        f" SELECT id, {_NOTIFY} FROM q",
        ([c.id for c in claims], [c.token for c in claims], runner),
    ).fetchall()
    return [row[0] for row in rows]


def requeue_claimer(conn: psycopg.Connection, claimer: str) -> list[uuid.UUID]:
    """Requeue every running run of a claimer whose lock the caller holds and
    none of whose executions can write any more (a worker's own shutdown)."""
    rows = conn.execute(
        "WITH q AS (UPDATE everystep_workflow SET status = 'scheduled', claimed_by = NULL"
        " WHERE status = 'running' AND claimed_by = %s RETURNING id)"
        f" SELECT id, {_NOTIFY} FROM q",
        (claimer,),
    ).fetchall()
    return [row[0] for row in rows]


# ---------------------------------------------------------------- time

def next_due_in(conn: psycopg.Connection) -> float | None:
    """Seconds until the earliest waiting run becomes due, by the database's
    clock (<= 0: one is due now), or None when nothing waits. A min() on the
    claim's index: one index probe."""
    row = conn.execute(
        "SELECT extract(epoch FROM min(due_at) - now()) FROM everystep_workflow"
        " WHERE status IN ('scheduled', 'waiting') AND due_at > now()",
        prepare=True,
    ).fetchone()
    return None if row[0] is None else float(row[0])


class Sleep(NamedTuple):
    wake_at: float  # epoch seconds, database time
    now: float  # the database's time of the write


def record_sleep(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str,
                 seconds: float | None, until: datetime.datetime | None) -> Sleep | bool:
    """Record a durable sleep as the step row `step_id` (status done), its
    result the wake time: `until`, or `seconds` from now by the database's
    clock. False if not held by this execution or the row exists."""
    found = conn.execute(
        "WITH w AS (SELECT id, claim_token FROM everystep_workflow WHERE " + _HELD + " FOR SHARE),"
        " wake AS (SELECT extract(epoch FROM coalesce(%(until)s::timestamptz,"
        "  now() + make_interval(secs => %(seconds)s::float8))) AS at),"
        " ins AS (INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,"
        "  started_at, finished_at)"
        "  SELECT w.id, %(step_id)s, %(name)s, '[]', '{}', 'done', to_jsonb(wake.at), w.claim_token, now(), now()"
        "  FROM w, wake ON CONFLICT (workflow_id, step_id) DO NOTHING RETURNING 1)"
        " SELECT wake.at, extract(epoch FROM now()) FROM ins, wake",
        {"run": run, "runner": runner, "token": token, "step_id": step_id, "name": name, "seconds": seconds,
         "until": until},
    ).fetchone()
    return False if found is None else Sleep(float(found[0]), float(found[1]))


class Parking(NamedTuple):
    parked: bool  # the run is `waiting` until its due time; this execution is over
    cancel_requested: bool  # not parked: a cancel request is on the run
    # neither: the time has come already (by the database's clock)


def park_run(conn: Executor, run: uuid.UUID, runner: str, token: int, due_at: float) -> Parking | bool:
    """End this execution of a held run and leave it `waiting` until `due_at`
    (epoch seconds), claimed by nobody, and wake the workers to recompute
    their next due time — unless the time has come already or a cancel is
    requested (then nothing changes; Parking says which). One statement.
    False if the run is not held by this execution."""
    found = conn.execute(
        "WITH w AS (SELECT id, cancel_requested_at IS NOT NULL AS cancel,"
        "  to_timestamp(%(due)s::float8) > now() AS later FROM everystep_workflow WHERE " + _HELD + " FOR UPDATE),"
        " p AS (UPDATE everystep_workflow r SET status = 'waiting', claimed_by = NULL,"
        "  due_at = to_timestamp(%(due)s::float8) FROM w WHERE r.id = w.id AND w.later AND NOT w.cancel RETURNING 1)"
        f" SELECT EXISTS (SELECT FROM p), w.cancel, {_NOTIFY} FROM w",
        {"run": run, "runner": runner, "token": token, "due": due_at},
    ).fetchone()
    return False if found is None else Parking(found[0], found[1])


# ---------------------------------------------------------------- messages and events

class Sent(NamedTuple):
    status: str | None  # the run's status; None: no such run
    created: bool  # this call stored the message (False: terminal run, or the key sent it already)


def send_message(conn: Executor, run: uuid.UUID, topic: str, payload: str, key: str | None) -> Sent:
    """Insert a message for a run into the caller's transaction, unless the
    run has ended (or the same idempotency key sent one already); count it on
    the run, and make the run due at once if it is parked waiting for this
    topic (the notification goes out at commit)."""
    row = conn.execute(
        "WITH run AS (SELECT id, status FROM everystep_workflow WHERE id = %(run)s),"
        " ins AS (INSERT INTO everystep_message (run_id, topic, payload, idempotency_key)"
        "  SELECT id, %(topic)s, %(payload)s::jsonb, %(key)s FROM run WHERE status NOT IN"
        f"  ({', '.join(repr(t) for t in TERMINAL)})"
        "  ON CONFLICT (run_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING 1),"
        " woke AS (UPDATE everystep_workflow w SET wakes = wakes + 1,"
        "  due_at = CASE WHEN status = 'waiting' AND waiting_on = %(on)s THEN now() ELSE due_at END"
        "  WHERE w.id = %(run)s AND EXISTS (SELECT FROM ins)"
        "  RETURNING status = 'waiting' AND waiting_on = %(on)s AS due)"
        f" SELECT (SELECT status FROM run), EXISTS (SELECT FROM ins), (SELECT {_NOTIFY} FROM woke WHERE due)",
        {"run": run, "topic": topic, "payload": payload, "key": key, "on": f"message:{topic}"},
    ).fetchone()
    return Sent(row[0], row[1])


class Wait(NamedTuple):
    """The answer of a fenced write about a wait (truthy: the run is held)."""
    result: Any  # the wait's recorded result (JSON data), None while nothing came
    wakes: int  # the run's message count as this statement saw it
    now: float  # the database's time (epoch seconds)


# The wait's step row: `started` (result {"topic", "deadline"}) until its
# outcome, then `done` with {"message": payload} or {"timeout": true}.
def begin_wait(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str, topic: str,
               timeout: float | None) -> Wait | bool:
    """Record the start of a wait: its deadline (`timeout` seconds from now by
    the database's clock; None: none) in a `started` step row. False if the
    run is not held by this execution or the row exists."""
    row = conn.execute(
        "WITH w AS (SELECT id, claim_token FROM everystep_workflow WHERE " + _HELD + " FOR SHARE),"
        " r AS (SELECT jsonb_build_object('topic', %(topic)s::text, 'deadline',"
        "  extract(epoch FROM now()) + %(timeout)s::float8) AS result),"
        " ins AS (INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,"
        "  started_at) SELECT w.id, %(step_id)s, %(name)s, '[]', '{}', 'started', r.result, w.claim_token, now()"
        "  FROM w, r ON CONFLICT (workflow_id, step_id) DO NOTHING RETURNING result)"
        " SELECT (SELECT result FROM ins), extract(epoch FROM now()) FROM ins",
        {"run": run, "runner": runner, "token": token, "step_id": step_id, "name": name, "topic": topic,
         "timeout": timeout},
    ).fetchone()
    return False if row is None else Wait(row[0], 0, float(row[1]))


# How a wait's statement ends, once its `outcome` CTE says what came (NULL:
# nothing yet): the started step row gets it, and the run stops waiting.
_END_WAIT = (
    " done AS (UPDATE everystep_step s SET status = 'done', result = outcome.result, finished_at = now(),"
    "  claim_token = w.claim_token FROM w, outcome WHERE s.workflow_id = w.id AND s.step_id = %(step_id)s"
    "  AND s.status = 'started' AND outcome.result IS NOT NULL RETURNING s.result),"
    " cleared AS (UPDATE everystep_workflow SET waiting_on = NULL"
    "  WHERE id = %(run)s AND waiting_on IS NOT NULL AND EXISTS (SELECT FROM done))"
    " SELECT (SELECT result FROM done), (SELECT wakes FROM seen), extract(epoch FROM now()) FROM w"
)


def take_message(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, topic: str,
                 deadline: float | None) -> Wait | bool:
    """End a started wait if it can end: with the oldest message on its topic
    not consumed yet (marked consumed by this wait), or with a timeout once
    `deadline` (epoch seconds, database time) has passed; the run's
    `waiting_on` is cleared. Else nothing changes (result None) and `wakes`
    says how many messages the run had been sent as of this statement's
    snapshot, the one it found no message in. False if not held."""
    row = conn.execute(
        "WITH w AS (SELECT id, claim_token FROM everystep_workflow WHERE " + _HELD + " FOR SHARE),"
        " seen AS (SELECT wakes FROM everystep_workflow WHERE id = %(run)s),"  # the snapshot's, unlocked
        " m AS (SELECT id, payload FROM everystep_message WHERE run_id = %(run)s AND topic = %(topic)s"
        "  AND consumed_by IS NULL AND EXISTS (SELECT FROM w) ORDER BY id LIMIT 1 FOR UPDATE),"
        " taken AS (UPDATE everystep_message x SET consumed_by = %(step_id)s, consumed_at = now() FROM m"
        "  WHERE x.id = m.id RETURNING m.payload),"
        " outcome AS (SELECT CASE WHEN EXISTS (SELECT FROM taken) THEN"
        "  jsonb_build_object('message', (SELECT payload FROM taken))"
        "  WHEN now() >= to_timestamp(%(deadline)s::float8) THEN '{\"timeout\": true}'::jsonb END AS result),"
        + _END_WAIT,
        {"run": run, "runner": runner, "token": token, "step_id": step_id, "topic": topic, "deadline": deadline},
    ).fetchone()
    return False if row is None else Wait(row[0], int(row[1]), float(row[2]))


def start_child(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str, child: uuid.UUID,
                child_name: str, args: str) -> Any:
    """Record the start of a child run as a step row (result {"child": id})
    and schedule the child (`parent_id` = this run), in one statement: the
    child exists only if the row was written here. Returns the recorded
    result, or False if the run is not held by this execution or the row
    exists."""
    row = conn.execute(
        "WITH w AS (SELECT id, claim_token FROM everystep_workflow WHERE " + _HELD + " FOR SHARE),"
        " ins AS (INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,"
        "  started_at, finished_at) SELECT w.id, %(step_id)s, %(name)s, jsonb_build_array(%(child_name)s::text),"
        "  '{}', 'done', jsonb_build_object('child', %(child)s::text), w.claim_token, now(), now() FROM w"
        "  ON CONFLICT (workflow_id, step_id) DO NOTHING RETURNING workflow_id, result),"
        " child AS (INSERT INTO everystep_workflow (id, name, args, status, parent_id)"
        "  SELECT %(child)s, %(child_name)s, %(args)s::jsonb, 'scheduled', workflow_id FROM ins RETURNING id)"
        f" SELECT ins.result, {_NOTIFY} FROM ins, child",
        {"run": run, "runner": runner, "token": token, "step_id": step_id, "name": name, "child": child,
         "child_name": child_name, "args": args},
    ).fetchone()
    return False if row is None else row[0]


def take_child(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, child: uuid.UUID,
               deadline: float | None) -> Wait | bool:
    """End a started wait for a child run if it can end: with the child's end
    ({"status", "result", "error"}) once the child has ended, or with a
    timeout once `deadline` has passed; the run's `waiting_on` is cleared.
    Else nothing changes (result None); `wakes` as for `take_message`.
    False if not held."""
    row = conn.execute(
        "WITH w AS (SELECT id, claim_token FROM everystep_workflow WHERE " + _HELD + " FOR SHARE),"
        " seen AS (SELECT wakes FROM everystep_workflow WHERE id = %(run)s),"
        " c AS (SELECT status, result, error FROM everystep_workflow WHERE id = %(child)s),"
        " outcome AS (SELECT CASE WHEN c.status IN ("
        f"  {', '.join(repr(t) for t in TERMINAL)}) THEN"
        "  jsonb_build_object('status', c.status, 'result', c.result, 'error', c.error)"
        "  WHEN now() >= to_timestamp(%(deadline)s::float8) THEN '{\"timeout\": true}'::jsonb END AS result"
        "  FROM (SELECT) AS one LEFT JOIN c ON true),"
        + _END_WAIT,
        {"run": run, "runner": runner, "token": token, "step_id": step_id, "child": child, "deadline": deadline},
    ).fetchone()
    return False if row is None else Wait(row[0], int(row[1]), float(row[2]))


def children(conn: psycopg.Connection, run: uuid.UUID) -> list[dict]:
    """The runs a run started, oldest first."""
    return _dicts(conn.execute(
        "SELECT id, name, status, created_at, completed_at FROM everystep_workflow WHERE parent_id = %s"
        " ORDER BY created_at, id", (run,),
    ))


def park_waiting(conn: Executor, run: uuid.UUID, runner: str, token: int, due_at: float | None, waiting_on: str,
                 wakes: int) -> Parking | bool:
    """End this execution of a held run and leave it `waiting` for
    `waiting_on` until `due_at` (None: for ever), claimed by nobody — unless
    a message came since the run looked (its count is not `wakes` any more)
    or a cancel is requested: then nothing changes and Parking says which.
    One statement. False if the run is not held by this execution."""
    found = conn.execute(
        "WITH w AS (SELECT id, cancel_requested_at IS NOT NULL AS cancel FROM everystep_workflow"
        "  WHERE " + _HELD + " FOR UPDATE),"
        " p AS (UPDATE everystep_workflow r SET status = 'waiting', claimed_by = NULL, waiting_on = %(on)s,"
        "  due_at = coalesce(to_timestamp(%(due)s::float8), now() + interval '100 years')"
        "  FROM w WHERE r.id = w.id AND NOT w.cancel AND r.wakes = %(wakes)s RETURNING 1)"
        f" SELECT EXISTS (SELECT FROM p), w.cancel, {_NOTIFY} FROM w",
        {"run": run, "runner": runner, "token": token, "due": due_at, "on": waiting_on, "wakes": wakes},
    ).fetchone()
    return False if found is None else Parking(found[0], found[1])


def set_event(conn: Executor, run: uuid.UUID, runner: str, token: int, step_id: str, name: str, key: str,
              value: str) -> bool:
    """Record a set_event call as a step row and write the event's value (the
    last one wins), in one statement. False if the run is not held by this
    execution or the step row exists."""
    row = conn.execute(
        "WITH w AS (SELECT id, claim_token FROM everystep_workflow WHERE " + _HELD + " FOR SHARE),"
        " ins AS (INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, claim_token,"
        "  started_at, finished_at) SELECT w.id, %(step_id)s, %(name)s, jsonb_build_array(%(key)s::text), '{}',"
        "  'done', 'null', w.claim_token, now(), now() FROM w ON CONFLICT (workflow_id, step_id) DO NOTHING"
        "  RETURNING workflow_id),"
        " ev AS (INSERT INTO everystep_event (run_id, key, value) SELECT workflow_id, %(key)s, %(value)s::jsonb"
        "  FROM ins ON CONFLICT (run_id, key) DO UPDATE SET value = EXCLUDED.value, updated_at = now())"
        " SELECT EXISTS (SELECT FROM ins)",
        {"run": run, "runner": runner, "token": token, "step_id": step_id, "name": name, "key": key,
         "value": value},
    ).fetchone()
    return bool(row[0])


def get_event(conn: psycopg.Connection, run: uuid.UUID, key: str) -> tuple[str | None, bool, Any]:
    """(the run's status or None if there is no such run, whether the event
    is set, its value as JSON data)."""
    row = conn.execute(
        "SELECT w.status, e.run_id IS NOT NULL, e.value FROM everystep_workflow w"
        " LEFT JOIN everystep_event e ON e.run_id = w.id AND e.key = %s WHERE w.id = %s",
        (key, run),
    ).fetchone()
    return (None, False, None) if row is None else (row[0], row[1], row[2])


def load_messages(conn: psycopg.Connection, run: uuid.UUID) -> list[dict]:
    """The messages sent to a run, in delivery order."""
    return _dicts(conn.execute(
        "SELECT id, topic, payload, idempotency_key, created_at, consumed_by, consumed_at FROM everystep_message"
        " WHERE run_id = %s ORDER BY id", (run,),
    ))


def load_events(conn: psycopg.Connection, run: uuid.UUID) -> list[dict]:
    return _dicts(conn.execute(
        "SELECT key, value, updated_at FROM everystep_event WHERE run_id = %s ORDER BY key", (run,),
    ))


class CancelOutcome(NamedTuple):
    status: str | None  # the run's status after the call; None: no such run
    changed: bool  # this call cancelled it, or requested its cancel


def cancel_run(conn: psycopg.Connection, run: uuid.UUID, reason: str | None) -> CancelOutcome:
    """Cancel a run, in the caller's transaction, with one conditional UPDATE:
    a scheduled, waiting or blocked run is `cancelled` at once; a running one
    gets a durable cancel request that its execution honours at its next step
    boundary (and that the end of the run honours, whatever ends first). A
    finished run, or one with a request already, is left as it is."""
    row = conn.execute(
        "WITH RECURSIVE tree AS (SELECT %(run)s::uuid AS id, 0 AS depth"
        "  UNION ALL SELECT c.id, tree.depth + 1 FROM everystep_workflow c JOIN tree ON c.parent_id = tree.id),"
        # The run and its unfinished descendants (a parent's cancel cascades to its children).
        " hit AS (UPDATE everystep_workflow w SET"
        "  status = CASE WHEN status = 'running' THEN status ELSE 'cancelled' END,"
        "  completed_at = CASE WHEN status = 'running' THEN completed_at ELSE now() END,"
        "  cancel_requested_at = coalesce(cancel_requested_at, now()),"
        "  cancel_reason = coalesce(%(reason)s, cancel_reason)"
        "  FROM tree WHERE w.id = tree.id AND (w.status IN ('scheduled', 'waiting', 'blocked')"
        "   OR w.status = 'running' AND w.cancel_requested_at IS NULL)"
        "  RETURNING w.id, w.status, w.parent_id, tree.depth),"
        # A parent outside the tree parked on a child cancelled here wakes up.
        " woke AS (UPDATE everystep_workflow p SET wakes = p.wakes + 1, due_at = CASE"
        "  WHEN p.status = 'waiting' AND p.waiting_on = 'child:' || hit.id THEN now() ELSE p.due_at END"
        "  FROM hit WHERE p.id = hit.parent_id AND hit.depth = 0 AND hit.status = 'cancelled'"
        "  RETURNING p.status = 'waiting' AND p.waiting_on = 'child:' || hit.id AS due)"
        f" SELECT (SELECT status FROM hit WHERE depth = 0), (SELECT {_NOTIFY} FROM woke WHERE due)",
        {"run": run, "reason": reason},
    ).fetchone()
    if row[0] is not None:
        return CancelOutcome(row[0], True)
    row = conn.execute("SELECT status FROM everystep_workflow WHERE id = %s", (run,)).fetchone()
    return CancelOutcome(None if row is None else row[0], False)


# ---------------------------------------------------------------- observability

class QueueStats(NamedTuple):
    pending: int  # claimable now: scheduled, or waiting and due
    running: int
    blocked: int
    oldest_pending_age_seconds: float  # database time; 0 when nothing is pending
    waiting: int = 0  # waiting for their time (delayed starts, sleeps, retry back-offs)


def set_statement_timeout(conn: psycopg.Connection, milliseconds: int) -> None:
    """Bound every statement of this session (the observer's connection)."""
    conn.execute("SELECT set_config('statement_timeout', %s, false)", (str(milliseconds),))


def queue_stats(conn: psycopg.Connection) -> QueueStats:
    """The queue as it stands: counts of the unfinished statuses and the age of
    the oldest scheduled run, measured with the server's clock."""
    # A waiting run is pending from its due time on; a scheduled one since it was created (or requeued).
    row = conn.execute(
        f"SELECT count(*) FILTER (WHERE {_CLAIMABLE}), count(*) FILTER (WHERE status = 'running'),"
        " count(*) FILTER (WHERE status = 'blocked'),"
        " coalesce(extract(epoch FROM now() - min(CASE WHEN status = 'waiting' THEN due_at ELSE created_at END)"
        f"  FILTER (WHERE {_CLAIMABLE})), 0),"
        " count(*) FILTER (WHERE status = 'waiting' AND due_at > now())"
        " FROM everystep_workflow WHERE status IN ('scheduled', 'waiting', 'running', 'blocked')"
    ).fetchone()
    return QueueStats(row[0], row[1], row[2], max(float(row[3]), 0.0), row[4])


def _lock_held(column: str) -> str:
    """The condition "the advisory lock of the runner name in `column` is held
    in this database". pg_locks shows a 64-bit advisory key as classid (high
    32 bits), objid (low 32 bits) and objsubid 1."""
    key = _LOCK_KEY % column
    return (
        "EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        f" AND l.classid = (({key} >> 32) & 4294967295)::oid AND l.objid = ({key} & 4294967295)::oid)"
    )


def runners_without_lock(conn: psycopg.Connection, runners: list[str]) -> list[str]:
    """The runner names, among `runners`, whose advisory lock nobody holds in
    this database."""
    rows = conn.execute(
        "SELECT expected.name FROM unnest(%s::text[]) WITH ORDINALITY AS expected(name, position)"
        f" WHERE NOT {_lock_held('expected.name')}"
        " ORDER BY expected.position",
        (runners,),
    ).fetchall()
    return [row[0] for row in rows]


def publish_route(conn: psycopg.Connection, runner: str, routes: list[str] | None) -> None:
    """Say which workflows this runner claims (LIKE patterns; None: all)."""
    conn.execute(
        "INSERT INTO everystep_route (runner, patterns) VALUES (%s, %s)"
        " ON CONFLICT (runner) DO UPDATE SET patterns = EXCLUDED.patterns, updated_at = now()",
        (runner, routes),
    )


def unserved_runs(conn: psycopg.Connection) -> dict[str, int]:
    """Scheduled runs, by workflow name, that no live worker (one whose lock
    is held in this database) claims: none of their routes matches."""
    return dict(conn.execute(
        f"WITH live AS MATERIALIZED (SELECT r.patterns FROM everystep_route r WHERE {_lock_held('r.runner')})"
        f" SELECT w.name, count(*) FROM everystep_workflow w WHERE {_CLAIMABLE}"
        "  AND NOT EXISTS (SELECT 1 FROM live WHERE live.patterns IS NULL OR w.name LIKE ANY(live.patterns))"
        " GROUP BY w.name ORDER BY w.name"
    ).fetchall())


# ---------------------------------------------------------------- operators

def _dicts(cur: psycopg.Cursor) -> list[dict]:
    names = [c.name for c in cur.description]
    return [dict(zip(names, row)) for row in cur]


def load_run(conn: psycopg.Connection, run: uuid.UUID) -> dict | None:
    rows = _dicts(conn.execute(
        "SELECT id, name, args, idempotency_key, status, claimed_by, result, error, created_at, completed_at,"
        " due_at, cancel_requested_at, cancel_reason, parent_id FROM everystep_workflow WHERE id = %s",
        (run,),
    ))
    return rows[0] if rows else None


def load_steps(conn: psycopg.Connection, run: uuid.UUID) -> list[dict]:
    return _dicts(conn.execute(
        "SELECT id, step_id, name, args, kwargs, status, result, error, started_at, finished_at, attempts"
        " FROM everystep_step"
        " WHERE workflow_id = %s ORDER BY id",
        (run,),
    ))


class ResolveRefused(Exception):
    """resolve_step was asked to resolve something that is not a blocked run's started step."""


def resolve_step(
    conn: psycopg.Connection, run: uuid.UUID, step_id: str, status: str | None, result: str | None, error: str | None
) -> None:
    """Resolve the `started` step of a blocked run: record its outcome
    (status done/failed), or delete the row (status None: the effect did not
    happen). The run goes back to `scheduled`. One transaction."""
    with conn.transaction():
        row = conn.execute(
            "SELECT status FROM everystep_workflow WHERE id = %s FOR UPDATE", (run,)
        ).fetchone()
        if row is None:
            raise ResolveRefused(f"no run {run}")
        if row[0] != RunStatus.BLOCKED:
            raise ResolveRefused(f"run {run} is {row[0]}, not blocked; only a blocked run can be resolved")
        step = conn.execute(
            "SELECT status FROM everystep_step WHERE workflow_id = %s AND step_id = %s", (run, step_id)
        ).fetchone()
        if step is None:
            raise ResolveRefused(f"run {run} has no step {step_id!r}")
        if step[0] != StepStatus.STARTED:
            raise ResolveRefused(f"step {step_id!r} of run {run} is {step[0]}; only its started step can be resolved")
        if status is None:
            conn.execute("DELETE FROM everystep_step WHERE workflow_id = %s AND step_id = %s", (run, step_id))
        else:
            conn.execute(
                "UPDATE everystep_step SET status = %s, result = %s::jsonb, error = %s::jsonb"
                " WHERE workflow_id = %s AND step_id = %s",
                (status, result, error, run, step_id),
            )
        conn.execute(
            "UPDATE everystep_workflow SET status = 'scheduled', claimed_by = NULL, error = NULL, completed_at = NULL"
            " WHERE id = %s",
            (run,),
        )
        conn.execute(f"SELECT {_NOTIFY}")


def list_runs(conn: psycopg.Connection, status: str | None, name: str | None, limit: int,
              parent: uuid.UUID | None = None) -> list[dict]:
    """The newest runs (without their payloads), optionally of one status,
    one workflow name and one parent run."""
    where = [sql.SQL("true")]
    if parent is not None:
        where.append(sql.SQL("parent_id = %(parent)s"))
    if status is not None:
        where.append(sql.SQL("status = %(status)s"))
    if name is not None:
        where.append(sql.SQL("name = %(name)s"))
    query = sql.SQL(
        "SELECT id, name, status, idempotency_key, claimed_by, created_at, completed_at FROM everystep_workflow"
        " WHERE {} ORDER BY created_at DESC, id DESC LIMIT %(limit)s"
    ).format(sql.SQL(" AND ").join(where))
    return _dicts(conn.execute(query, {"status": status, "name": name, "limit": limit, "parent": parent}))


def requeue_from_dead_claimers(conn: psycopg.Connection, claims: list[tuple[uuid.UUID, str | None]]) -> list[uuid.UUID]:
    """Put `running` runs back to `scheduled`, each only if it is still claimed
    by the given claimer (one the caller found dead and whose lock it holds).
    Returns the runs that matched."""
    rows = conn.execute(
        "WITH q AS (UPDATE everystep_workflow w SET status = 'scheduled', claimed_by = NULL"
        " FROM unnest(%s::uuid[], %s::text[]) AS c(id, claimer)"
        " WHERE w.id = c.id AND w.status = 'running' AND w.claimed_by IS NOT DISTINCT FROM c.claimer"
        " RETURNING w.id)"
        f" SELECT id, {_NOTIFY} FROM q",
        ([run for run, _ in claims], [claimer for _, claimer in claims]),
    ).fetchall()
    return [row[0] for row in rows]


# Terminal runs completed more than %(days)s days ago (by the database's
# clock). A run completes after it is created, so the bound on created_at adds
# nothing to the condition but lets the (status, created_at) index limit the scan.
_PRUNABLE = (
    "status IN ('completed', 'failed', 'stopped', 'cancelled')"
    " AND created_at < now() - make_interval(days => %(days)s::int)"
    " AND completed_at < now() - make_interval(days => %(days)s::int)"
)


def count_prunable(conn: psycopg.Connection, days: int) -> int:
    return conn.execute(f"SELECT count(*) FROM everystep_workflow WHERE {_PRUNABLE}", {"days": days}).fetchone()[0]


def prune_batch(conn: psycopg.Connection, days: int, limit: int) -> int:
    """Delete up to `limit` terminal runs completed more than `days` days ago,
    with their steps (FK cascade), in one short transaction. Rows locked by
    someone else are skipped rather than waited for. Returns how many runs it
    deleted."""
    with conn.transaction():
        cur = conn.execute(
            "DELETE FROM everystep_workflow WHERE id IN"
            f" (SELECT id FROM everystep_workflow WHERE {_PRUNABLE} LIMIT %(limit)s FOR UPDATE SKIP LOCKED)",
            {"days": days, "limit": limit},
        )
        return cur.rowcount
# ---------------------------------------------------------------- recurring schedules


# One scheduler fires at a time per schema, across the fleet; `apply` waits
# for it, so a tick never sees half an apply.
_SCHEDULER_LOCK = "hashtextextended('everystep:scheduler:' || current_schema(), 0)"
_SCHEDULE_WITH_LAST_RUN = (
    "SELECT s.*, w.status AS last_run_status FROM everystep_schedule s"
    " LEFT JOIN everystep_workflow w ON w.id = s.last_run_id"
)


class ScheduleRefused(Exception):
    """An operation on a schedule that does not apply to it (unknown, already retired)."""


def try_lock_scheduler(conn: psycopg.Connection) -> bool:
    """Take the scheduler's lock until the transaction ends, if no other scheduler holds it."""
    return conn.execute(f"SELECT pg_try_advisory_xact_lock({_SCHEDULER_LOCK})").fetchone()[0]


def lock_scheduler(conn: psycopg.Connection) -> None:
    """Wait for the scheduler's lock and hold it until the transaction ends."""
    conn.execute(f"SELECT pg_advisory_xact_lock({_SCHEDULER_LOCK})")


def database_now(conn: psycopg.Connection) -> datetime.datetime:
    """The server's time (the transaction's start): the only clock schedules use."""
    return conn.execute("SELECT now()").fetchone()[0]


def load_schedules(conn: psycopg.Connection) -> list[dict]:
    """Every schedule, retired ones included, by key, with its last run's status."""
    return _dicts(conn.execute(f"{_SCHEDULE_WITH_LAST_RUN} ORDER BY s.key"))


def due_schedules(conn: psycopg.Connection) -> list[dict]:
    """Live schedules whose next fire time has come (database time), locked
    until the transaction ends."""
    return _dicts(conn.execute(
        f"{_SCHEDULE_WITH_LAST_RUN} WHERE s.retired_at IS NULL AND NOT s.paused AND s.next_fire_at <= now()"
        # SKIP LOCKED: a schedule an application transaction is changing
        # (everystep.schedules) fires at the next tick, instead of stalling this one.
        " ORDER BY s.next_fire_at, s.key FOR UPDATE OF s SKIP LOCKED"
    ))


def load_schedule(conn: psycopg.Connection, key: str, lock: bool = False) -> dict | None:
    """One schedule (retired or not) with its last run's status, or None;
    with `lock`, its row stays locked until the transaction ends."""
    rows = _dicts(conn.execute(
        f"{_SCHEDULE_WITH_LAST_RUN} WHERE s.key = %s{' FOR UPDATE OF s' if lock else ''}", (key,)
    ))
    return rows[0] if rows else None


def put_schedule(conn: psycopg.Connection, key: str, definition: dict, next_fire_at: datetime.datetime,
                 source: str) -> None:
    """Write a schedule's definition (workflow, args as JSON text, cron,
    timezone, catchup, max_catchup, overlap, max_lateness_seconds, paused,
    auto_pause_after), its owner and its next fire time, adding the schedule
    or reviving a retired one. Every write is a new version."""
    conn.execute(
        "INSERT INTO everystep_schedule (key, workflow, args, cron, timezone, catchup, max_catchup, overlap,"
        " max_lateness_seconds, paused, auto_pause_after, source, next_fire_at, created_at, updated_at)"
        " VALUES (%(key)s, %(workflow)s, %(args)s::jsonb, %(cron)s, %(timezone)s, %(catchup)s, %(max_catchup)s,"
        " %(overlap)s, %(max_lateness_seconds)s, %(paused)s, %(auto_pause_after)s, %(source)s, %(next_fire_at)s,"
        " now(), now())"
        " ON CONFLICT (key) DO UPDATE SET workflow = EXCLUDED.workflow, args = EXCLUDED.args, cron = EXCLUDED.cron,"
        "  timezone = EXCLUDED.timezone, catchup = EXCLUDED.catchup, max_catchup = EXCLUDED.max_catchup,"
        "  overlap = EXCLUDED.overlap, max_lateness_seconds = EXCLUDED.max_lateness_seconds,"
        "  paused = EXCLUDED.paused, auto_pause_after = EXCLUDED.auto_pause_after, source = EXCLUDED.source,"
        "  version = everystep_schedule.version + 1, updated_at = now(), next_fire_at = EXCLUDED.next_fire_at,"
        "  retired_at = NULL, last_error = NULL, paused_reason = NULL",
        {**definition, "key": key, "source": source, "next_fire_at": next_fire_at},
    )


def retire_schedule(conn: psycopg.Connection, key: str, source: str | None = None) -> datetime.datetime:
    """Retire a live schedule: it never fires again (its row stays). Only
    its owner may, unless `source` is None (forced). Returns when. One
    statement, so it joins the caller's transaction or is its own."""
    row = conn.execute(
        "UPDATE everystep_schedule SET retired_at = now(), updated_at = now(), version = version + 1"
        " WHERE key = %s AND retired_at IS NULL AND (%s::text IS NULL OR source = %s) RETURNING retired_at",
        (key, source, source),
    ).fetchone()
    if row is not None:
        return row[0]
    row = conn.execute("SELECT retired_at, source FROM everystep_schedule WHERE key = %s", (key,)).fetchone()
    if row is None:
        raise ScheduleRefused(f"no schedule {key!r}")
    if row[0] is not None:
        raise ScheduleRefused(f"schedule {key!r} was already retired at {row[0].isoformat(timespec='seconds')}")
    raise ScheduleRefused(f"schedule {key!r} belongs to source {row[1]!r}, not {source!r}: it is left alone")


def set_schedule_paused(conn: psycopg.Connection, key: str, paused: bool, next_fire_at: datetime.datetime | None,
                        reason: str | None = None) -> None:
    """Pause (with the reason, when the schedule paused itself) or resume a
    schedule, as a new version; resuming sets its next fire time."""
    conn.execute(
        "UPDATE everystep_schedule SET paused = %s, paused_reason = %s, next_fire_at = coalesce(%s, next_fire_at),"
        " version = version + 1, updated_at = now() WHERE key = %s",
        (paused, reason, next_fire_at, key),
    )


def record_schedule_run(conn: psycopg.Connection, key: str, fire_at: datetime.datetime, run_id: uuid.UUID) -> None:
    """Remember the run a schedule made for a fire time."""
    conn.execute(
        "INSERT INTO everystep_schedule_run (schedule_key, fire_at, run_id, fired_at) VALUES (%s, %s, %s, now())"
        " ON CONFLICT DO NOTHING",
        (key, fire_at, run_id),
    )


def schedules_failing(conn: psycopg.Connection) -> list[dict]:
    """Live, unpaused schedules with auto-pause whose latest `auto_pause_after`
    ended runs, made since their definition last changed, all failed: key,
    auto_pause_after and the latest failed run. Locked until the transaction ends."""
    return _dicts(conn.execute(
        "SELECT s.key, s.auto_pause_after, f.last_run_id FROM everystep_schedule s"
        " CROSS JOIN LATERAL (SELECT count(*) FILTER (WHERE e.status = 'failed') AS failed,"
        "   (array_agg(e.id ORDER BY e.fire_at DESC))[1] AS last_run_id"
        "   FROM (SELECT w.id, w.status, r.fire_at FROM everystep_schedule_run r"
        "     JOIN everystep_workflow w ON w.id = r.run_id"
        "     WHERE r.schedule_key = s.key AND r.fired_at >= s.updated_at AND w.status = ANY(%s)"
        "     ORDER BY r.fire_at DESC LIMIT s.auto_pause_after) e) f"
        " WHERE s.auto_pause_after IS NOT NULL AND NOT s.paused AND s.retired_at IS NULL"
        "  AND f.failed >= s.auto_pause_after"
        " ORDER BY s.key FOR UPDATE OF s SKIP LOCKED",
        (list(TERMINAL),),
    ))


def auto_paused_schedules(conn: psycopg.Connection) -> int:
    """How many live schedules are paused because their runs kept failing."""
    return conn.execute(
        "SELECT count(*) FROM everystep_schedule WHERE paused AND paused_reason IS NOT NULL AND retired_at IS NULL"
    ).fetchone()[0]


def advance_schedule(
    conn: psycopg.Connection,
    key: str,
    next_fire_at: datetime.datetime,
    fired_at: datetime.datetime | None,
    run_id: uuid.UUID | None,
) -> None:
    """Move a schedule past the fire times just decided, remembering the
    latest run it made (if any), and clear its error."""
    conn.execute(
        "UPDATE everystep_schedule SET next_fire_at = %s, last_fire_at = coalesce(%s, last_fire_at),"
        " last_run_id = coalesce(%s, last_run_id), last_error = NULL WHERE key = %s",
        (next_fire_at, fired_at, run_id, key),
    )


def set_schedule_error(conn: psycopg.Connection, key: str, error: str) -> None:
    """Record why a due schedule did not fire (its next fire time stays)."""
    conn.execute("UPDATE everystep_schedule SET last_error = %s WHERE key = %s", (error, key))


# ---------------------------------------------------------------- the operators' UI and the audit trail

UI_STATUS_CAP = 1000  # counts per status are exact up to this; above it, the planner's estimate


class RunFilter(NamedTuple):
    """What the UI's run list is narrowed by; None: no condition."""

    status: str | None = None
    workflow: str | None = None
    since: datetime.datetime | None = None  # created at or after
    until: datetime.datetime | None = None  # created before
    run_id: uuid.UUID | None = None
    idempotency_key: str | None = None
    args_contain: str | None = None  # JSON text: args @> it
    before: tuple[datetime.datetime, uuid.UUID] | None = None  # keyset cursor: (created_at, id) of the last row shown


def _run_filter_sql(f: RunFilter) -> tuple[sql.Composable, dict]:
    where = [sql.SQL("true")]
    conditions = [
        (f.status, "status = %(status)s"),
        (f.workflow, "name = %(workflow)s"),
        (f.since, "created_at >= %(since)s"),
        (f.until, "created_at < %(until)s"),
        (f.run_id, "id = %(run_id)s"),
        (f.idempotency_key, "idempotency_key = %(key)s"),
        (f.args_contain, "args @> %(args)s::jsonb"),
        # <= bounds the created_at index scan; the rest breaks ties by id.
        (f.before, "created_at <= %(before_at)s AND (created_at < %(before_at)s OR id < %(before_id)s)"),
    ]
    where += [sql.SQL(text) for value, text in conditions if value is not None]
    params = {"status": f.status, "workflow": f.workflow, "since": f.since, "until": f.until, "run_id": f.run_id,
              "key": f.idempotency_key, "args": f.args_contain,
              "before_at": f.before[0] if f.before else None, "before_id": f.before[1] if f.before else None}
    return sql.SQL(" AND ").join(where), params


# A page of runs, newest first, each with its count of steps done and recorded.
_UI_PAGE = (
    "SELECT w.id, w.name, w.status, w.idempotency_key, w.claimed_by, w.created_at, w.completed_at,"
    " s.steps_done, s.steps_total FROM ("
    " SELECT id, name, status, idempotency_key, claimed_by, created_at, completed_at FROM everystep_workflow"
    " WHERE {where} ORDER BY created_at DESC, id DESC LIMIT %(limit)s) w"
    " LEFT JOIN LATERAL (SELECT count(*) FILTER (WHERE status = 'done') AS steps_done, count(*) AS steps_total"
    "  FROM everystep_step WHERE workflow_id = w.id) s ON true"
    " ORDER BY w.created_at DESC, w.id DESC"
)


def ui_runs(conn: psycopg.Connection, f: RunFilter, limit: int) -> list[dict]:
    """One page of runs matching the filter, newest first (keyset paging:
    pass the last row's (created_at, id) as `before` for the next page)."""
    where, params = _run_filter_sql(f)
    return _dicts(conn.execute(sql.SQL(_UI_PAGE).format(where=where), {**params, "limit": limit}))


# What every open live page shows, in one statement: the newest runs, the
# counts per status, the runners with work in flight, and a change counter.
_UI_OVERVIEW = sql.SQL(
    "SELECT (SELECT coalesce(json_agg(p), '[]') FROM ({page}) p),"
    " (SELECT json_object_agg(s.status, (SELECT count(*) FROM (SELECT 1 FROM everystep_workflow w"
    "   WHERE w.status = s.status LIMIT %(cap)s + 1) c)) FROM unnest(%(statuses)s::text[]) s(status)),"
    " (SELECT json_build_object('rows', greatest(c.reltuples, 0), 'values', st.most_common_vals::text::text[],"
    "   'freqs', st.most_common_freqs) FROM pg_class c LEFT JOIN pg_stats st ON st.schemaname = current_schema()"
    "   AND st.tablename = 'everystep_workflow' AND st.attname = 'status'"
    "  WHERE c.oid = 'everystep_workflow'::regclass),"
    " (SELECT coalesce(json_object_agg(claimed_by, n), '{{}}') FROM (SELECT claimed_by, count(*) AS n"
    "   FROM everystep_workflow WHERE status = 'running' AND claimed_by IS NOT NULL GROUP BY claimed_by) r),"
    " (SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint FROM pg_stat_user_tables"
    "  WHERE schemaname = current_schema() AND relname IN ('everystep_workflow', 'everystep_step'))"
).format(page=sql.SQL(_UI_PAGE).format(where=sql.SQL("true")))


def ui_overview(conn: psycopg.Connection, statuses: tuple[str, ...], limit: int) -> dict:
    """The live page's data in one statement. `counts` are exact up to
    UI_STATUS_CAP (a count above it means "more"); `estimate` is what the
    planner's statistics say (reltuples and the most common values of status),
    for the statuses past the cap: no statement here scans the table."""
    page, counts, estimate, runners, changes = conn.execute(
        _UI_OVERVIEW, {"cap": UI_STATUS_CAP, "statuses": list(statuses), "limit": limit}
    ).fetchone()
    return {"runs": page, "counts": counts, "estimate": estimate, "runners": runners, "changes": changes}


def ui_run(conn: psycopg.Connection, run: uuid.UUID) -> dict | None:
    """A run with every recorded step (all their columns, whatever the
    schema version has: started_at and finished_at when present), its crash
    count and its audit records, from one snapshot."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        found = load_run(conn, run)
        if found is None:
            return None
        found["steps"] = [row[0] for row in conn.execute(
            "SELECT to_jsonb(s) - 'workflow_id' FROM everystep_step s WHERE s.workflow_id = %s ORDER BY s.id", (run,)
        )]
        crashes = conn.execute("SELECT crashes FROM everystep_crash WHERE workflow_id = %s", (run,)).fetchone()
        found["crashes"] = crashes[0] if crashes else 0
        found["audit"] = audit_records(conn, run=run, limit=100)
    return found


def ui_workflow_names(conn: psycopg.Connection, limit: int = 500) -> list[str]:
    """The distinct workflow names, by a loose scan of the (name, created_at)
    index: one index probe per name, however many runs there are."""
    return [row[0] for row in conn.execute(
        "WITH RECURSIVE n AS (SELECT min(name) AS name FROM everystep_workflow"
        " UNION ALL SELECT (SELECT min(name) FROM everystep_workflow WHERE name > n.name) FROM n"
        " WHERE n.name IS NOT NULL) SELECT name FROM n WHERE name IS NOT NULL LIMIT %s",
        (limit,),
    )]


def ui_failures(conn: psycopg.Connection, hours: int) -> list[dict]:
    """Failed runs created in the last `hours`, grouped by workflow and
    exception type, with the newest run of each group."""
    return _dicts(conn.execute(
        "SELECT name AS workflow, coalesce(error->>'type', '?') AS error_type, count(*) AS runs,"
        " max(completed_at) AS last_at, (array_agg(id ORDER BY created_at DESC))[1] AS latest_run,"
        " (array_agg(error->>'message' ORDER BY created_at DESC))[1] AS latest_message"
        " FROM everystep_workflow WHERE status = 'failed' AND created_at >= now() - make_interval(hours => %s)"
        " GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2 LIMIT 200",
        (hours,),
    ))


def ui_workers(conn: psycopg.Connection) -> list[dict]:
    """Every runner of this schema that holds its lock now, fleet-wide: the
    session holding it (a worker's control connection, application name
    `everystep <name> control`), since when that session exists, how many
    pool connections the runner has open, and its runs in flight."""
    return _dicts(conn.execute(
        "WITH control AS (SELECT a.pid, a.client_addr, a.backend_start,"
        "  substr(a.application_name, 11, length(a.application_name) - 18) AS name"
        "  FROM pg_stat_activity a WHERE a.datname = current_database()"
        "  AND a.application_name LIKE 'everystep % control')"
        " SELECT c.name, c.pid, host(c.client_addr) AS client, c.backend_start AS since,"
        " (SELECT count(*) FROM pg_stat_activity p WHERE p.datname = current_database()"
        "  AND p.application_name = 'everystep ' || c.name) AS pool_connections,"
        " (SELECT count(*) FROM everystep_workflow w WHERE w.status = 'running' AND w.claimed_by = c.name)"
        "  AS in_flight"
        " FROM control c WHERE EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = c.pid AND l.locktype = 'advisory'"
        "  AND l.granted AND l.objsubid = 1"
        f"  AND l.classid = (({_LOCK_KEY % 'c.name'} >> 32) & 4294967295)::oid"
        f"  AND l.objid = ({_LOCK_KEY % 'c.name'} & 4294967295)::oid)"
        " ORDER BY c.name"
    ))


def ui_reschedule(conn: psycopg.Connection, run: uuid.UUID, new_id: uuid.UUID) -> uuid.UUID | None:
    """Schedule a new run of the same workflow with the same args (no
    idempotency key); None if there is no such run."""
    row = conn.execute(
        "WITH ins AS (INSERT INTO everystep_workflow (id, name, args, status)"
        " SELECT %s, name, args, 'scheduled' FROM everystep_workflow WHERE id = %s RETURNING id)"
        f" SELECT id, {_NOTIFY} FROM ins",
        (new_id, run),
    ).fetchone()
    return row[0] if row else None


def ui_set_schedule_paused(conn: psycopg.Connection, key: str, paused: bool,
                           next_fire_at: Callable[[dict], datetime.datetime] | None = None) -> None:
    """Pause or resume a live schedule from the UI (until the next `schedules
    apply` writes the file's value again). Resuming sets the next fire time
    `next_fire_at(row)`, so the time spent paused is not caught up."""
    with conn.transaction():
        lock_scheduler(conn)
        rows = _dicts(conn.execute(
            "SELECT *, now() AS database_now FROM everystep_schedule WHERE key = %s AND retired_at IS NULL FOR UPDATE",
            (key,),
        ))
        if not rows:
            raise ScheduleRefused(f"no live schedule {key!r}")
        conn.execute(
            # A new version, as every change is; any pause or resume clears the auto-pause reason.
            "UPDATE everystep_schedule SET paused = %s, next_fire_at = coalesce(%s, next_fire_at),"
            " paused_reason = NULL, version = version + 1, updated_at = now() WHERE key = %s",
            (paused, next_fire_at(rows[0]) if next_fire_at and not paused else None, key),
        )


# ---------------------------------------------------------------- audit

def audit(conn: Executor, actor: str, source: str, action: str, run: uuid.UUID | None = None,
          step_id: str | None = None, target: str | None = None, details: dict | None = None) -> None:
    """Record an operator's action (who, what, on which run or step, the values given)."""
    conn.execute(
        "INSERT INTO everystep_audit (actor, source, action, run_id, step_id, target, details)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb)",
        (actor[:255], source, action, run, step_id, target, json.dumps(details or {}, default=str)),
    )


def audit_records(conn: psycopg.Connection, run: uuid.UUID | None = None, limit: int = 200,
                  before: int | None = None) -> list[dict]:
    """The newest audit records (of one run), newest first."""
    return _dicts(conn.execute(
        "SELECT id, at, actor, source, action, run_id, step_id, target, details FROM everystep_audit"
        " WHERE (%(run)s::uuid IS NULL OR run_id = %(run)s) AND (%(before)s::bigint IS NULL OR id < %(before)s)"
        " ORDER BY id DESC LIMIT %(limit)s",
        {"run": run, "before": before, "limit": limit},
    ))


def fire_schedule_now(conn: psycopg.Connection, key: str, new_id: uuid.UUID) -> uuid.UUID:
    """Schedule a run of a live schedule's workflow with its args now, outside
    its cron times; it becomes the schedule's last run."""
    with conn.transaction():
        lock_scheduler(conn)
        row = conn.execute(
            "WITH s AS (SELECT workflow, args FROM everystep_schedule WHERE key = %(key)s AND retired_at IS NULL"
            " FOR UPDATE), ins AS (INSERT INTO everystep_workflow (id, name, args, status)"
            " SELECT %(id)s, workflow, args, 'scheduled' FROM s RETURNING id),"
            " upd AS (UPDATE everystep_schedule SET last_run_id = ins.id, last_fire_at = now() FROM ins"
            "  WHERE key = %(key)s)"
            f" SELECT id, {_NOTIFY} FROM ins",
            {"key": key, "id": new_id},
        ).fetchone()
    if row is None:
        raise ScheduleRefused(f"no live schedule {key!r}")
    return row[0]


# ---- failover

class Server(NamedTuple):
    """Which PostgreSQL server a session talks to. Any change of it (a
    restart, a failover to a standby, a promotion under an open session)
    means the advisory locks held on the previous one are gone."""
    system_identifier: int  # the cluster's (a physical standby shares its primary's)
    started_at: datetime.datetime  # the postmaster's start: differs between servers, and across restarts
    timeline: int | None  # the WAL timeline of a primary (a promotion starts a new one); None: in recovery


def server(conn: psycopg.Connection) -> Server:
    """The server this session talks to."""
    return Server(*conn.execute(
        "SELECT s.system_identifier, pg_postmaster_start_time(), CASE WHEN pg_is_in_recovery() THEN NULL"
        " ELSE ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::int END"
        " FROM pg_control_system() s"
    ).fetchone())


# The load of a fleet, for an autoscaler (KEDA's postgresql trigger runs this
# text with the two placeholders written in): the fleet's runs `running`, and
# its runs due now, counted up to `bound` in all (maxReplicaCount x the run
# slots of a pod: a larger count adds no pod). Bounded whatever the size of the
# table: the due runs are found per workflow name (a loose scan of
# everystep_workflow_due_by_name, one probe per name that has runs scheduled or
# waiting, then at most `bound` entries of each), the running ones in the small
# partial index everystep_workflow_running (no more entries than the run slots
# of every fleet). The due runs' ORDER BY is their index's: walked in order, the
# scan stops at its LIMIT (a bitmap scan would read every match first).
# `patterns`: the fleet's workers.workflows as LIKE patterns (`routes_of`);
# ARRAY['%'] for all.
FLEET_LOAD = """\
WITH RECURSIVE names(name) AS (
    (SELECT name FROM everystep_workflow WHERE status IN ('scheduled', 'waiting') ORDER BY name LIMIT 1)
  UNION ALL
    SELECT (SELECT w.name FROM everystep_workflow w WHERE w.status IN ('scheduled', 'waiting') AND w.name > names.name
            ORDER BY w.name LIMIT 1)
    FROM names WHERE names.name IS NOT NULL
)
SELECT count(*) FROM (
    (SELECT FROM everystep_workflow w WHERE w.status = 'running' AND w.name LIKE ANY (%(patterns)s::text[])
     LIMIT %(bound)s)
  UNION ALL
    (SELECT FROM names, LATERAL (SELECT w.due_at FROM everystep_workflow w WHERE w.status IN ('scheduled', 'waiting')
                                  AND w.name = names.name AND w.due_at <= now() ORDER BY w.due_at LIMIT %(bound)s) due
     WHERE names.name LIKE ANY (%(patterns)s::text[]))
  LIMIT %(bound)s
) fleet_load"""


def fleet_load(conn: psycopg.Connection, patterns: list[str] | None, bound: int) -> int:
    """FLEET_LOAD: the runs of a fleet running or due now, at most `bound`."""
    return conn.execute(FLEET_LOAD, {"patterns": patterns or ["%"], "bound": bound}).fetchone()[0]
