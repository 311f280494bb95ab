"""Group commit: the step rows, stream entries and run ends of every run
executing in one process share statements and commits.

A run's thread hands its write to one of the runner's writers. If no batch
is being written, the thread leads: it takes every write that is waiting
(at most MAX_BATCH, its own among them), writes them in one statement and one
commit — step rows (db.record_steps) or run ends with their successors'
claims (db.end_runs), each row fenced by its own execution's token —, and
wakes each other thread with its own answer. Otherwise it waits, and is
woken with its answer, or to lead the next batch: the leader, once its own
write is in, hands the lead to the first thread still waiting (it wakes
that thread then, as it would for its answer). So a lone write costs no
hand-off between threads, and under load the next batch starts once the
woken thread runs, with what arrived meanwhile: fewer, larger batches than
a writer thread of its own wrote (docs/performance.md). A runner
has two writers, one for step rows and one for run ends, so that step rows
do not wait behind the heavier statement that ends runs (w3 0.28 of the
limit with two, 0.17-0.21 with one writer for both, on 2 cores). Nothing is
added to a lone write's latency: a batch is what arrived while the previous
one was being written, so under load the batches grow by themselves and at
rest each write goes alone. While every run slot of the process is busy,
a leader also waits a moment for the writes of the other slots (see
LINGER). Nothing is acknowledged before its commit returned (the session's
commits wait for the WAL flush, see db.prepare_session).

A connection error fails the whole batch: every thread retries its own write
as before (its fence decides whether it may). Any other error of a batch is
found out write by write, so that it reaches only the run it belongs to.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from everystep import db, metrics

log = logging.getLogger("everystep")

# Writes per transaction at most: the run slots of a process stay far below
# it; parallel branches and late outcomes may add some.
MAX_BATCH = 64
# While every sync run slot of the process runs a body, the writers of run
# ends and of step rows wait up to LINGER seconds for a write from each slot
# before they write (Worker.writes_to_gather; not in a process with async
# workflows). The statement that ends runs costs the server about the same
# whatever its size (~0.3 ms on 2 cores: its plan's start, the claim of the
# successors), and the slot of a run whose end is being written is lent to
# the next run meanwhile (Worker.reserve): an end waits only while no slot
# is idle. A step row's batch has a fixed cost too (its statement's start,
# its commit): fewer, larger batches cost the server and the worker less a
# step than the wait costs the run (docs/performance.md).
LINGER = 0.002
# Seconds without a batch after which a writer gives its connection back to
# the pool (Runner.give_back_idle, at each turn of the worker's loop; the
# next write takes one again).
IDLE = 5.0


class _Write:
    """One write waiting for its batch's commit (or, with `then`, not
    waited for: `then(answer, error)` is called by whichever thread wrote
    its batch). `done` is a bare lock held until the answer is in, or until
    the write's thread is to lead (`lead`), which the run's thread waits for
    by acquiring it: one is made and waited on at every write, and an Event
    (a Condition, a waiter lock per wait) costs several times as much."""

    __slots__ = ("write", "done", "answer", "error", "then", "finished", "lead")

    def __init__(self, write: db.StepWrite | db.EndWrite | db.StreamWrite,
                 then: Callable[[Any, BaseException | None], None] | None = None):
        self.write = write
        self.done: threading.Lock | None = None
        if then is None:
            self.done = threading.Lock()
            self.done.acquire()
        self.answer: Any = None
        self.error: BaseException | None = None
        self.then = then
        self.finished = False
        self.lead = False

    def finish(self, answer: Any = None, error: BaseException | None = None) -> None:
        self.answer, self.error, self.finished = answer, error, True
        if self.done is not None:
            self.done.release()
        if self.then is not None:
            try:
                self.then(answer, error)
            except Exception:  # the other writes of the batch still get their answers
                log.exception("a callback of the group commit failed")


class GroupWriter:
    """A writer of one runner name's step rows or run ends (a runner has one
    of each). `gather`: how many writes a batch waits for under load (a
    writer of run ends, see LINGER); None: it never waits. `close` writes
    what is waiting and gives its connection back."""

    def __init__(self, pool: ConnectionPool, runner: str, routes: Callable[[], list[str] | None],
                 skipped: Callable[[], list[str]] = list, gather: Callable[[], int] | None = None):
        self.pool = pool
        self.runner = runner
        self.routes = routes  # the workflows a successor may be of (db.routes_of), asked at each batch
        self.skipped = skipped  # and the workflows it may not be of (the runner cannot import them)
        self.gather = gather
        self._lingering = False
        self._waiting: list[_Write] = []
        self._leading = False  # a thread writes the batches (and holds the connection)
        self._changed = threading.Condition()
        self._conn: psycopg.Connection | None = None
        self._written_at = time.monotonic()  # when the last batch was written
        self._closed = False
        self._batch_sizes = metrics.WRITE_BATCH.labels(runner)  # observed at every batch: looked up once

    # ------------------------------------------------------------ the runs' side

    def record_step(self, run: uuid.UUID, runner: str, token: int, row: db.StepRow) -> db.Written | bool:
        """As db.record_step, in the next batch."""
        return self._submit(db.StepWrite(run, token, row))

    def finish_run(self, run: uuid.UUID, token: int, status: str, result: str | None, error: str | None,
                   last_step: db.StepRow | None, claim: int, earlier: tuple[db.StepRow, ...] = ()) -> db.BatchEnd:
        """End a held run (with its last step's row, and the rows of its
        `earlier` steps not written yet) in the next batch, and claim `claim`
        runs: a successor for its slot, and one ahead."""
        return self._submit(db.EndWrite(run, token, status, result, error, last_step, claim, earlier))

    def write_streams(self, run: uuid.UUID, runner: str, token: int, entries: list[db.StreamEntryRow]) -> bool:
        """Stream entries of a held run in the next batch: whether its
        execution still holds it (else nothing was written)."""
        return self._submit(db.StreamWrite(run, token, entries))

    def send_streams(self, write: db.StreamWrite, then: Callable[[Any, BaseException | None], None]) -> None:
        """Stream entries in the next batch, not waited for: `then(held,
        error)` is called once the batch is done (by a thread of the pool
        when no batch is being written)."""
        if self._enqueue(_Write(write, then)):
            threading.Thread(target=self._lead, name=f"everystep-writer-{self.runner}", daemon=True).start()

    def _enqueue(self, waiting: _Write) -> bool:
        """Queue a write: whether its thread is to lead (no batch is being written)."""
        with self._changed:
            if self._closed:
                raise psycopg.OperationalError("the runner's writer is closed")
            self._waiting.append(waiting)
            if not self._leading:
                self._leading = True
                return True
            if self._lingering and not self._lingers():
                self._changed.notify()  # the leader's wait is over
            return False

    def _submit(self, write: db.StepWrite | db.EndWrite | db.StreamWrite) -> Any:
        waiting = _Write(write)
        lead = self._enqueue(waiting)
        while True:
            if lead:
                self._lead(waiting)
            waiting.done.acquire()
            if not waiting.lead:
                break
            waiting.lead, lead = False, True  # handed the lead by the thread that wrote the last batch
        if waiting.error is not None:
            raise waiting.error
        return waiting.answer

    def close(self) -> None:
        """Wait for the batches being written, then give back the connection."""
        with self._changed:
            self._closed = True
            self._changed.notify()  # a leader waiting for more writes writes at once
            self._changed.wait_for(lambda: not self._leading, timeout=5.0)
            if not self._leading:
                self._give_back()

    def give_back_if_idle(self) -> None:
        """Give the connection back to the pool if no batch was written for
        IDLE seconds (the next leader takes one again)."""
        if self._conn is None or time.monotonic() - self._written_at < IDLE:
            return  # (read without the lock: the common case costs nothing)
        with self._changed:
            if not self._leading and time.monotonic() - self._written_at >= IDLE:
                self._give_back()

    # ------------------------------------------------------------ the leader's side

    def _lead(self, own: _Write | None = None) -> None:
        """Write batches until `own` is written (None: until none waits),
        then hand the lead on (see _hand_over)."""
        try:
            while True:
                with self._changed:
                    if not self._waiting or (own is not None and own.finished):
                        if self._hand_over():
                            return
                        own = None  # only writes nobody waits for are left: written here too
                    if self.gather is not None:
                        self._linger()
                    batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
                self._write(batch)
        except BaseException:  # (a bug) this thread's write fails; the others must not wait for a leader that is gone
            with self._changed:
                if own is not None and own in self._waiting:
                    self._waiting.remove(own)
                if not self._hand_over():
                    self._stop_leading()  # (what nobody waits for goes with the next write's batch)
            raise

    def _hand_over(self) -> bool:
        """(Under _changed.) Give the lead to the thread of the first write
        still waiting, woken as it would be for its answer, or end it when
        none waits: whether this thread is done leading (False: only writes
        nobody waits for are left)."""
        successor = next((w for w in self._waiting if w.done is not None), None)
        if successor is not None:
            successor.lead = True
            successor.done.release()
            return True
        if self._waiting:
            return False
        self._stop_leading()
        return True

    def _stop_leading(self) -> None:
        """(Under _changed.) No batch is being written now."""
        self._leading = False
        self._changed.notify_all()  # (close waits for it)

    def _linger(self) -> None:
        """(Under _changed.) Wait up to LINGER while fewer writes wait than
        `gather` asks for (asked again at each new write)."""
        until = time.monotonic() + LINGER
        self._lingering = True
        try:
            while self._lingers():
                left = until - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(left)
        finally:
            self._lingering = False

    def _lingers(self) -> bool:
        """(Under _changed.) Whether the batch is to wait for more writes."""
        return not self._closed and len(self._waiting) < min(self.gather(), MAX_BATCH)

    def _write(self, batch: list[_Write]) -> None:
        steps = [w for w in batch if isinstance(w.write, db.StepWrite)]
        ends = [w for w in batch if isinstance(w.write, db.EndWrite)]
        streams = [w for w in batch if isinstance(w.write, db.StreamWrite)]
        try:
            if self._conn is None:
                self._conn = self.pool.getconn()
                if not isinstance(self._conn, db.TransactionPooledConnection):  # no session state through PgBouncer
                    db.prepare_claiming_session(self._conn)
            held_runs: set = set()
            if streams and steps and not isinstance(self._conn, db.TransactionPooledConnection):
                with self._conn.transaction():  # stream entries share the step rows' commit
                    held_runs = db.write_streams(self._conn, self.runner, [w.write for w in streams])
                    written = db.record_steps(self._conn, self.runner, [w.write for w in steps])
            else:
                if streams:
                    held_runs = db.write_streams(self._conn, self.runner, [w.write for w in streams])
                written = db.record_steps(self._conn, self.runner, [w.write for w in steps]) if steps else []
            finished = []
            if ends:
                ended = self._end_runs([w.write for w in ends])
                finished = ended.finished
                if ended.released:
                    metrics.DAG_RELEASES.inc(ended.released)
        except db.CONNECTION_ERRORS as exc:
            self._give_back()  # the pool discards a broken connection; the retries get another
            for waiting in batch:
                waiting.finish(error=exc)
            return
        except Exception as exc:
            if len(batch) == 1:
                batch[0].finish(error=exc)
            else:  # whose is it? each write alone, so that only its own run gets it
                for waiting in batch:
                    self._write([waiting])
            return
        self._written_at = time.monotonic()
        metrics.TALLY.observe(self._batch_sizes, len(batch))
        for waiting, answer in zip(steps, written):
            waiting.finish(answer)
        for waiting, answer in zip(ends, finished):
            waiting.finish(answer)
        for waiting in streams:
            waiting.finish(waiting.write.run in held_runs)

    def _end_runs(self, ends: list[db.EndWrite]) -> db.EndedRuns:
        """The ends, after the rows of their earlier steps not written yet,
        in the same transaction (through PgBouncer, a commit before). A row
        its fence refuses leaves its run's end unwritten too (the same
        fence), which the run's thread explains."""
        earlier = [db.StepWrite(end.run, end.token, row) for end in ends for row in end.earlier]
        if not earlier:
            return db.end_runs(self._conn, self.runner, ends, self.routes(), self.skipped())
        if isinstance(self._conn, db.TransactionPooledConnection):
            db.record_steps(self._conn, self.runner, earlier)
            return db.end_runs(self._conn, self.runner, ends, self.routes(), self.skipped())
        with self._conn.transaction():
            db.record_steps(self._conn, self.runner, earlier)
            return db.end_runs(self._conn, self.runner, ends, self.routes(), self.skipped())

    def _give_back(self) -> None:
        if self._conn is not None:
            if not isinstance(self._conn, db.TransactionPooledConnection):
                try:
                    db.reset_claiming_session(self._conn)
                except psycopg.Error:
                    pass  # broken: the pool discards it
            self.pool.putconn(self._conn)
            self._conn = None
