"""Maintenance: the dead-claimer sweep, the recurring schedules' tick and
the console's per-minute figures (everystep_minute), in one loop.

Embeddable in any host process, like `Worker`::

    maintenance = Maintenance(database_url, interval=5, grace=10, max_crashes=3,
                              retention={"completed": 7 * 86400})
    maintenance.run()     # blocks; maintenance.stop() from another thread or a signal handler

It also keeps the history (everystep.retention): finished runs move out of
the hot tables, the coming weeks' partitions are made ahead, and the
retention by end status removes what has expired.

Any number of them may run at once, in one deployment or across several: the
sweep's probe lock and the scheduler's advisory lock serialise them. It waits
for a database that does not answer, with a back-off, logging one line when
the outage starts and one when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import psycopg

from everystep import db, liveness, scheduler
from everystep.logs import first_line
from everystep.retention import ARCHIVE_AFTER, Upkeep

log = logging.getLogger("everystep")

SCHEDULER_TICK = 1.0  # seconds between looks at the recurring schedules
RETRY_CEILING = 10.0  # seconds: the longest wait between attempts to reach the database
ROLLUP_INTERVAL = 10.0  # seconds between two updates of the charts' per-minute figures (the runs ended)
SAMPLE_INTERVAL = 60.0  # seconds between two samples of the backlog into them (and at every new minute)
PRUNE_MINUTES_INTERVAL = 3600.0  # seconds between two deletions of the figures past their days
# Dead row versions in the queue's tables that make a sweep VACUUM them (see _vacuum_queue).
VACUUM_QUEUE_AT = 5000
# A queue table still holding VACUUM_QUEUE_AT dead rows after that vacuum (a
# snapshot held open) is rewritten if it has at most this many live rows,
# the copy it makes under its lock, waiting at most COMPACT_WAIT_MS for that.
COMPACT_QUEUE_LIVE = 10_000
COMPACT_WAIT_MS = 50
# Seconds between two looks at the whole queue for the strays a worker of a
# version before 0032 leaves (db.sort_lanes); the sweeps between look at its
# head alone, where the claims meet them: a read of every queued run's record
# costs 20 ms a sweep at 50,000 runs queued.
STRAYS_INTERVAL = 60.0


class Maintenance:
    """The dead-claimer sweep every `interval` seconds (sooner when a
    suspect's grace runs out), the recurring schedules every second, and the
    charts' per-minute figures every ROLLUP_INTERVAL seconds."""

    def __init__(self, database_url: str, interval: float = 5.0, grace: float = 10.0, max_crashes: int = 3,
                 application_name: str = "everystep maintenance", retention: Mapping[str, float] | None = None,
                 archive_after: float = ARCHIVE_AFTER):
        if not interval > 0:
            raise ValueError("the sweep interval must be > 0 seconds")
        self.database_url = database_url
        self.interval = interval
        self.application_name = application_name
        self.sweep = liveness.DeadClaimerSweep(grace, max_crashes)
        self.history = Upkeep(retention, archive_after)
        self._stopped = threading.Event()
        self._may_vacuum_queue = True  # False once this role was found not to own the queue's tables

    def stop(self, fast: bool = False) -> None:
        """Return from `run()` at once (there is nothing to drain: `fast` is
        accepted for the same signal wiring as `Worker`). Safe from signal
        handlers and other threads."""
        self._stopped.set()

    def run(self) -> None:
        """Sweep and tick until stopped."""
        outage = Outage("maintenance", first_wait=SCHEDULER_TICK)
        conn = None
        next_sweep = next_rollup = next_sample = next_prune = next_strays = time.monotonic()
        try:
            while not self._stopped.is_set():
                try:
                    if conn is None:
                        conn = psycopg.connect(self.database_url, **liveness.connection_kwargs(self.application_name))
                    sweep_due = time.monotonic() >= next_sweep
                    if sweep_due:
                        self.sweep.sweep(conn)
                        whole_queue = time.monotonic() >= next_strays
                        db.sort_lanes(conn, whole_queue)  # a run admitted while a limit changed, a missed release
                        if whole_queue:
                            next_strays = time.monotonic() + STRAYS_INTERVAL
                        db.sweep_keys(conn)  # the fair queues' idle keys go (0032)
                        self._vacuum_queue(conn)
                        next_sweep = time.monotonic() + self.sweep.next_probe_in(self.interval)
                    scheduler.tick(conn)  # logs what it fires
                    if time.monotonic() >= next_rollup:
                        sample = time.monotonic() >= next_sample
                        db.roll_up_minutes(conn, sample_backlog=sample)
                        next_rollup = time.monotonic() + ROLLUP_INTERVAL
                        next_sample = time.monotonic() + SAMPLE_INTERVAL if sample else next_sample
                        if time.monotonic() >= next_prune:
                            db.prune_minutes(conn)
                            next_prune = time.monotonic() + PRUNE_MINUTES_INTERVAL
                    self.history.run(conn, sweep_due)
                    outage.over()
                    wait = min(SCHEDULER_TICK, next_sweep - time.monotonic())
                except db.CONNECTION_ERRORS as exc:  # a server gone, or one that turned read-only (a standby)
                    if conn is not None:
                        conn.close()
                    conn = None
                    wait = outage.failed(exc)
                self._stopped.wait(max(wait, 0.01))  # never a busy loop, whatever the clock says
        finally:
            if conn is not None:
                conn.close()

    def _vacuum_queue(self, conn: psycopg.Connection) -> None:
        """VACUUM the queue's tables once they hold VACUUM_QUEUE_AT dead row
        versions. Every run inserts and deletes a ready row, and each claim
        walks the dead entries at the front of the ready order until a vacuum
        removes them: autovacuum visits a database once a minute, by when a
        busy queue has left tens of thousands (queue.sql, queue_dead_tuples).
        A vacuum removes nothing deleted after the oldest snapshot still
        open: a table it left with VACUUM_QUEUE_AT dead rows is rewritten with
        its live rows alone (db.compact_queue), else the claims' walk would
        grow with every run for as long as that snapshot stays open. Only
        where this role owns them; else autovacuum alone does it."""
        if not self._may_vacuum_queue:
            return
        owned, dead = db.queue_dead_tuples(conn)
        if not owned:
            self._may_vacuum_queue = False
            log.info("maintenance: the queue's tables are vacuumed by autovacuum alone: this role does not own them")
        elif dead >= VACUUM_QUEUE_AT:
            db.vacuum_queue(conn)
            compacted = db.compact_queue(conn, VACUUM_QUEUE_AT, COMPACT_QUEUE_LIVE, COMPACT_WAIT_MS)
            if compacted:
                log.debug("maintenance: rewrote %s: a snapshot held open kept the vacuum from removing their dead rows",
                          ", ".join(compacted))


class Outage:
    """How a loop waits for a database that does not answer: the wait
    doubles from `first_wait` up to RETRY_CEILING, and the outage is logged
    once when it starts and once when it ends, however long it lasts."""

    def __init__(self, who: str, first_wait: float):
        self.who = who
        self.first_wait = first_wait
        self.wait: float | None = None  # None: the database answers

    def failed(self, exc: psycopg.Error) -> float:
        """Seconds to wait before the next attempt. Raises NoSuchDatabase
        when the server answers that the database or role does not exist."""
        liveness.refuse_missing_database(exc)
        if self.wait is None:
            log.warning("%s: the database is unreachable (%s); retrying until it answers", self.who, first_line(exc))
            self.wait = self.first_wait
        else:
            self.wait = min(self.wait * 2, RETRY_CEILING)
        return self.wait

    def over(self) -> None:
        if self.wait is not None:
            log.info("%s: the database answers again", self.who)
            self.wait = None
