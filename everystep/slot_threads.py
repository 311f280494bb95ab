"""The threads that serve a worker's run slots.

A run is handed to an idle thread with one queue put: no Future, work item
or semaphore per run as with concurrent.futures.ThreadPoolExecutor, whose
`submit` took ~15 us of a worker's CPU at every run started on a lent slot
(runs claimed ahead, see Worker.reserve) and ~20 us a hand-off in all."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("everystep.worker")


class SlotThreads:
    """Up to `size` threads, started as work comes and none is idle; a call
    handed over while every thread is busy waits for the first to be free."""

    def __init__(self, size: int, name: str):
        self._size = size
        self._name = name
        self._work: queue.SimpleQueue[tuple[Callable[[Any], None], Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for work, less the calls handed over that none has taken yet
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Call `fn(arg)` on a thread of the pool."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the slot threads are shut down")
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self._size:
                thread = threading.Thread(target=self._serve, name=f"{self._name}_{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            self._work.put((fn, arg))

    def shutdown(self) -> None:
        """Drop the calls not started yet; each thread ends once its call
        returns (the interpreter waits for them at exit, as for any thread
        that is not a daemon)."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    self._work.get_nowait()
                except queue.Empty:
                    break
            for _ in self._threads:
                self._work.put(None)

    def _serve(self) -> None:
        while True:
            call = self._work.get()
            if call is None:
                return
            fn, arg = call
            try:
                fn(arg)
            except BaseException:  # (a slot's own loop reports its runs' failures; this is a last resort)
                log.exception("a slot thread's call failed")
            with self._lock:
                self._idle += 1
