"""One worker process's claim loop: liveness lock, LISTEN wake-up, claims,
a thread pool of run slots, catchup, fencing and drain.

Embeddable in any host process::

    worker = Worker(database_url, name="web-0-1", threads=8)
    worker.run()          # blocks; worker.stop() from another thread or a signal handler

The control connection (one per worker, used only by the thread in `run`)
holds the session advisory lock of the worker's name for its whole life,
LISTENs for new runs and claims runs for free slots. Step writes go through a
pool. While runs are waiting, a run that ends claims the next one for its
slot in the statement that ends it, and its thread goes on with that one: a
busy worker needs no claim statement of its own and no hand-off per run.
A slot takes its next run while its end commits: the end of a short run
claims a second run ahead (at most one per slot waits so), which the slot
the next end frees starts on another thread of the pool at once, before
that end's commit returns.

Runs of `async def` workflows have slots of their own (`async_slots`), all
on the runner's one event loop: a slot there is a task, not a thread. A
process whose workflows are all of one kind claims for that kind's free
slots only; one with both claims for the free slots of both, and a run
whose kind has none free waits, claimed, for one (route the two kinds to
different workers to avoid that).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import psycopg
from psycopg_pool import ConnectionPool

from everystep import db, liveness, metrics, registry, waits
from everystep.errors import Drain, LostClaim
from everystep.logs import first_line
from everystep.runner import IO_THREADS, Execution, Fence, Runner, Successors
from everystep.schema import MAX_KEY
from everystep.slot_threads import SlotThreads

log = logging.getLogger("everystep")

PING_INTERVAL = 2.0  # seconds between checks of the control connection when idle
RECONNECT_CEILING = 5.0  # seconds: the longest wait between two attempts to reconnect
CLAIM_LANDING_TIMEOUT = 5.0  # seconds a fast stop waits for claims in flight on ending runs
LOOP_END_WAIT = 10.0  # seconds an interrupted worker waits for its control loop to end before the shutdown
# Past a waiting run's due time before claiming it (seconds): its claim's now()
# must not be a hair before the due time.
DUE_MARGIN = 0.002
# A run that took less than this (seconds) claims a second run ahead as it
# ends, when fewer than one per slot wait so: the end's commit then overlaps
# the next run's execution. A longer run claims only its successor: a run
# claimed ahead waits for a slot to free, and it is not worth it. A worker of
# one slot claims none ahead: its runs start one by one in the queue's order
# (with two ends in one batch, whichever thread woke first would go first).
AHEAD_RUN = 0.05
# A run claimed ahead that found no free slot in this long (the slots took
# long runs meanwhile) is given back to the queue, for another worker.
AHEAD_WAIT = 1.0


def control_connection(database_url: str, name: str) -> psycopg.Connection:
    """The worker's control connection, with TCP keepalives on both ends (the
    server's side is what frees the lock of a vanished host)."""
    conn = psycopg.connect(database_url, **liveness.connection_kwargs(f"everystep {name} control"))
    db.prepare_control_session(
        conn, liveness.KEEPALIVE_IDLE, liveness.KEEPALIVE_INTERVAL, liveness.KEEPALIVE_COUNT
    )
    return conn


class WorkerFence(Fence):
    """Ties the executions' writes to the worker's liveness lock: while the
    lock is not held, steps wait at their boundaries and writes wait;
    executions abandoned (after the grace, or found taken away on relock)
    get `LostClaim`; a draining worker stops runs at the next step boundary.
    Executions are known by their token."""

    def __init__(self) -> None:
        self.held = threading.Event()
        self.draining = False
        self.abandoned: set[int] = set()  # tokens of executions that must not write any more
        # The tokens of claims whose commit has not returned yet, each with
        # the event set once it has (Worker._confirm_claim).
        self.uncommitted: dict[int, threading.Event] = {}

    def check(self, run: db.ClaimedRun) -> None:
        # Not `before_write`: a run's first step starts while its claim commits.
        if self.draining:
            raise Drain()
        self._held(run)

    def before_write(self, run: db.ClaimedRun) -> None:
        self.committed(run)
        self._held(run)

    def committed(self, run: db.ClaimedRun) -> None:
        if (commit := self.uncommitted.get(run.token)) is not None:
            commit.wait()

    def _held(self, run: db.ClaimedRun) -> None:
        while not self.held.is_set() and run.token not in self.abandoned:
            self.held.wait(0.5)
        if run.token in self.abandoned:
            raise LostClaim(f"run {run.id} was abandoned: the worker lost its lock, or the run was taken away")

    def clear(self, run: db.ClaimedRun) -> bool:
        return (self.held.is_set() or run.token in self.abandoned) and run.token not in self.uncommitted

    def wait_after_error(self, run: db.ClaimedRun, attempt: int, error: Exception) -> None:
        # Retried until it goes through or the execution is abandoned; meanwhile
        # the control loop notices an outage and `before_write` waits for it.
        # The first retry is at once: the common cause is a pooled connection
        # that died while idle (a killed session, a restarted pooler), and a
        # wait would only lengthen the write (for an unsafe step, the time a
        # crash blocks its run). A database that is down gets the back-off.
        if attempt == 0:
            log.warning("database write failed (%s); retrying", first_line(error), extra={"run": str(run.id)})
            return
        time.sleep(min(0.05 * 2 ** (attempt - 1), 2.0))


def freeze_what_is_loaded() -> None:
    """For a process that is a worker from now on (the supervisor's child,
    `everystep worker`, `manage.py everystep_worker`), not one that hosts a
    worker beside other code: what is loaded by now (the modules, the
    application, the config) lives as long as the process, so it is moved
    out of the garbage collector's walks (gc.freeze): a full collection
    then walks only what was allocated since (docs/performance.md)."""
    gc.collect()
    gc.freeze()


# Seconds a run given back (its workflow cannot be imported here) waits at
# most for the control loop to stop claiming that workflow.
GIVE_BACK_WAIT = 2.0


class Worker(Successors):
    """Claims and executes runs under one name, with `threads` run slots for
    sync workflows and `async_slots` for async ones."""

    def __init__(
        self,
        database_url: str,
        name: str,
        threads: int = 8,
        async_slots: int = 100,
        poll: float = 1.0,
        drain: float = 30.0,
        grace: float = 10.0,
        max_crashes: int = 3,
        on_claim: Callable[[int], None] | None = None,
        on_load: Callable[[int, int], None] | None = None,
        on_lock: Callable[[bool], None] | None = None,
        workflows: Sequence[str] | None = None,
        limits: Mapping[str, int | None] | None = None,
        direct_url: str | None = None,
        per_key_limits: Mapping[str, int | None] | None = None,
        priorities: Mapping[str, int | None] | None = None,
        rate_limits: Mapping[str, tuple[float, float, int]] | None = None,
        allow_newer_schema: bool = False,
    ):
        """`direct_url`: when `database_url` goes through a pooler in
        transaction mode (PgBouncer), a URL straight to PostgreSQL for the
        control session (its advisory lock, LISTEN and claims need a session
        of their own); the pool then keeps no session state.
        `allow_newer_schema`: run on a schema a newer everystep migrated (else
        `run()` raises NewerSchema before it claims anything)."""
        if not name or len(name) > MAX_KEY:
            raise ValueError(f"a worker name must have 1 to {MAX_KEY} characters")
        self.database_url = database_url
        self.direct_url = direct_url
        self.name = name
        self.threads = threads
        self.async_slots = async_slots
        self.poll = poll
        self.drain = drain
        self.grace = grace
        self.max_crashes = max_crashes
        self.on_claim = on_claim  # called with the number of runs claimed
        self.on_load = on_load  # called with (runs in flight, threads) when it changes
        self.on_lock = on_lock  # called with True once the name's lock is held, False when it is not any more
        # The workflows this worker runs: name patterns (`*`, `?`), None for all.
        self.workflows = None if workflows is None else tuple(workflows)
        self.routes = db.routes_of(self.workflows)  # (Successors.) as LIKE patterns
        # (Successors.) The workflows found not importable here: their runs are
        # given back and not claimed any more (replaced whole, never changed in place).
        self.skipped: list[str] = []
        self._skipped_published: list[str] = []
        self.limits = dict(limits or {})  # concurrency overrides by workflow name (config)
        self.per_key_limits = dict(per_key_limits or {})  # concurrency_per_key overrides (config)
        self.priorities = dict(priorities or {})  # default priority overrides (config)
        self.rate_limits = dict(rate_limits or {})  # (rate, per, burst) by name (config `rate_limits:`)
        self.allow_newer_schema = allow_newer_schema

        self.fence = WorkerFence()
        self._stopping = False
        self._fast = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # The live executions, by token (-> run id); what the slots are doing.
        # Guarded by _lock, like the backlog, _escaped, _claiming and _reconcile.
        self._executing: dict[int, uuid.UUID] = {}
        # Its run ids: a run executes at most once at a time here (every slot
        # taken asks this first; a new claim of a run whose abandoned
        # execution still runs waits in the backlog), looked up at every end
        # of a run rather than searched for in _executing.
        self._executing_runs: set[uuid.UUID] = set()
        self._async: set[int] = set()  # the tokens of _executing that are async runs'
        self._cancels_checked = 0.0  # when the async runs' cancel requests were last looked for
        self._lock = threading.Lock()
        self._claiming: set[int] = set()  # tokens of ending runs whose statement may claim a successor
        self._claims_landed = threading.Condition(self._lock)
        self._published_load: int | None = None
        self._backlog: list[db.ClaimedRun] = []  # held by us (claimed, with their tokens), not started yet
        # Of the backlog, the runs claimed ahead (token -> when they came):
        # they do not hold back a successor's claim, and go back to the queue
        # after AHEAD_WAIT.
        self._ahead: dict[int, float] = {}
        self._ahead_asked: set[int] = set()  # tokens of ending runs whose statement may claim a run ahead
        # Tokens of sync executions whose end is being written: their slot is
        # free for the next run meanwhile (they stay in _executing: still held).
        self._ending: set[int] = set()
        self._began: dict[int, float] = {}  # token -> when its sync execution took its slot
        self._escaped: set[db.Claim] = set()  # executions that escaped with a BaseException
        self._reconcile = False  # look for runs held under our name that no execution of ours holds
        self._conn: psycopg.Connection | None = None
        # Registered in everystep_waiting, so scheduling notifies us (only
        # while a slot is free: a full worker needs no notification).
        self._waiting = False
        self._extra = {"runner": name}
        # Counted at every run a slot goes on with: the labelled child looked up once.
        self._claims_counter = metrics.CLAIMS.labels(name)
        # Notifications read are counted through metrics.TALLY, applied once
        # per turn of the loop (_publish_load), after the claim they lead to,
        # not on a pickup's path (about 25 us of it at rest on a slow machine,
        # docs/performance.md).
        self._notified_counter = metrics.WAKEUPS.labels(name)
        # The control role (see _control), and the loop's state that passes with it.
        self._role = threading.Condition()
        self._role_free = True  # no thread holds the role
        self._role_waiting = 0  # role threads waiting to take it
        self._loop_ended = threading.Event()  # set once the loop ended (the main thread waits on it, not on _role)
        self._loop_error: BaseException | None = None
        self._last_query = 0.0  # when the loop last queried its connection
        self._drain_deadline: float | None = None
        self._claimed: tuple[int, int] | None = None  # the last holder's claim: (runs, free slots), to count
        # The last claim's commit, still on its way, the tokens it claimed
        # (its runs start meanwhile) and the event their fence waits on:
        # confirmed before the control connection runs anything else.
        self._uncommitted: tuple[Callable[[], None], list[int], threading.Event] | None = None

    # ---------------------------------------------------------------- control

    def stop(self, fast: bool = False) -> None:
        """Drain (fast=False) or requeue everything at once (fast=True), then
        return from `run()`. Safe from signal handlers and other threads."""
        self._stopping = True
        self._fast = self._fast or fast
        self.fence.draining = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the loop is awake anyway

    def run(self) -> None:
        """Run until stopped. On return nothing is claimed under this name,
        unless the database was unreachable at the end (then the sweep
        recovers what is left once the lock is released)."""
        # While the database is away the pool retries its connections with a
        # back-off that doubles without bound; giving up after 2 s (and a 2 s
        # wait for a connection) makes each retried write ask for a fresh
        # connection at once, so the runs go on as soon as the database is back.
        # One connection per run slot, and as many again for the writes of
        # parallel branches and of late step outcomes; one per I/O thread of
        # the async runs' loop, and of its lane for unsafe steps' outcomes.
        io_threads = min(IO_THREADS, self.async_slots)
        self.pool = ConnectionPool(
            self.database_url, min_size=1, max_size=2 * self.threads + 2 + 2 * io_threads,
            kwargs=liveness.connection_kwargs(f"everystep {self.name}"),
            timeout=2, reconnect_timeout=2, name=f"everystep-{self.name}", open=False,
            **self._pool_session(),
        )
        self.pool.open(wait=False)
        self.runner = Runner(self.pool, self.name, self.fence, successors=self, io_threads=io_threads,
                             step_threads=self.threads, give_back_unknown=True)
        # Twice the slots: a slot lent while its run's end commits goes on on another thread.
        self.slot_threads = SlotThreads(2 * self.threads, f"everystep-{self.name}")
        metrics.POOL_SIZE.labels(self.name).set(self.threads)
        metrics.ASYNC_SLOTS.labels(self.name).set(self.async_slots)
        metrics.STARTED_AT.labels(self.name).set(time.time())
        self._publish_load()
        try:
            if self._take_lock(catchup=True):
                self._control()
        finally:
            self._shutdown()

    def _pool_session(self) -> dict:
        """Step rows and run ends commit synchronously: set once per session,
        or per transaction through a transaction-pooling PgBouncer."""
        if self.direct_url:
            return {"connection_class": db.TransactionPooledConnection}
        return {"configure": db.prepare_session}

    # ---------------------------------------------------------------- the lock

    def _take_lock(self, catchup: bool) -> bool:
        """Connect and take the name's lock, waiting while another process
        holds it; then LISTEN and pick up the runs held under this name.
        False if stopped before the lock was taken."""
        lost_at = time.monotonic()
        delay = 0.1
        waiting_logged = False
        while True:
            try:
                conn = control_connection(self.direct_url or self.database_url, self.name)
                taken_at = None  # when this session first found the lock held by another
                try:
                    if catchup:
                        db.check_schema(conn, self.allow_newer_schema)  # NewerSchema: refused, nothing claimed
                    while not db.try_lock(conn, self.name):
                        taken_at = taken_at or time.monotonic()
                        if not waiting_logged:
                            log.warning("lock of %s is held by another live process; waiting", self.name,
                                        extra=self._extra)
                            waiting_logged = True
                        if self._stopping and not self._executing:
                            conn.close()
                            return False
                        self._abandon_after_grace(taken_at)
                        self._sleep(min(self.poll, 1.0))
                    db.listen(conn)
                    db.publish_route(conn, self.name, self.routes, self.skipped)
                    self._skipped_published = self.skipped
                    self._conn = conn
                    self._waiting = False
                    if catchup:
                        db.apply_limits(conn, self.concurrency_limits(), *self.flow_options())
                        db.put_rate_limits(conn, self.rate_limits)
                        self._catchup(conn)
                    else:
                        self._after_relock(conn)
                except BaseException:
                    conn.close()
                    raise
                self.fence.held.set()
                self._lock_changed(True)
                log.info("holding the lock of %s", self.name, extra=self._extra)
                return True
            except db.CONNECTION_ERRORS as exc:
                liveness.refuse_missing_database(exc)  # NoSuchDatabase: an answer, not an outage
                log.warning("database unreachable (%s); retrying in %.1f s", first_line(exc), delay,
                            extra=self._extra)
            if self._stopping and not self._executing:
                return False
            if self._stopping:  # a drain does not wait for the database for ever
                self._abandon_after_grace(lost_at)
            self._sleep(delay)
            # At least two attempts per grace: a live worker holds its lock again
            # well within the grace of a sweep that saw the server change.
            delay = min(delay * 2, RECONNECT_CEILING, max(self.grace / 2, 0.5))

    def concurrency_limits(self) -> dict[str, int | None]:
        """The limit of every workflow this process knows (imported, or in
        the overrides): the override, else the decorator's; None: unlimited."""
        limits = {name: getattr(fn, "__everystep_concurrency__", None) for name, fn in registry.WORKFLOWS.items()}
        limits.update(self.limits)
        return limits

    def flow_options(self) -> tuple[dict[str, int | None], dict[str, int | None]]:
        """The per-key limit and the default priority of every workflow this
        process knows, as for `concurrency_limits`."""
        per_key = {name: getattr(fn, "__everystep_concurrency_per_key__", None)
                   for name, fn in registry.WORKFLOWS.items()}
        per_key.update(self.per_key_limits)
        priorities = {name: getattr(fn, "__everystep_priority__", None) for name, fn in registry.WORKFLOWS.items()}
        priorities.update(self.priorities)
        return per_key, priorities

    def _abandon_after_grace(self, since: float) -> None:
        """A worker whose lock has been held by another session for the grace
        (the sweep recovering its runs, a second process under its name), or
        that stops while the database is away, stops writing about its runs:
        whoever recovers them owns them now. One that merely cannot reach the
        database (a restart, a failover) keeps them, paused: once it holds its
        lock again, `_after_relock` abandons those recovered meanwhile and the
        others go on, however long the database was away."""
        if time.monotonic() - since < self.grace:
            return
        with self._lock:
            fresh = set(self._executing) - self.fence.abandoned
            self.fence.abandoned |= fresh
            self._backlog.clear()
            self._ahead.clear()
        if fresh:
            log.warning("lock not regained within %.0f s: abandoning %d runs", self.grace, len(fresh),
                        extra=self._extra)

    def _lost_lock(self, exc: Exception) -> None:
        log.warning("lost the control connection (%s); pausing steps and reconnecting", first_line(exc),
                    extra=self._extra)
        self.fence.held.clear()
        self._lock_changed(False)
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def _after_relock(self, conn: psycopg.Connection) -> None:
        """The lock is ours again after a loss. Executions whose claim is no
        longer on the run's row (recovered by someone else meanwhile, and
        perhaps claimed again) are abandoned before any of their writes goes
        on; so are backlog entries. Runs held under this name that no
        execution of ours holds are claimed again and replayed."""
        # Only what was known before the read is judged by it: a run's end
        # may claim a successor meanwhile (the writers reconnect on their own),
        # whose claim the read may not see.
        with self._lock:
            known = set(self._executing) | {run.token for run in self._backlog}
        held = set(db.held_claims(conn, self.name))
        with self._lock:
            lost = {token for token, run_id in self._executing.items()
                    if token in known and db.Claim(run_id, token) not in held} - self.fence.abandoned
            self.fence.abandoned |= lost
            self._backlog = [run for run in self._backlog
                             if run.token not in known or db.Claim(run.id, run.token) in held]
            self._ahead = {run.token: self._ahead[run.token] for run in self._backlog if run.token in self._ahead}
            self._reconcile = True
        if lost:
            log.warning("%d runs in flight were recovered elsewhere while the lock was lost; abandoning them",
                        len(lost), extra=self._extra)

    def _catchup(self, conn: psycopg.Connection) -> None:
        """Runs `running` under this name were left by a previous incarnation
        that died: claim them again, count the crash (poison runs fail), then
        replay the rest."""
        held = db.reclaim_held(conn, self.name)
        if not held:
            return
        poisoned = liveness.fail_poison_runs(conn, self.name, [db.Claim(run.id, run.token) for run in held],
                                             self.max_crashes)
        resumed = [run for run in held if run.id not in poisoned]
        if resumed:
            log.info("catchup: resuming %d runs left running under %s", len(resumed), self.name, extra=self._extra)
            self._claims_counter.inc(len(resumed))
        with self._lock:
            self._backlog.extend(resumed)

    # ---------------------------------------------------------------- the control role

    def _control(self) -> None:
        """Run the control loop until it ends. The loop runs on two threads
        of its own in turn (the control role): the holder that claims runs
        for idle slots starts the first of them itself, as a slot, and
        hands the role to the other thread, which was waiting for it. The
        run then starts with no hand-off between threads, which cost a
        pickup about 0.1 ms at rest (docs/performance.md). This thread (the
        process's main one, where signals land) only waits for the end."""
        self._last_query = time.monotonic()
        for n in range(2):
            threading.Thread(target=self._take_role, name=f"everystep-{self.name}-control-{n}", daemon=True).start()
        try:
            while not self._loop_ended.wait(1.0):
                pass
        except BaseException:
            # Interrupted here (a KeyboardInterrupt where no signal handler
            # stops the worker): the loop ends as at a fast stop before the
            # shutdown closes its connection.
            self.stop(fast=True)
            self._loop_ended.wait(LOOP_END_WAIT)
            raise
        if self._loop_error is not None:
            raise self._loop_error

    def _take_role(self) -> None:
        """A role thread's life: hold the role when it is free, run the loop,
        and serve the run it handed the role over for, until the loop ends."""
        while True:
            with self._role:
                self._role_waiting += 1
                while not self._role_free and not self._loop_ended.is_set():
                    self._role.wait()
                self._role_waiting -= 1
                if self._loop_ended.is_set():
                    return
                self._role_free = False
            try:
                run = self._loop()
            except BaseException as exc:  # noqa: BLE001  (raised again by _control, on the main thread)
                run, self._loop_error = None, exc
            if run is None:
                with self._role:
                    self._loop_ended.set()
                    self._role.notify_all()
                return
            self._serve_slot(run)

    def _hand_over(self) -> None:
        """The role goes to the role thread waiting for it, the one thread
        waiting on _role then (the main thread waits for the loop's end on an
        event of its own: a notify() that woke it instead left the role to
        nobody until this thread had served its run)."""
        with self._role:
            self._role_free = True
            self._role.notify()

    # ---------------------------------------------------------------- the loop

    def _loop(self) -> db.ClaimedRun | None:
        """The control loop, from where the last holder of the role left it.
        None once it ended; a claimed run when it handed the role over to
        start that run on this thread."""
        while True:
            if self._uncommitted is not None:
                try:
                    self._confirm_claim()
                except db.CONNECTION_ERRORS as exc:
                    self._lost_lock(exc)
            if self._stopping:
                if self._fast:
                    self._requeue_everything("fast stop")
                    return None
                if self._drain_deadline is None:
                    self._drain_deadline = time.monotonic() + self.drain if self.drain > 0 else float("inf")
                    log.info("draining %d runs in flight", len(self._executing), extra=self._extra)
                if not self._executing and not self._claiming:
                    self._requeue_backlog()
                    return None
                if time.monotonic() >= self._drain_deadline:
                    self._requeue_everything("drain deadline")
                    return None
            try:
                if self._conn is None:
                    if not self._take_lock(catchup=False):
                        return None
                conn = self._conn
                if self._stopping:
                    self._requeue_backlog()
                more = False
                next_due = None
                if self._claimed is not None:  # the last holder claimed and handed the role over: count it
                    claimed, self._claimed = self._claimed, None
                    more = self._after_claim(conn, *claimed)
                elif not self._stopping:
                    more, mine = self._fill_slots(conn)
                    if mine is not None:
                        self._hand_over()
                        return mine
                if not self._stopping:
                    self._look_for_cancels(conn)
                    self.runner.give_back_idle()
                    if not more and any(self._free()):
                        # Idle slots: wake when the next waiting run becomes due.
                        next_due = db.next_due_in(conn)
                    self._last_query = time.monotonic()
                self._publish_load()
                timeout = 0 if more else min(self.poll, PING_INTERVAL)
                if next_due is not None:
                    timeout = min(timeout, max(0.0, next_due + DUE_MARGIN))
                if self._drain_deadline is not None:
                    timeout = min(timeout, max(0.0, self._drain_deadline - time.monotonic()))
                if self._wait(conn, timeout):
                    continue  # notified: claim now
                if time.monotonic() - self._last_query >= PING_INTERVAL:
                    db.ping(conn)
                    self._last_query = time.monotonic()
            except db.CONNECTION_ERRORS as exc:
                self._lost_lock(exc)

    def _fill_slots(self, conn: psycopg.Connection) -> tuple[bool, db.ClaimedRun | None]:
        """Start runs in the free slots: the backlog first, then claims.
        Whether to claim again at once (a notification came in while
        claiming), and the claimed run this thread is to serve itself (when
        the other role thread waits to take the role over; the claim is then
        counted by that thread), if any."""
        if self._skipped_published is not self.skipped:
            skipped = self.skipped
            db.publish_route(conn, self.name, self.routes, skipped)  # for readiness and the unserved gauge
            self._skipped_published = skipped
        self._give_back_ahead(conn)
        with self._lock:
            escaped, self._escaped = self._escaped, set()
            escaped = [claim for claim in escaped if claim.token not in self.fence.abandoned]
        if escaped:
            liveness.fail_poison_runs(conn, self.name, escaped, self.max_crashes)
            db.requeue_held(conn, self.name, escaped, "escaped")
        free = sum(self._free(claiming=True))
        if free <= 0:
            if self._waiting:
                db.stop_waiting(conn, self.name)
                self._waiting = False
            return False, None
        with self._lock:
            reconcile = self._reconcile and not self._claiming  # claims in flight wake us when they land
            if reconcile:
                # Cleared before the tokens are read: a run ending meanwhile sets it again.
                self._reconcile = False
                keep = [*self._executing, *(run.token for run in self._backlog)]
        if reconcile:
            found = db.reclaim_held(conn, self.name, keep)
            if found:
                log.info("found %d runs held under %s that no execution here holds; replaying them", len(found),
                         self.name, extra=self._extra)
            with self._lock:
                self._backlog.extend(found)
        elif self._reconcile:
            return False, None
        if self._backlog:
            self._start_backlog()
            return False, None
        if not self._waiting:
            db.wait_for_runs(conn, self.name)  # before the claim: no run scheduled meanwhile is missed
            self._waiting = True
        # The runs start as the claim's rows arrive; their executions read and
        # write once its commit returned (WorkerFence.committed).
        runs, confirm = db.claim_before_commit(conn, self.name, free, self.routes, skipped=self.skipped)
        if runs:
            commit = threading.Event()
            for run in runs:
                self.fence.uncommitted[run.token] = commit
            self._uncommitted = (confirm, [run.token for run in runs], commit)
        mine = None
        for run in runs:
            if self._start(run, here=mine is None and self._role_waiting > 0):
                mine = run
        if mine is not None:
            # Confirmed and counted by the next holder of the role, after the hand-over.
            self._claimed = (len(runs), free)
            return False, mine
        if runs:
            self._confirm_claim()
        return self._after_claim(conn, len(runs), free), None

    def _confirm_claim(self) -> None:
        """Wait for the last claim's commit, then let its executions read and
        write. If the connection broke meanwhile, their writes wait for the
        lock to be taken again, which abandons those whose claim did not
        commit (_after_relock); if the commit failed, nothing was claimed:
        they are abandoned at once."""
        (confirm, tokens, commit), self._uncommitted = self._uncommitted, None
        try:
            confirm()
        except db.CONNECTION_ERRORS:
            self.fence.held.clear()
            raise
        except psycopg.Error as exc:
            log.warning("the commit of a claim of %d runs failed (%s); their executions stop", len(tokens),
                        first_line(exc), extra=self._extra)
            with self._lock:
                self.fence.abandoned.update(token for token in tokens if token in self._executing)
                self._backlog = [run for run in self._backlog if run.token not in tokens]
        finally:
            for token in tokens:
                self.fence.uncommitted.pop(token, None)
            commit.set()

    def _after_claim(self, conn: psycopg.Connection, claimed: int, free: int) -> bool:
        """Count a claim of `claimed` runs for `free` slots; whether to claim
        again at once (a notification came in while claiming)."""
        if claimed:
            self._claims_counter.inc(claimed)
            if self.on_claim:
                self.on_claim(claimed)
        else:
            metrics.EMPTY_CLAIMS.labels(self.name).inc()
        return self._drain_notifications(conn) and claimed < free

    def _wait(self, conn: psycopg.Connection, timeout: float) -> bool:
        """Wait for a notification, a freed slot or a stop; True if notified."""
        if self._drain_notifications(conn):
            return True  # it came in during the loop's own statements: already read off the socket
        if timeout > 0:
            if self._wake_r in waits.readable([conn.fileno(), self._wake_r], timeout):
                os.read(self._wake_r, 4096)
        return self._drain_notifications(conn)

    def _drain_notifications(self, conn: psycopg.Connection) -> bool:
        received = db.notifications(conn)
        if received:
            metrics.TALLY.count(self._notified_counter, received)
        return received > 0

    def _sleep(self, seconds: float) -> None:
        if waits.readable([self._wake_r], seconds):
            os.read(self._wake_r, 4096)

    # ---------------------------------------------------------------- runs

    def _give_back_ahead(self, conn: psycopg.Connection) -> None:
        """Runs claimed ahead that found no free slot within AHEAD_WAIT go
        back to the queue (each execution ended so is recorded as `given back`)."""
        due = time.monotonic() - AHEAD_WAIT
        with self._lock:
            if not self._ahead or min(self._ahead.values()) > due:
                return
            stale = [run for run in self._backlog if self._ahead.get(run.token, due + 1) <= due]
            for run in stale:
                self._backlog.remove(run)
                del self._ahead[run.token]
        requeued = db.requeue_held(conn, self.name, [db.Claim(run.id, run.token) for run in stale], "given back")
        metrics.REQUEUED.labels(self.name).inc(len(requeued))

    def _free(self, claiming: bool = False) -> tuple[int, int]:
        """The free sync and async slots. `claiming`: only those of the kinds
        of workflow this process has (no async one: sync slots only)."""
        with self._lock:
            free_sync = self.threads - self._sync_slots_taken()
            free_async = self.async_slots - len(self._async)
        if claiming:
            has_sync, has_async = registry.kinds()
            free_sync, free_async = free_sync if has_sync else 0, free_async if has_async else 0
        return max(free_sync, 0), max(free_async, 0)

    def _start_backlog(self) -> None:
        """Start the runs of the backlog that have a free slot of their kind,
        oldest first; a run that an earlier (abandoned) execution of ours is
        still executing waits there until that execution is gone."""
        starting = []
        with self._lock:
            busy = set(self._executing_runs)  # and the runs started here
            free = {False: self.threads - self._sync_slots_taken(),
                    True: self.async_slots - len(self._async)}
            for run in list(self._backlog):
                kind = registry.is_async(run.name)
                if run.id not in busy and free[kind] > 0:
                    self._backlog.remove(run)
                    self._ahead.pop(run.token, None)
                    starting.append(run)
                    busy.add(run.id)
                    free[kind] -= 1
        for run in starting:
            self._start(run)

    def _start(self, run: db.ClaimedRun, here: bool = False) -> bool:
        """Start a run in a slot of its kind (or put it in the backlog, until
        one is free). `here`: a sync run is not submitted to a slot's thread
        but left to the caller to serve on its own (True when it is)."""
        asynchronous = registry.is_async(run.name)
        with self._lock:
            if run.id in self._executing_runs or not self._slot_free(asynchronous):
                self._backlog.append(run)  # claimed: started once the old execution is gone, or a slot is free
                return False
            self._take_slot(run, asynchronous)
        if asynchronous:
            self.runner.loop().submit(self._serve_async_slot(run))
        elif here:
            return True
        else:
            self.slot_threads.submit(self._serve_slot, run)
        return False

    def _slot_free(self, asynchronous: bool) -> bool:
        """(Under _lock.) Whether a slot of this kind is free."""
        if asynchronous:
            return len(self._async) < self.async_slots
        return self._sync_slots_taken() < self.threads

    def _sync_slots_taken(self) -> int:
        """(Under _lock.) The sync slots taken: the sync executions but those
        whose end is being written (their slot is lent meanwhile)."""
        return len(self._executing) - len(self._async) - len(self._ending)

    def _take_slot(self, run: db.ClaimedRun, asynchronous: bool) -> None:
        """(Under _lock.) The run is executing in a slot of its kind."""
        self._executing[run.token] = run.id
        self._executing_runs.add(run.id)
        if asynchronous:
            self._async.add(run.token)
        else:
            self._began[run.token] = time.monotonic()

    def _take_waiting(self) -> db.ClaimedRun | None:
        """(Under _lock.) The oldest sync run of the backlog that may start
        now, in a slot it takes, if any."""
        if not self._backlog or not self._slot_free(False):
            return None
        for run in self._backlog:
            if run.id not in self._executing_runs and not registry.is_async(run.name):
                self._backlog.remove(run)
                self._ahead.pop(run.token, None)
                self._take_slot(run, False)
                return run
        return None

    def cannot_import(self, workflow: str, why: str) -> None:
        """(Successors.) A run of `workflow` is being given back: claim no more of them."""
        metrics.UNKNOWN_WORKFLOW_RUNS.labels(self.name, workflow).inc()
        with self._lock:
            if workflow not in self.skipped:
                self.skipped = [*self.skipped, workflow]
            skipped = self.skipped
        self._wake()  # the control loop says so in the database
        # The run goes back once the control loop claims with the new list: a
        # claim of its in flight with the old one could take the run again.
        deadline = time.monotonic() + GIVE_BACK_WAIT
        while self._skipped_published is not skipped and not self._stopping and time.monotonic() < deadline:
            time.sleep(0.005)

    def reserve(self, run: db.ClaimedRun) -> int:
        """(Successors.) How many runs the statement that ends a run may
        claim: none while the worker is stopping, has runs of its own to start
        first (other than runs claimed ahead), looks for runs it lost track
        of, lets an abandoned execution run on (the claim could bring its run
        back), or is not sure of its lock; else a successor for its slot, and
        a second run ahead when the worker has several slots, the run was
        short and fewer than one per slot wait so. A sync run's slot is free
        while its end is written: a run waiting for one starts in it on
        another thread."""
        with self._lock:
            if (self._stopping or self._reconcile or len(self._backlog) > len(self._ahead) or self.fence.abandoned
                    or not self.fence.held.is_set()):
                return 0
            self._claiming.add(run.token)
            if run.token in self._async:
                return 1
            claims = 1
            began = self._began.get(run.token)
            if (self.threads > 1 and began is not None and time.monotonic() - began < AHEAD_RUN
                    and len(self._ahead) + len(self._ahead_asked) < self.threads):
                self._ahead_asked.add(run.token)
                claims = 2
            self._ending.add(run.token)
            waiting = self._take_waiting()
        if waiting is not None:
            self.slot_threads.submit(self._serve_slot, waiting)
        return claims

    def _serve_slot(self, run: db.ClaimedRun) -> None:
        """A slot's life: execute a run, then the successor claimed by the
        statement that ended it, on this same thread, until a run ends
        without one (or with an async one, started in an async slot). The
        ending execution's token leaves the live executions in the same step
        as its successor's enters, so the slot never looks free in between."""
        while run is not None:
            try:
                execution = self.runner.execute(run)
            except BaseException:
                # SystemExit or the like out of user code: as if the worker died
                # on this run (a crash is counted, the run requeued), but it lives on.
                log.exception("run execution ended abnormally", extra={**self._extra, "run": str(run.id)})
                execution = Execution("escaped", None, False)
            run = self._ended(run, execution, asynchronous=False)

    async def _serve_async_slot(self, run: db.ClaimedRun) -> None:
        """An async slot's life, on the runner's loop, as `_serve_slot`'s."""
        while run is not None:
            try:
                execution = await self.runner.aexecute(run)
            except BaseException as exc:
                log.exception("run execution ended abnormally", extra={**self._extra, "run": str(run.id)})
                execution = Execution("escaped", None, False)
                if isinstance(exc, asyncio.CancelledError) and self._stopping:
                    self._ended(run, execution, asynchronous=True)
                    raise
            run = self._ended(run, execution, asynchronous=True)

    def _ended(self, run: db.ClaimedRun, execution: Execution, asynchronous: bool) -> db.ClaimedRun | None:
        """An execution in a slot of this kind ended: the run the slot goes on
        with (its successor, when it is of the same kind and may start now)."""
        with self._lock:
            del self._executing[run.token]
            self._executing_runs.remove(run.id)
            self._async.discard(run.token)
            self._ending.discard(run.token)
            self._began.pop(run.token, None)
            self._ahead_asked.discard(run.token)
            if run.token in self.fence.abandoned:
                self.fence.abandoned.discard(run.token)
                self._reconcile = True  # still ours in the database? then replay it
            if execution.look_again:
                self._reconcile = True
            if execution.outcome == "escaped":
                self._escaped.add(db.Claim(run.id, run.token))
            if run.token in self._claiming:
                self._claiming.discard(run.token)
                self._claims_landed.notify_all()
            successor = execution.successor
            run = other_kind = None
            if successor is not None:
                if self._stopping or successor.id in self._executing_runs:
                    self._backlog.append(successor)  # requeued, or started once the old execution is gone
                elif registry.is_async(successor.name) != asynchronous:
                    other_kind = successor
                elif self._slot_free(asynchronous):
                    self._take_slot(successor, asynchronous)
                    run = successor
                else:  # the slot went to a run waiting for one while this end was written
                    self._backlog.append(successor)
                    self._ahead[successor.token] = time.monotonic()
            if execution.ahead is not None:  # for the next slot free, this one or another
                self._backlog.append(execution.ahead)
                self._ahead[execution.ahead.token] = time.monotonic()
            if run is None and not asynchronous and not self._stopping:
                run = self._take_waiting()
            # The control loop claims for a free slot, and starts what waits
            # in the backlog but runs claimed ahead (the next free slot does).
            wake = (self._reconcile or len(self._backlog) > len(self._ahead)
                    or (run is None and (self._stopping or self._slot_free(asynchronous))))
        claimed = (successor is not None) + (execution.ahead is not None)
        if claimed:
            metrics.TALLY.count(self._claims_counter, claimed)
            if self.on_claim:
                self.on_claim(claimed)
        if other_kind is not None:
            self._start(other_kind)  # in a slot of its kind (or the backlog, until one is free)
        if wake:
            self._wake()
        return run

    def _look_for_cancels(self, conn: psycopg.Connection) -> None:
        """Every poll interval while async runs execute: the ones whose run was
        cancelled meanwhile are preempted (their async steps cancelled at the
        next await; a sync step always runs to its end)."""
        now = time.monotonic()
        if not self._async or now - self._cancels_checked < min(self.poll, PING_INTERVAL):
            return
        self._cancels_checked = now
        with self._lock:
            tokens = list(self._async)
        for token in db.cancel_requests(conn, self.name, tokens):
            self.runner.preempt(token)

    def _publish_load(self) -> None:
        """The runs in flight, to the gauge and `on_load` (the process title)
        when they changed: once per turn of the control loop, which every end
        of a run that leaves a slot free wakes, rather than on the runs'
        threads; and the figures counted since the last turn (metrics.Tally:
        the runs' threads', the notifications read)."""
        metrics.TALLY.flush()
        inflight = len(self._executing) - len(self._ending)  # a run whose end commits has left its slot
        if inflight == self._published_load:
            return
        self._published_load = inflight
        metrics.INFLIGHT.labels(self.name).set(inflight)
        if self.on_load:
            self.on_load(inflight, self.threads + (self.async_slots if registry.kinds()[1] else 0))

    def writes_to_gather(self) -> int:
        """(Successors.) How many writes a batch of step rows, or of run
        ends, may wait for: one per sync slot while every slot runs a body
        (each is lent while its run's end is written, see reserve); 1, none
        waits, once a slot has nothing to run, or in a process that has async
        workflows (their slots are held until their runs' ends commit)."""
        if registry.kinds()[1]:
            return 1
        with self._lock:
            return self.threads if self._sync_slots_taken() >= self.threads else 1

    def _lock_changed(self, held: bool) -> None:
        if self.on_lock:
            self.on_lock(held)

    def _requeue_backlog(self) -> None:
        with self._lock:
            claims = [db.Claim(run.id, run.token) for run in self._backlog]
            self._backlog.clear()
            self._ahead.clear()
        if claims and self._conn is not None:
            requeued = db.requeue_held(self._conn, self.name, claims)
            metrics.REQUEUED.labels(self.name).inc(len(requeued))

    def _requeue_everything(self, why: str) -> None:
        """Hand every run still in flight back to the queue; their executions
        can no longer write about them (the fence and the tokens both say so)."""
        with self._lock:
            # A run ending now may be claiming its successor: let it land among the runs in flight.
            self._claims_landed.wait_for(lambda: not self._claiming, CLAIM_LANDING_TIMEOUT)
            claims = [db.Claim(run_id, token) for token, run_id in self._executing.items()]
            self.fence.abandoned |= set(self._executing)
            claims += [db.Claim(run.id, run.token) for run in self._backlog]
            self._backlog.clear()
            self._ahead.clear()
        if claims and self._conn is not None:
            try:
                requeued = db.requeue_held(self._conn, self.name, claims)
            except db.CONNECTION_ERRORS as exc:
                log.warning("could not requeue on %s (%s); the sweep will recover them", why, first_line(exc),
                            extra=self._extra)
                return
            metrics.REQUEUED.labels(self.name).inc(len(requeued))
            log.warning("%s: requeued %d runs still in flight", why, len(requeued), extra=self._extra)

    def _shutdown(self) -> None:
        with self._lock:
            self.fence.abandoned |= set(self._executing)  # a straggler's writes fail instead of waiting for ever
        self.fence.held.clear()
        self._lock_changed(False)
        self.slot_threads.shutdown()
        if self._conn is not None:
            try:
                # Nothing stays claimed under a name nobody holds: whatever is
                # left (a run whose execution escaped, a claim whose answer
                # was lost) goes back to the queue before the lock is released.
                leftover = db.requeue_claimer(self._conn, self.name)
                if leftover:
                    log.warning("requeued %d runs left under %s", len(leftover), self.name, extra=self._extra)
                db.stop_waiting(self._conn, self.name)
                db.unlock(self._conn, self.name)
            except psycopg.Error:
                pass
            self._conn.close()
            self._conn = None
        self.runner.close()
        self.pool.close(timeout=1.0)
        metrics.INFLIGHT.labels(self.name).set(0)
        log.info("worker %s stopped", self.name, extra=self._extra)
