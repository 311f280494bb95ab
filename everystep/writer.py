"""Group commit: the step rows, stream entries and run ends of every run
executing in one process share statements and commits.

A run's thread hands its write to one of the runner's writers and waits.
The writer's thread takes every write that is waiting (at most MAX_BATCH),
writes them in one statement and one commit — step rows (db.record_steps)
or run ends with their successors' claims (db.end_runs), each row fenced
by its own execution's token —, and wakes each thread with its own answer. A runner has
two writers, one for step rows and one for run ends, so that step rows do not
wait behind the heavier statement that ends runs (w3 0.28 of the limit with
two, 0.17-0.21 with one writer for both, on 2 cores). Nothing is added to a
lone write's latency: a batch is what arrived while the previous one was
being written, so under load the batches grow by themselves and at rest each
write goes alone. While every run slot of the process is busy, the writer
of run ends also waits a moment for the ends of the others (see LINGER).
Nothing is acknowledged before its commit returned (the session's commits
wait for the WAL flush, see db.prepare_session).

A connection error fails the whole batch: every thread retries its own write
as before (its fence decides whether it may). Any other error of a batch is
found out write by write, so that it reaches only the run it belongs to.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from everystep import db, metrics

# Writes per transaction at most: the run slots of a process stay far below
# it; parallel branches and late outcomes may add some.
MAX_BATCH = 64
# While every sync run slot of the process runs a body, the writer of run
# ends waits up to LINGER seconds for an end from each before it writes
# (Worker.ends_to_gather; not in a process with async workflows). The
# statement that ends runs costs the server about the same whatever its size
# (~0.3 ms on 2 cores: its plan's start, the claim of the successors), and
# the slot of a run whose end is being written is lent to the next run
# meanwhile (Worker.reserve): an end waits only while no slot is idle.
LINGER = 0.002
# Seconds without a write after which the thread ends and its connection goes
# back to the pool (the next write starts it again).
IDLE = 5.0


class _Write:
    """One write waiting for its batch's commit (or, with `then`, not
    waited for: `then(answer, error)` is called from the writer's thread).
    `done` is a bare lock held until the answer is in, which the run's
    thread waits for by acquiring it: one is made and waited on at every
    write, and an Event (a Condition, a waiter lock per wait) costs several
    times as much."""

    __slots__ = ("write", "done", "answer", "error", "then")

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

    def finish(self, answer: Any = None, error: BaseException | None = None) -> None:
        self.answer, self.error = answer, error
        if self.done is not None:
            self.done.release()
        if self.then is not None:
            self.then(answer, error)


class GroupWriter:
    """A writer of one runner name's step rows or run ends (a runner has one
    of each). Its thread starts with the first write; `close` ends it.
    `gather`: how many writes a batch waits for under load (a writer of run
    ends, see LINGER); None: it never waits."""

    def __init__(self, pool: ConnectionPool, runner: str, routes: Callable[[], list[str] | None],
                 skipped: Callable[[], list[str]] = list, gather: Callable[[], int] | None = None):
        self.pool = pool
        self.runner = runner
        self.routes = routes  # the workflows a successor may be of (db.routes_of), asked at each batch
        self.skipped = skipped  # and the workflows it may not be of (the runner cannot import them)
        self.gather = gather
        self._lingering = False
        self._waiting: list[_Write] = []
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None
        self._closed = False
        self._batch_sizes = metrics.WRITE_BATCH.labels(runner)  # observed at every batch: looked up once

    # ------------------------------------------------------------ the runs' side

    def record_step(self, run: uuid.UUID, runner: str, token: int, row: db.StepRow) -> db.Written | bool:
        """As db.record_step, in the next batch."""
        return self._submit(db.StepWrite(run, token, row))

    def finish_run(self, run: uuid.UUID, token: int, status: str, result: str | None, error: str | None,
                   last_step: db.StepRow | None, claim: int) -> db.BatchEnd:
        """End a held run (with its last step's row) in the next batch, and
        claim `claim` runs: a successor for its slot, and one ahead."""
        return self._submit(db.EndWrite(run, token, status, result, error, last_step, claim))

    def write_streams(self, run: uuid.UUID, runner: str, token: int, entries: list[db.StreamEntryRow]) -> bool:
        """Stream entries of a held run in the next batch: whether its
        execution still holds it (else nothing was written)."""
        return self._submit(db.StreamWrite(run, token, entries))

    def send_streams(self, write: db.StreamWrite, then: Callable[[Any, BaseException | None], None]) -> None:
        """Stream entries in the next batch, not waited for: `then(held,
        error)` is called from the writer's thread once the batch is done."""
        self._enqueue(_Write(write, then))

    def _enqueue(self, waiting: _Write) -> None:
        with self._changed:
            if self._closed:
                raise psycopg.OperationalError("the runner's writer is closed")
            self._waiting.append(waiting)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_forever, name=f"everystep-writer-{self.runner}",
                                                daemon=True)
                self._thread.start()
            if not self._lingering or not self._lingers():
                self._changed.notify()  # (a lingering writer is woken only when its wait is over)

    def _submit(self, write: db.StepWrite | db.EndWrite | db.StreamWrite) -> Any:
        waiting = _Write(write)
        self._enqueue(waiting)
        waiting.done.acquire()
        if waiting.error is not None:
            raise waiting.error
        return waiting.answer

    def close(self) -> None:
        """Write what is waiting, then stop the thread and give back its connection."""
        with self._changed:
            self._closed = True
            self._changed.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)

    # ------------------------------------------------------------ the writer's side

    def _write_forever(self) -> None:
        while True:
            with self._changed:
                if not self._waiting and not self._closed:
                    self._changed.wait(IDLE)
                if not self._waiting:  # idle or closed: the next write starts a thread again
                    self._give_back()
                    self._thread = None
                    return
                if self.gather is not None:
                    self._linger()
                batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            self._write(batch)

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
                ended = db.end_runs(self._conn, self.runner, [w.write for w in ends], self.routes(),
                                    self.skipped())
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
        metrics.TALLY.observe(self._batch_sizes, len(batch))
        for waiting, answer in zip(steps, written):
            waiting.finish(answer)
        for waiting, answer in zip(ends, finished):
            waiting.finish(answer)
        for waiting in streams:
            waiting.finish(waiting.write.run in held_runs)

    def _give_back(self) -> None:
        if self._conn is not None:
            if not isinstance(self._conn, db.TransactionPooledConnection):
                try:
                    db.reset_claiming_session(self._conn)
                except psycopg.Error:
                    pass  # broken: the pool discards it
            self.pool.putconn(self._conn)
            self._conn = None
