"""Waiting on file descriptors (sockets, wake-up pipes) with poll(2):
select(2) refuses a descriptor numbered 1024 or more, which a process
holding many connections or open files is given."""

from __future__ import annotations

import math
import select


def readable(fds: list[int], timeout: float | None = None) -> list[int]:
    """Those of `fds` that can be read without blocking (a closed or failed
    one counts: its read returns at once), after waiting up to `timeout`
    seconds (None: until one can)."""
    return _wait(fds, select.POLLIN | select.POLLPRI, timeout)


def writable(fd: int, timeout: float | None = None) -> bool:
    """Whether `fd` can be written without blocking, after waiting up to
    `timeout` seconds (None: until it can)."""
    return bool(_wait([fd], select.POLLOUT, timeout))


def _wait(fds: list[int], events: int, timeout: float | None) -> list[int]:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, events)
    # poll counts whole milliseconds: rounded up, so a short wait is not a busy loop
    milliseconds = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(milliseconds)]
