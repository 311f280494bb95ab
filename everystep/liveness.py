"""Who is alive: the per-name advisory lock, and the sweep that recovers runs
held by dead claimers.

A worker holds the session-level advisory lock of its name for its whole life,
so a claimer is alive exactly while its lock is held. The sweep probes the lock
of every claimer of a `running` run with `pg_try_advisory_lock`; a claimer
whose lock is free on two probes at least `grace` seconds apart is dead (the
grace only covers a live worker re-taking its lock after a database restart).
Its runs are then requeued while the sweep holds its lock, so the claimer
cannot come back half-way. No heartbeats, no clock comparisons: a slow, paused
or swapping worker keeps its lock and is never mistaken for dead.

Locks live in the server's memory: a restarted server, or a standby promoted
by a failover, holds none of them, and every live worker looks dead until it
has reconnected. So the sweep looks at which server it talks to at every
sweep (`db.server`); when that changed, what it saw on the previous one is
forgotten and the grace starts again, on the new server: no claimer is taken
for dead before `grace` seconds after the sweep first saw it, long enough for
the live workers to take their locks again (they retry at least twice per
grace). On a server in recovery (a standby) it judges nobody.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import Iterable, Iterator

import psycopg

from everystep import db, metrics, serde
from everystep.errors import NoSuchDatabase

log = logging.getLogger("everystep")

# TCP keepalives: idle 5 s, then a probe every 2 s, 3 probes: a vanished peer
# is noticed in ~11 s instead of the kernel's default two hours.
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 5, 2, 3
USER_TIMEOUT_MS = (KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_COUNT) * 1000


def connection_kwargs(application_name: str) -> dict:
    """psycopg.connect() keyword arguments for every connection everystep
    opens: autocommit, UTF-8 (the hot path sends UTF-8 text), a connect
    timeout, and client-side TCP keepalives with a user timeout, so a
    connection to a vanished server fails in seconds instead of hanging."""
    return {
        "autocommit": True, "client_encoding": "utf8", "connect_timeout": 5,
        "application_name": application_name[:63], "keepalives": 1, "keepalives_idle": KEEPALIVE_IDLE,
        "keepalives_interval": KEEPALIVE_INTERVAL, "keepalives_count": KEEPALIVE_COUNT,
        "tcp_user_timeout": USER_TIMEOUT_MS,
    }


# What a server that answers says of a database or a role it does not have
# (no SQLSTATE reaches the client from a refused connection: its text does).
_MISSING = re.compile(r'\b(database|role) "[^"]*" does not exist')


def refuse_missing_database(exc: BaseException) -> None:
    """Raise NoSuchDatabase when `exc`, a failed connection, is the server
    saying the URL's database or role does not exist: not an outage to wait
    out. Anything else (no answer, a server starting) returns."""
    found = _MISSING.search(str(exc))
    if found:
        raise NoSuchDatabase(f"the server answers that {found.group(0)} (check database.url, or create it; "
                             "not retrying)") from None


def fail_poison_runs(
    conn: psycopg.Connection, claimer: str, claims: list[db.Claim], max_crashes: int
) -> set[uuid.UUID]:
    """Count a crash for runs whose claimer died holding them (each still held
    by the same execution); fail those that died `max_crashes` claims in a row
    with no new step. Returns the failed."""
    error = serde.dumps({
        "type": "everystep.errors.EverystepError",
        "message": f"the worker died during {max_crashes} claims of this run in a row with no new step recorded "
        "(killed by the out-of-memory killer, or a crash inside a step?); failed so that it cannot crash-loop "
        "the fleet",
        "args": [],
    })
    poisoned = set(db.count_crashes(conn, claimer, claims, max_crashes, error))
    for run_id in poisoned:
        log.error("poison run failed after %d crashes of its worker", max_crashes, extra={"run": str(run_id)})
    metrics.POISONED.inc(len(poisoned))
    return poisoned


class DeadClaimerSweep:
    """Recovers the runs of dead claimers; call `sweep` every few seconds.
    Any number of sweepers may run at once: the probe lock serialises them."""

    def __init__(self, grace: float, max_crashes: int):
        self.grace = grace
        self.max_crashes = max_crashes
        # claimer -> when its lock was first seen free, on the server of now
        self.suspects: dict[str, float] = {}
        self.server: db.Server | None = None  # the server the last sweep talked to

    def sweep(self, conn: psycopg.Connection) -> list[uuid.UUID]:
        """One probe of every claimer; returns the runs requeued."""
        server = db.server(conn)
        if server != self.server:
            self._server_changed(server)
        if server.timeline is None:
            return []  # a standby: it holds no worker's lock, and nothing can be requeued there
        claimers = db.running_claimers(conn)
        self.suspects = {name: seen for name, seen in self.suspects.items() if name in claimers}
        recovered: list[uuid.UUID] = []
        for claimer in claimers:
            if not db.try_lock(conn, claimer):
                self.suspects.pop(claimer, None)  # alive
                continue
            try:
                now = time.monotonic()
                first_seen = self.suspects.setdefault(claimer, now)
                if now - first_seen >= self.grace:
                    recovered += self._recover(conn, claimer)
                    del self.suspects[claimer]
            finally:
                db.unlock(conn, claimer)
        return recovered

    def _server_changed(self, server: db.Server) -> None:
        """Locks seen free on another server say nothing about this one: start
        every suspicion again, here (so nobody is taken for dead before `grace`
        seconds from now)."""
        previous, self.server = self.server, server
        self.suspects.clear()
        if previous is None:
            return
        log.warning(
            "the database server changed (%s); no claimer is taken for dead for %.0f s, until the live workers "
            "have taken their locks again", _change(previous, server), self.grace,
        )

    def next_probe_in(self, interval: float) -> float:
        """Seconds until the next sweep should run: the interval, or sooner
        when a suspect's grace runs out before it."""
        if not self.suspects:
            return interval
        due = min(self.suspects.values()) + self.grace - time.monotonic()
        return max(0.0, min(interval, due))

    def _recover(self, conn: psycopg.Connection, claimer: str) -> list[uuid.UUID]:
        held = db.held_claims(conn, claimer)
        poisoned = fail_poison_runs(conn, claimer, held, self.max_crashes)
        requeued = db.requeue_held(conn, claimer, [claim for claim in held if claim.id not in poisoned], "swept")
        if requeued:
            log.warning("claimer %s is dead: requeued %d runs", claimer, len(requeued), extra={"runner": claimer})
            metrics.RECOVERED.inc(len(requeued))
        return requeued


def _change(previous: db.Server, server: db.Server) -> str:
    def timeline(of: db.Server) -> str:
        return "in recovery" if of.timeline is None else f"timeline {of.timeline}"

    if previous.system_identifier != server.system_identifier:
        return f"system identifier {previous.system_identifier} -> {server.system_identifier}"
    if previous.started_at != server.started_at:
        return (f"{timeline(previous)}, started {previous.started_at:%H:%M:%S.%f} -> {timeline(server)}, "
                f"started {server.started_at:%H:%M:%S.%f}")
    return f"{timeline(previous)} -> {timeline(server)}"


@contextlib.contextmanager
def dead_claimers_locked(conn: psycopg.Connection, claimers: Iterable[str | None]) -> Iterator[set[str | None]]:
    """The claimers among `claimers` that are dead, found in one look (the
    rule of `everystep requeue`, which cannot wait for a grace): a lock that
    can be taken is a dead claimer's. Their locks are held until the block
    ends, so no claimer comes back while its runs are requeued. None (a run
    with no claimer) counts as dead."""
    dead = {claimer for claimer in set(claimers) if claimer is None or db.try_lock(conn, claimer)}
    try:
        yield dead
    finally:
        for claimer in dead:
            if claimer is not None:
                db.unlock(conn, claimer)
