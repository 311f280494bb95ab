"""A worker on threads of the test's process (the everystep_worker fixture):
the engine's own Worker — liveness lock, LISTEN wake-ups, claims, slots,
successor claims — on a test's schema, for tests that schedule runs and
wait for them as an application would, rather than drain them."""

from __future__ import annotations

import threading
import time

from everystep import db
from everystep.testing import server
from everystep.worker import Worker

NAME = "everystep-testing-worker"


class BackgroundWorker:
    """A Worker running on a thread of its own; `stop()` drains it (the runs
    in flight finish their step and are requeued) and waits for it."""

    def __init__(self, database: server.Database, *, name: str = NAME, threads: int = 4, poll: float = 0.05):
        self.database = database
        self.name = name
        self._locked = threading.Event()
        self._inflight = 0
        self.worker = Worker(database.url, name, threads=threads, poll=poll, drain=5.0, grace=5.0,
                             on_lock=self._lock_changed, on_load=self._load_changed)
        self._thread = threading.Thread(target=self.worker.run, name=f"everystep-{name}", daemon=True)

    def _lock_changed(self, held: bool) -> None:
        if held:
            self._locked.set()
        else:
            self._locked.clear()

    def _load_changed(self, inflight: int, threads: int) -> None:
        self._inflight = inflight

    def start(self, timeout: float = 10.0) -> BackgroundWorker:
        """Start it, and return once it holds its lock (and claims)."""
        self._thread.start()
        if not self._locked.wait(timeout):
            raise TimeoutError(f"the worker {self.name} did not take its lock within {timeout:g} s")
        return self

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Return once nothing is runnable in the schema and the worker
        executes nothing (twice in a row, 20 ms apart); TimeoutError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        quiet = 0
        with self.database.connect() as conn:
            while quiet < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the worker {self.name} was still busy after {timeout:g} s")
                idle = self._inflight == 0 and db.queue_stats(conn).pending == 0
                quiet = quiet + 1 if idle else 0
                time.sleep(0.02)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.worker.stop()
            self._thread.join(self.worker.drain + 10)

    def __repr__(self) -> str:
        return f"<everystep test worker {self.name} on {self.database.schema}>"
