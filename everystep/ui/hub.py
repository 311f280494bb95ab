"""One poller per server, fanned out to every open page.

The hub asks the database for the live page's data at most once per
`interval`, however many pages are open: a thread polls while somebody
listens (Server-Sent Events), and a page that polls instead gets the last
answer when it is fresh enough, or triggers the one refresh everybody shares.
Listeners are told only when the answer changed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from everystep.logs import first_line

log = logging.getLogger("everystep")


class Hub:
    def __init__(self, fetch: Callable[[], dict], interval: float = 1.0):
        self._fetch = fetch
        self.interval = interval
        self._lock = threading.Lock()  # one refresh at a time
        self._changed = threading.Condition()
        self._listeners: set[Callable[[], None]] = set()
        self._snapshot: dict = {}
        self._text = ""
        self._fetched_at = -float("inf")
        self.version = 0
        self.queries = 0  # database round trips so far (the benchmark reads it)
        self._thread: threading.Thread | None = None
        self._closed = False

    def latest(self) -> tuple[int, dict]:
        """The newest answer, refreshed first if older than the interval."""
        if time.monotonic() - self._fetched_at >= self.interval:
            self._refresh()
        return self.version, self._snapshot

    def current(self) -> tuple[int, dict]:
        """The newest answer as it is, without asking the database."""
        return self.version, self._snapshot

    def _refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._fetched_at < self.interval:
                return  # someone else refreshed while we waited
            try:
                snapshot = {"database": "up", **self._fetch()}
            except Exception as exc:  # the page shows the database as down, and keeps trying
                snapshot = {"database": "down", "error": first_line(exc)}
            self.queries += 1
            self._fetched_at = time.monotonic()
            text = json.dumps(snapshot, sort_keys=True, default=str)
            if text == self._text:
                return
            with self._changed:
                self._snapshot, self._text = snapshot, text
                self.version += 1
                self._changed.notify_all()
                listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def listen(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener` (from the poller thread) after every change; returns
        the function that stops it. The poller runs while anybody listens."""
        with self._changed:
            self._listeners.add(listener)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._poll, name="everystep-ui-hub", daemon=True)
                self._thread.start()

        def stop() -> None:
            with self._changed:
                self._listeners.discard(listener)
        return stop

    def wait(self, version: int, timeout: float) -> tuple[int, dict]:
        """Block until the version passes `version` or `timeout` passes (for
        synchronous servers; the caller must be listening)."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != version or self._closed, timeout)
            return self.version, self._snapshot

    def _poll(self) -> None:
        while not self._closed:
            with self._changed:
                if not self._listeners:
                    self._thread = None
                    return
            started = time.monotonic()
            self._refresh()
            time.sleep(max(self.interval - (time.monotonic() - started), 0.05))

    def close(self) -> None:
        self._closed = True
        with self._changed:
            self._changed.notify_all()
