"""One execution of a held run, as the database sees it: the claim it writes
under, its connection, and every write about the run. Decides nothing about
the workflow: the replay rules (everystep.runner.Replay) say what to write.

Every write carries the run's claimer and this execution's token (the
database matches nothing once the run is no longer held by this execution),
passes the worker's fence first, and is retried on a connection error as
the fence allows. A write that matched nothing is explained
(db.why_not_written): this execution's own earlier attempt wrote it (its
answer was lost), the claim is lost, or another execution wrote the row.

A step's outcome, on the run's own thread (or any step's of an async run),
waits for the next step or the end of the run to be written with it, but
never longer than OUTCOME_DELAY: the late-outcome thread writes it then.
While every slot of the process is busy, a short write-behind step's
outcome may wait past the next step's start, for the end (HeldRun.carries).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import psycopg
from psycopg_pool import ConnectionPool

from everystep import db, metrics, serde
from everystep import transactional as step_transactions
from everystep.errors import Drain, EverystepError, LostClaim, Parked
from everystep.ids import uuid7
from everystep.schema import MAX_ATTRIBUTES, RunStatus, StepStatus
from everystep.writer import GroupWriter

log = logging.getLogger("everystep")

# A step's outcome, on the run's own thread, waits for the next step or the
# end of the run to be written with it, but never longer than this (seconds):
# a body that sleeps or computes between two steps does not leave it unwritten.
OUTCOME_DELAY = 0.05
# While every slot of the process runs a body, the outcome of a
# @step(write_behind=True) call shorter than CARRY_UNDER seconds is carried
# past the next step's start (at most CARRY_MAX of a run): a run of such
# steps then commits once, at its end (HeldRun.carries; docs/concepts.md,
# "Write-behind steps").
CARRY_UNDER = 0.002
CARRY_MAX = 16
# Stream entries of one run per commit at most: a burst of writes commits in
# several batches, so that its readers get the first entries while the later
# ones commit (a reader's work per commit, and so its latency, grows with the
# batch; a commit of 256 entries of 40 bytes costs about what one of 1 does).
STREAM_BATCH = 256
# Seconds a transactional step waits for a connection of the pool.
STEP_CONNECTION_WAIT = 30.0


class Fence:
    """How an execution's writes stay fenced by its claim, beyond the
    database's own check of the execution token. A worker supplies one tied
    to its liveness lock; this default never interrupts and retries a write
    that failed on a connection error a few times with back-off."""

    def check(self, run: db.ClaimedRun) -> None:
        """Before a step starts: raise `Drain` to stop at this step boundary,
        block while the claim is uncertain, raise `LostClaim` once it is gone."""

    def before_write(self, run: db.ClaimedRun) -> None:
        """Before every write about the run: block while the claim is
        uncertain or not committed yet (`committed`), raise `LostClaim` once
        it is gone."""

    def committed(self, run: db.ClaimedRun) -> None:
        """Before the execution's first read or write about its run: block
        until the claim's commit returned (a run may start while it is on its
        way, see db.claim_before_commit)."""

    def clear(self, run: db.ClaimedRun) -> bool:
        """Whether `check` and `before_write` would return (or raise) at once,
        without waiting: an async run's loop then calls them itself."""
        return True

    def wait_after_error(self, run: db.ClaimedRun, attempt: int, error: Exception) -> None:
        """After a write failed on a connection error: wait before the retry,
        or raise to give up."""
        if attempt >= 8:
            raise error
        time.sleep(min(0.1 * 2**attempt, 5.0))


class Successors:
    """Whether the statement that ends a run may also claim the next run for
    the slot it frees. This default never claims."""

    # The workflows a successor may be of (LIKE patterns, db.routes_of; None: all).
    routes: list[str] | None = None
    # The workflows a successor may not be of: those the runner cannot import.
    skipped: list[str] = []

    def cannot_import(self, workflow: str, why: str) -> None:
        """A run of `workflow` is being given back: its workflow cannot be
        imported here (`why`). Claim no more of its runs."""

    def reserve(self, run: db.ClaimedRun) -> int:
        """Asked once, as this execution of the run is about to end (its
        body is done; its end is to be written): how many runs the end is to
        claim, 0, 1 for the slot it frees, or 2 with one claimed ahead. More
        than 0 obliges the caller of `Runner.execute` to take the execution's
        `successor` and `ahead` (or their absence) into account once it
        returns or raises."""
        return 0

    def writes_to_gather(self) -> int:
        """How many writes a batch of step rows, or of run ends, may wait for
        under load (writer.LINGER), asked at each batch: at most one per
        slot. This default: 1, none waits."""
        return 1


class Lent(NamedTuple):
    """What a runner lends each of its executions."""
    pool: ConnectionPool
    runner: str  # the claimer's name
    fence: Fence
    successors: Successors
    step_writer: GroupWriter  # step rows of all the runner's executions, in shared commits
    end_writer: GroupWriter  # run ends (and their successors' claims), likewise


class Pending(NamedTuple):
    """A step's outcome not written yet."""
    row: db.StepRow
    started: float  # perf_counter when the step started
    since: float  # perf_counter when it began to wait
    behind: bool = False  # of a @step(write_behind=True): it may wait past the next step's start


class StepTransaction(NamedTuple):
    """What a transactional step's outcome row needs besides its value."""
    step_id: str
    name: str
    args: str  # as JSON
    kwargs: str
    started: tuple[float, float]  # (perf_counter, time) when it started
    update: bool  # the step has a row already (`retrying`)


class _StepOutcome:
    """A transactional step's outcome row, once the step returned, and what
    its write answered."""

    def __init__(self, step: StepTransaction):
        self.step = step
        self.row: db.StepRow | None = None
        self.written: db.Written | bool | None = None

    def ran(self, value: Any) -> Any:
        """The step returned `value` (unserializable: EverystepError, the step's failure)."""
        step = self.step
        self.row = db.StepRow(step.step_id, step.name, step.args, step.kwargs, StepStatus.DONE,
                              serde.dump_data(serde.encode(value)), None, step.started[1], time.time())
        return value


@functools.cache
def _step_metrics(workflow: str, step: str, status: str) -> tuple:
    """The labelled step counter and histogram (labels are code-defined
    names, so this stays small): looked up once, not at every step."""
    return metrics.STEP_RUNS.labels(workflow, step, status), metrics.STEP_DURATION.labels(workflow, step)


class HeldRun:
    """One execution of one held run: its fenced writes, and what they taught
    it (a cancel request, the successor its end claimed, whether the worker
    should look again at what it holds). Also why the execution stops
    (`halt`): set by the replay rules or by a write that found the claim
    lost, from any of the run's threads; the first reason wins.

    The thread that created it (the run's own) keeps one pooled connection,
    and one cursor on it, for the whole execution; parallel branches borrow
    a connection from the pool for each write. An async run (`asynchronous`)
    has no thread of its own: its writes are made on the runner's I/O
    threads, each with a connection borrowed for it, so a run waiting for
    its own I/O holds no connection. Use it as a context manager: inside,
    its late outcomes are written; at the end its connection goes back to
    the pool."""

    def __init__(self, lent: Lent, run: db.ClaimedRun, asynchronous: bool = False):
        self.lent = lent
        self.claim = run
        self.runner = lent.runner
        # A cancel request known to this execution: from its claim or a write's answer.
        self.cancel_requested = run.cancel_requested
        self.halt: BaseException | None = None
        self._halt_lock = threading.Lock()
        # What the end of the execution hands back (see runner.Execution).
        self.successor: db.ClaimedRun | None = None
        self.ahead: db.ClaimedRun | None = None  # a second run the end claimed, for the worker's next free slot
        self.claim_successor: int | None = None  # asked once, at the end: how many runs to claim
        self.look_again = False
        self.asynchronous = asynchronous
        self._owner = None if asynchronous else threading.get_ident()
        self._conn: psycopg.Connection | None = None
        self._cursor: psycopg.Cursor | None = None
        # The outcomes of the last steps, not written yet, oldest first: they
        # are written before the next step starts, or with the run's end. The
        # list is guarded by _pending_lock (held for a moment only: an async
        # run's loop adds to it); _writing is held while they are written.
        self._pending: list[Pending] = []
        self._pending_lock = threading.Lock()
        self._writing = threading.Lock()
        self._late_failure_logged = False
        # Durable streams: this execution's view of the run's streams (loaded
        # at its first stream call), the entries not sent yet, oldest first,
        # and those on their way to the writer (one batch at a time, so they
        # commit in offset order). Guarded by _stream_lock.
        self.streams: db.StreamState | None = None
        self._stream_lock = threading.Condition()
        self._stream_buffer: list[db.StreamEntryRow] = []
        self._stream_sending: list[db.StreamEntryRow] | None = None
        self._stream_failed = False  # a send failed: the next call writes them itself, fenced

    def __enter__(self) -> HeldRun:
        _late_outcomes.add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _late_outcomes.discard(self)
        self.release()

    def on_own_thread(self) -> bool:
        """Whether this is the run's own thread (not a parallel branch's, nor
        the late-outcome thread). An async run has none."""
        return threading.get_ident() == self._owner

    def defers(self, status: str, update: bool) -> bool:
        """Whether a step row written now waits for the next write (see
        record_step): an outcome, not a `started` mark nor an update, of a
        step of the run's own thread, or of any step of an async run."""
        return status != StepStatus.STARTED and not update and (self.asynchronous or self.on_own_thread())

    def stop_with(self, exc: BaseException) -> BaseException:
        """Set the execution's halt (the first one wins) and return it to raise."""
        with self._halt_lock:
            if self.halt is None:
                self.halt = exc
            return self.halt

    def check(self) -> None:
        """At a step boundary: the fence's `Drain` or `LostClaim`, as the halt."""
        try:
            self.lent.fence.check(self.claim)
        except (Drain, LostClaim) as exc:
            raise self.stop_with(exc) from None

    def nothing_to_write(self) -> bool:
        """Whether a step boundary needs no I/O now: no outcome waits to be
        written, and the fence has no reason to make the check wait."""
        with self._pending_lock:
            if self._pending:
                return False
        return self.lent.fence.clear(self.claim)

    def boundary(self, carry: bool = False) -> None:
        """Before a new step starts: the fence's check, then the outcomes
        waiting to be written, unless the step is a plain one (`carry`) and
        they may wait past its start (see carries)."""
        self.check()
        if not (carry and self.carries()):
            self.flush()

    def carries(self) -> bool:
        """Whether the outcomes waiting to be written may wait past the start
        of the next step (@step(write_behind=True)): while every slot of the
        process runs a body (their commit would then cost the run a wait on
        a batch of its own), outcomes of write-behind steps of the run's own
        thread, each shorter than CARRY_UNDER, at most CARRY_MAX of them, of
        a run that writes no stream. They go with the run's end then (in its
        transaction), or with the next outcome that is not carried, or the
        late-outcome thread writes them after OUTCOME_DELAY. What that
        changes: a worker lost meanwhile runs those steps again, after the
        steps that followed them, and a cancel request their answer would
        have told of is known at that write (or honoured by the end). At
        rest (a slot free), nothing waits past the next step's start."""
        if self.asynchronous or self.streams is not None or not self.on_own_thread():
            return False
        if not self.lent.fence.clear(self.claim):  # its claim's commit still on its way, say
            return False
        with self._pending_lock:
            if not self._pending or len(self._pending) >= CARRY_MAX:
                return False
            if not all(step.behind and step.since - step.started < CARRY_UNDER for step in self._pending):
                return False
        return self.lent.successors.writes_to_gather() > 1

    # -------------------------------------------------------------- the connection

    @contextmanager
    def cursor(self) -> Iterator[psycopg.Cursor]:
        """A cursor for one write or read (see the class)."""
        self.lent.fence.committed(self.claim)
        if not self.on_own_thread():
            with self.lent.pool.connection() as conn:
                yield conn.cursor()
            return
        if self._cursor is None:
            self._conn = self.lent.pool.getconn()
            self._cursor = self._conn.cursor()
        try:
            yield self._cursor
        except db.CONNECTION_ERRORS:
            self.release()  # the pool discards a broken connection; the retry gets another
            raise

    def release(self) -> None:
        if self._conn is not None:
            self.lent.pool.putconn(self._conn)
            self._conn = self._cursor = None

    def take_token(self, name: str) -> db.TokenTake | None:
        """One token of rate limit `name` (see db.take_token); not fenced: a
        token taken by an execution that lost its claim is merely spent."""
        with self.cursor() as cur:
            return db.take_token(cur, name)

    def cancel_reason(self) -> str | None:
        with self.cursor() as cur:
            return db.cancel_reason(cur, self.claim.id)

    def deliver_cancel(self) -> db.CancelDelivery:
        """The reason of the cancel the body is about to get ('deadline' for
        a run past its deadline, written as its request then)."""
        with self.cursor() as cur:
            return db.deliver_cancel(cur, self.claim.id)

    # -------------------------------------------------------------- fenced writes

    def _fenced(self, write: Callable[..., Any], args: tuple, step_id: str | None, status: str, what: str,
                grouped: bool = False) -> Any:
        """Run a fenced write of the data layer about this execution and return what it
        returned, retrying connection errors as the fence allows. A write that
        matches nothing is explained (db.why_not_written): this execution's
        own earlier attempt wrote it (its answer was lost): None is returned;
        the run is no longer held by this execution, or another execution
        wrote the row: `LostClaim`, as the halt. `grouped`: a write of the
        runner's writer, which takes no cursor."""
        attempt = 0
        run, runner, token = self.claim.id, self.runner, self.claim.token
        while True:
            try:
                self.lent.fence.before_write(self.claim)
                if grouped:
                    done = write(run, runner, token, *args)
                else:
                    with self.cursor() as cur:
                        done = write(cur, run, runner, token, *args)
                if done is not None and done is not False:
                    return done
                with self.cursor() as cur:
                    why = db.why_not_written(cur, run, runner, token, step_id, status)
                if why == db.WRITTEN:
                    return None
                if why == db.OTHER:
                    # Held here, but not by this execution's writes: the worker
                    # looks again at what it holds and replays the run afresh.
                    self.look_again = True
                    raise self._lost(f"run {run}: another execution wrote {what}; this one stops")
                raise self._lost(f"run {run} is no longer held by this execution under {runner} ({what})")
            except db.CONNECTION_ERRORS as exc:
                self.look_again = True  # the answer may be lost: a claim made by it included
                self.lent.fence.wait_after_error(self.claim, attempt, exc)
                attempt += 1

    def _lost(self, message: str) -> LostClaim:
        """The claim is lost: the execution's halt, unless it has one already."""
        lost = LostClaim(message)
        self.stop_with(lost)
        return lost

    def _answered(self, write: Callable[..., Any], args: tuple, step_id: str, status: str, what: str) -> Any:
        """A fenced write whose answer the run needs: one written by this
        execution's earlier try, its answer lost, stops the execution (the
        worker replays the run)."""
        done = self._fenced(write, args, step_id, status, what)
        if done is None:
            self.look_again = True
            raise self._lost(f"run {self.claim.id}: the answer of a write was lost; replaying")
        return done

    def start_traced(self) -> tuple[dict, int] | None:
        """Count one more traced execution of the run (only with tracing on):
        (the stored trace context, the number of this execution). None: the
        count matched nothing though the run is still this execution's (its
        status changed meanwhile); it goes untraced. A retry after a lost
        answer counts once more: the numbers then skip one."""
        return self._fenced(db.start_traced_execution, (), None, RunStatus.RUNNING, "a traced execution")

    # -------------------------------------------------------------- step rows

    def record_step(self, step_id: str, name: str, args: str, kwargs: str, status: str, result: Any,
                    error: dict | None, update: bool, started: tuple[float, float],
                    write_behind: bool = False) -> None:
        """Write a step's row; `result` and `error` are plain JSON data.

        The outcome of a step of the run's own thread is written a little
        later: before the next step starts, or in the statement that ends the
        run, which saves a commit per run — or by the late-outcome thread
        after OUTCOME_DELAY. Steps are at-least-once, so an outcome lost with
        the worker in between only means the step runs again. The `started`
        mark of an unsafe step, and its outcome, are written at once.
        `update`: the step has a row already (`retrying`, or `started`).
        `started`: (perf_counter, time) when the step started.
        `write_behind`: the outcome may wait past the next step's start (see
        carries)."""
        row = db.StepRow(step_id, name, args, kwargs, status,
                            None if status != StepStatus.DONE else serde.dump_data(result),
                            None if error is None else serde.dump_data(error),
                            started[1], None if status == StepStatus.STARTED else time.time())
        if self.defers(status, update):
            with self._pending_lock:
                self._pending.append(Pending(row, started[0], time.perf_counter(), write_behind))
        else:
            self._write_step(Pending(row, started[0], 0.0), update)

    def flush(self) -> None:
        """Write the outcomes waiting to be written, if any (or wait for the
        late-outcome thread to finish writing them), and the stream entries."""
        if self.streams is not None:
            self.flush_streams()
        with self._writing:
            self._write_pending(None)

    def _write_pending(self, due: float | None) -> None:
        """With `_writing` held: write the waiting outcomes, oldest first
        (with `due`, those that have waited since before it)."""
        while True:
            with self._pending_lock:
                if not self._pending or (due is not None and self._pending[0].since > due):
                    return
                first = self._pending[0]
            self._write_step(first, update=False)
            with self._pending_lock:
                self._pending.remove(first)

    def write_late(self, due: float) -> None:
        """From the late-outcome thread: write the waiting outcomes that have
        waited since before `due`, unless the run is writing them now."""
        with self._pending_lock:
            if not self._pending or self._pending[0].since > due or self.halt is not None:
                return
        if not self._writing.acquire(blocking=False):
            return  # the run is writing them now
        try:
            self._write_pending(due)
        except LostClaim:
            pass  # the run is halted; its own thread reports it
        except Exception as exc:
            if not self._late_failure_logged:  # retried every tick: say it once
                self._late_failure_logged = True
                log.warning("could not write a step outcome yet (%s); retrying", exc,
                            extra={"run": str(self.claim.id)})
        finally:
            self._writing.release()

    def _write_step(self, step: Pending, update: bool) -> None:
        if self.streams is not None:
            self.flush_streams()  # what a step wrote to streams commits before its outcome
        row = step.row
        if update:
            written = self._fenced(db.complete_started_step, (row,), row.step_id, row.status,
                                   f"step {row.step_id!r}")
        else:
            written = self._fenced(self.lent.step_writer.record_step, (row,), row.step_id, row.status,
                                   f"step {row.step_id!r}", grouped=True)
        self._cancel_known(written)
        if row.status != StepStatus.STARTED:
            self._count(step)

    def _count(self, step: Pending) -> None:
        runs, duration = _step_metrics(self.claim.name, step.row.name, step.row.status)
        metrics.TALLY.count(runs)
        metrics.TALLY.observe(duration, time.perf_counter() - step.started)

    def _cancel_known(self, written: Any) -> None:
        if getattr(written, "cancel_requested", False):
            self.cancel_requested = True

    def record_attempt(self, step_id: str, name: str, args: str, kwargs: str, error: dict, attempt: int,
                       wait: float, started: tuple[float, float]) -> dict:
        """Record a failed attempt that will be retried after `wait` seconds;
        returns the attempt as recorded (its times by the database's clock)."""
        row = db.StepRow(step_id, name, args, kwargs, StepStatus.RETRYING, None, serde.dump_data(error), started[1],
                            time.time())
        self.flush()
        done = self._answered(db.record_attempt, (row, attempt, wait), step_id, StepStatus.RETRYING,
                              f"attempt {attempt} of step {step_id!r}")
        self._cancel_known(done)
        return done.attempt

    # -------------------------------------------------------------- transactional steps

    def transactional(self, fn: Callable, step: StepTransaction) -> Callable:
        """`fn` run in a transaction that also records its outcome (a
        @step(transactional=True)): its database writes, made through
        everystep.step_connection(), and its `done` row commit together or
        not at all. A sync step takes a connection of the pool; an async one
        (`async def`) opens an AsyncConnection for its length. A failure
        rolls the transaction back and is raised (recorded as any step's)."""
        if inspect.iscoroutinefunction(fn):
            async def in_transaction_async(*args: Any, **kwargs: Any) -> Any:
                return await self._atransaction(fn, step, args, kwargs)
            return in_transaction_async

        def in_transaction(*args: Any, **kwargs: Any) -> Any:
            return self._transaction(fn, step, args, kwargs)
        return in_transaction

    def _transaction(self, fn: Callable, step: StepTransaction, args: tuple, kwargs: dict) -> Any:
        self._may_write()
        outcome = _StepOutcome(step)
        pool = self.lent.pool
        try:
            with (pool.connection(timeout=STEP_CONNECTION_WAIT) as conn,
                  step_transactions.lent(conn, pool.conninfo, pool.kwargs) as lending):
                with conn.transaction():
                    db.begin_step_transaction(conn)
                    value = outcome.ran(lending.call(fn, args, kwargs))
                    outcome.written = db.record_transactional_step(conn, self.claim.id, self.runner,
                                                                   self.claim.token, outcome.row, step.update)
                    if outcome.written is False:
                        raise psycopg.Rollback()
        except db.CONNECTION_ERRORS as exc:
            raise self._transaction_broke(step, outcome, exc) from None
        return self._transaction_ended(step, outcome, value)

    async def _atransaction(self, fn: Callable, step: StepTransaction, args: tuple, kwargs: dict) -> Any:
        if not self.lent.fence.clear(self.claim):
            await asyncio.to_thread(self._may_write)
        else:
            self._may_write()  # at once: the fence has no reason to wait
        outcome = _StepOutcome(step)
        pool = self.lent.pool
        try:
            async with (await psycopg.AsyncConnection.connect(pool.conninfo, **pool.kwargs) as aconn,
                        step_transactions.alent(aconn, pool.conninfo, pool.kwargs) as lending):
                async with aconn.transaction():
                    await db.abegin_step_transaction(aconn)
                    value = outcome.ran(await lending.acall(fn, args, kwargs))
                    outcome.written = await db.arecord_transactional_step(aconn, self.claim.id, self.runner,
                                                                          self.claim.token, outcome.row, step.update)
                    if outcome.written is False:
                        raise psycopg.Rollback()
        except db.CONNECTION_ERRORS as exc:
            raise self._transaction_broke(step, outcome, exc) from None
        return await asyncio.to_thread(self._transaction_ended, step, outcome, value)

    def _may_write(self) -> None:
        """The fence's `before_write`, its LostClaim the execution's halt."""
        try:
            self.lent.fence.before_write(self.claim)
        except LostClaim as lost:
            raise self.stop_with(lost) from None

    def _transaction_broke(self, step: StepTransaction, outcome: _StepOutcome, exc: Exception) -> BaseException:
        """A connection error in a transactional step: before the step
        returned, a failure of the step (nothing was committed); after, its
        commit is unknown: the execution stops and the worker replays the
        run, which serves the outcome if it was committed."""
        if outcome.row is None:
            return exc
        self.look_again = True
        return self._lost(f"run {self.claim.id}: the commit of transactional step {step.step_id!r} is unknown "
                          f"({exc}); replaying")

    def _transaction_ended(self, step: StepTransaction, outcome: _StepOutcome, value: Any) -> Any:
        """After the step's transaction: committed, or rolled back because
        its outcome's write matched nothing (explained as _fenced does)."""
        if outcome.written is False:
            with self.cursor() as cur:
                why = db.why_not_written(cur, self.claim.id, self.runner, self.claim.token, step.step_id,
                                         StepStatus.DONE)
            self.look_again = True
            raise self._lost(f"run {self.claim.id}: transactional step {step.step_id!r} "
                             f"{'was written by another execution' if why != db.LOST else 'lost its claim'}; "
                             "its transaction was rolled back")
        self._cancel_known(outcome.written)
        self._count(Pending(outcome.row, step.started[0], 0.0))
        return value
    def record_traceback(self, step_id: str, attempt: int, traceback: str) -> None:
        """Keep the traceback of a failed step attempt for the console. Only
        a help to the reader: conditional on the claim like every write, but
        not retried, and a failure to write it is logged, never the run's."""
        try:
            with self.cursor() as cur:
                db.record_traceback(cur, self.claim.id, self.runner, self.claim.token, step_id, attempt, traceback)
        except psycopg.Error as exc:
            log.warning("run %s: the traceback of step %r was not kept: %s", self.claim.id, step_id, exc)

    # -------------------------------------------------------------- sleeps, waits, children, events

    def record_sleep(self, step_id: str, name: str, seconds: float | None, until: Any) -> db.Sleep:
        """A durable sleep's row: its result the wake time."""
        return self._answered(db.record_sleep, (step_id, name, seconds, until), step_id, StepStatus.DONE,
                              "a sleep")

    def park(self, wake_at: float) -> None:
        """Leave the run `waiting` until `wake_at` (database time), which ends
        this execution (`Parked`) — unless the time came meanwhile or a cancel
        request is on the run (then `cancel_requested`): then it returns."""
        self._parked(self._fenced(db.park_run, (wake_at,), None, RunStatus.WAITING, "parking the run"))

    def park_waiting(self, deadline: float | None, waiting_on: str, wakes: int) -> bool:
        """Leave the run `waiting` on `waiting_on` until `deadline`, as `park`
        does, unless something came meanwhile. True: a cancel request is on
        the run."""
        parking = self._fenced(db.park_waiting, (deadline, waiting_on, wakes), None, RunStatus.WAITING,
                               "parking the run")
        self._parked(parking)
        return parking.cancel_requested

    def _parked(self, parking: db.Parking | None) -> None:
        if parking is None or parking.parked:
            raise self.stop_with(Parked())
        if parking.cancel_requested:
            self.cancel_requested = True

    def begin_wait(self, step_id: str, name: str, topic: str, timeout: float | None) -> dict:
        """A wait's `started` row: its result holds the topic and the deadline."""
        return self._answered(db.begin_wait, (step_id, name, topic, timeout), step_id, StepStatus.STARTED,
                              "a wait").result

    def take_message(self, step_id: str, topic: str, deadline: float | None) -> db.Wait:
        """End the started wait `step_id` with the next message on `topic`, or
        its timeout, if either is there (see db.take_message)."""
        return self._answered(db.take_message, (step_id, topic, deadline), step_id, StepStatus.DONE, "a wait")

    def take_child(self, step_id: str, child: uuid.UUID, deadline: float | None) -> db.Wait:
        """End the started wait `step_id` with the child's end, or its
        timeout, if either is there (see db.take_child)."""
        return self._answered(db.take_child, (step_id, child, deadline), step_id, StepStatus.DONE, "a wait")

    def start_child(self, step_id: str, name: str, child_name: str, args_json: str,
                    timeout: float | None = None) -> dict:
        """Schedule a child run with the step row that records its start; its
        deadline is the earlier of this run's and `timeout` seconds from now."""
        return self._answered(db.start_child, (step_id, name, uuid7(), child_name, args_json, timeout), step_id,
                              StepStatus.DONE, "starting a child")

    def set_event(self, step_id: str, name: str, key: str, value_json: str) -> None:
        self._fenced(db.set_event, (step_id, name, key, value_json), step_id, StepStatus.DONE, "an event")

    # -------------------------------------------------------------- streams

    def load_streams(self) -> db.StreamState:
        """The run's streams as this execution knows them (read at the first call)."""
        if self.streams is None:
            with self.cursor() as cur:
                state = db.stream_state(cur, self.claim.id)
            with self._stream_lock:
                if self.streams is None:
                    self.streams = state
        return self.streams

    def streams_need_io(self) -> bool:
        """Whether the next stream write needs I/O first (load_streams, flush_streams)."""
        return self.streams is None or self._stream_failed

    def append_stream(self, key: str, value_json: str | None, step_id: str | None, attempt: int | None) -> int | None:
        """Give the entry (`value_json` None: the close of the stream) its
        offset and send it to the writer, not waiting for its commit (see
        flush_streams); no I/O. Returns its offset, or None for the close of a
        stream closed already. A write to a closed stream is an EverystepError."""
        with self._stream_lock:
            state = self.streams
            if key in state.closed:
                if value_json is None:
                    return None
                raise EverystepError(f"stream {key!r} of run {self.claim.id} is closed: nothing was written")
            offset = state.next_offsets.get(key, 0)
            state.next_offsets[key] = offset + 1
            if value_json is None:
                state.closed.add(key)
            if attempt is None and step_id is not None:
                state.body_writes[step_id] = offset
            self._stream_buffer.append(db.StreamEntryRow(key, offset, value_json, step_id, attempt))
            self._send_streams()
        return offset

    def _send_streams(self) -> None:
        """With _stream_lock held: send the waiting entries, unless a batch is on its way."""
        if self._stream_sending is not None or not self._stream_buffer or self._stream_failed or self.halt:
            return
        entries, self._stream_buffer = self._stream_buffer[:STREAM_BATCH], self._stream_buffer[STREAM_BATCH:]
        self._stream_sending = entries
        try:
            self.lent.step_writer.send_streams(db.StreamWrite(self.claim.id, self.claim.token, entries),
                                               self._streams_sent)
        except psycopg.OperationalError:  # the writer is closed
            self._stream_buffer, self._stream_sending, self._stream_failed = entries + self._stream_buffer, None, True

    def _streams_sent(self, held: bool, error: BaseException | None) -> None:
        """(The thread that wrote the batch.) A batch of entries is written, or not."""
        with self._stream_lock:
            entries, self._stream_sending = self._stream_sending, None
            if error is not None or not held:
                self._stream_buffer = entries + self._stream_buffer
                self._stream_failed = True
            else:
                metrics.STREAM_ENTRIES.labels(self.claim.name).inc(len(entries))
                self._send_streams()
            self._stream_lock.notify_all()

    def flush_streams(self) -> None:
        """Until every entry written so far is committed: waits for the batch
        on its way, then writes what is left (after a failed send), fenced."""
        with self._stream_lock:
            self._stream_lock.wait_for(lambda: self._stream_sending is None)
            entries, self._stream_buffer = self._stream_buffer, []
            if not entries:
                self._stream_failed = False
                return
            self._stream_sending = entries
        try:
            self._fenced(self.lent.step_writer.write_streams, (entries,), None, RunStatus.RUNNING, "stream entries",
                         grouped=True)
        except BaseException:
            with self._stream_lock:
                self._stream_buffer, self._stream_sending = entries + self._stream_buffer, None
                self._stream_lock.notify_all()
            raise
        with self._stream_lock:
            self._stream_sending, self._stream_failed = None, False
            metrics.STREAM_ENTRIES.labels(self.claim.name).inc(len(entries))
            self._send_streams()
            self._stream_lock.notify_all()

    def _streams_ended(self) -> None:
        """The run ended: wake its streams' readers (its end closed them). A
        reader that misses it finds the end at its next look."""
        if self.streams is None:
            return
        try:
            with self.cursor() as cur:
                db.notify_streams(cur, self.claim.id)
        except psycopg.Error as exc:
            log.warning("could not wake the readers of the run's streams: %s", exc, extra={"run": str(self.claim.id)})
    def set_attributes(self, step_id: str, name: str, attributes_json: str) -> None:
        """Merge attributes into the run's with the step row recording it; an
        EverystepError (nothing written) if the merge would pass the bound."""
        try:
            self._fenced(db.set_attributes, (step_id, name, attributes_json, MAX_ATTRIBUTES), step_id,
                         StepStatus.DONE, "attributes")
        except db.TooManyAttributes as exc:
            raise EverystepError(f"set_attributes(): {exc} (at most {MAX_ATTRIBUTES})") from None

    # -------------------------------------------------------------- the end

    def _ending(self) -> list[Pending]:
        """The execution is about to end: the outcomes waiting to be written,
        taken for the end's statement (the late-outcome thread leaves them)."""
        with self._writing, self._pending_lock:
            pending, self._pending = self._pending, []
        return pending

    def requeue(self, why: str = "drained") -> None:
        """Put the run back in the queue (the worker drains, or cannot import
        its workflow: `why`): the outcomes waiting to be written first."""
        if self.streams is not None:
            self.flush_streams()
        for step in self._ending():
            self._write_step(step, update=False)  # recorded before the requeue
        self._fenced(lambda cur, run, runner, token: db.requeue_held(cur, runner, [db.Claim(run, token)], why),
                     (), None, RunStatus.SCHEDULED, "requeueing the run")
        metrics.REQUEUED.labels(self.runner).inc()

    def end(self, status: str, result: str | None, error: str | None) -> str:
        """The last step's row, the run's end and the claim of the next run for
        this slot: one statement, one commit (outcomes waiting before the last
        one are written first). The successor, if any, is left in
        `self.successor`. Returns the run's end as written (`cancelled` when a
        cancel request reached the row first)."""
        if self.streams is not None:
            self.flush_streams()  # a run's entries commit before its end: a reader that sees the end has them all
        *before, last = self._ending() or [None]
        earlier = tuple(step.row for step in before)  # written in the end's transaction, before it
        row = None if last is None else last.row
        if self.claim_successor is None:
            self.claim_successor = self.lent.successors.reserve(self.claim)

        def write_end(run: uuid.UUID, runner: str, token: int, last_step: db.StepRow | None) -> str | None:
            done = self.lent.end_writer.finish_run(run, token, status, result, error, last_step,
                                                   0 if self.successor is not None else self.claim_successor,
                                                   earlier)
            if done.successor is not None:
                self.successor = done.successor  # this slot's next run, whatever became of this end
                self.ahead = done.ahead
            if done.step_exists:
                raise psycopg.errors.UniqueViolation(f"step {last_step.step_id!r} of run {run} exists")
            return done.status

        try:
            ended = self._fenced(write_end, (row,), None, status, "ending the run", grouped=True)
        except psycopg.errors.UniqueViolation:
            # The last step's row is there already: written by this execution's
            # earlier attempt (then end without it), or by another execution.
            with self.cursor() as cur:
                why = db.why_not_written(cur, self.claim.id, self.runner, self.claim.token, row.step_id,
                                            row.status)
            if why != db.WRITTEN:
                self.look_again = self.look_again or why == db.OTHER
                raise self._lost(f"run {self.claim.id}: step {row.step_id!r} was written by another "
                                 "execution") from None
            ended = self._fenced(write_end, (None,), None, status, "ending the run", grouped=True)
        # None: an earlier attempt ended it, and its claim, if any, is found
        # by the worker looking again (look_again is set by the retry).
        for step in before:
            self._count(step)
        if last is not None:
            self._count(last)
        self._streams_ended()
        return ended or status


class _LateOutcomes:
    """The runs executing in this process, and one daemon thread that writes
    the outcomes that have waited OUTCOME_DELAY."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.held: set[HeldRun] = set()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, held: HeldRun) -> None:
        with self.lock:
            self.held.add(held)
            if self.thread is None:
                self.thread = threading.Thread(target=self._write_forever, name="everystep-outcomes", daemon=True)
                self.thread.start()

    def discard(self, held: HeldRun) -> None:
        with self.lock:
            self.held.discard(held)

    def _write_forever(self) -> None:
        while True:
            time.sleep(OUTCOME_DELAY / 2)
            due = time.perf_counter() - OUTCOME_DELAY
            with self.lock:
                held = list(self.held)
            for run in held:
                run.write_late(due)


_late_outcomes = _LateOutcomes()
# A forked child starts without the parent's threads, and with no run of its own.
os.register_at_fork(after_in_child=_late_outcomes.reset)
