"""everystep.waits: waiting on descriptors numbered past select(2)'s 1,024."""

from __future__ import annotations

import fcntl
import os
import time

from everystep import waits


def test_a_pipe_numbered_past_1024_is_waited_on_and_seen_readable():
    read_end, write_end = os.pipe()
    high = fcntl.fcntl(read_end, fcntl.F_DUPFD, 1500)  # the lowest free descriptor from 1,500 on
    try:
        started = time.monotonic()
        assert waits.readable([high], 0.05) == []
        assert time.monotonic() - started >= 0.04  # it waited, and for about as long as asked
        os.write(write_end, b"x")
        assert set(waits.readable([read_end, high], 0)) == {read_end, high}
        assert waits.writable(write_end, 0)
    finally:
        for fd in (read_end, write_end, high):
            os.close(fd)


def test_a_closed_write_end_makes_the_read_end_readable():
    read_end, write_end = os.pipe()
    os.close(write_end)
    try:
        assert waits.readable([read_end], 1.0) == [read_end]
    finally:
        os.close(read_end)


def test_a_wait_shorter_than_a_millisecond_still_waits():
    read_end, write_end = os.pipe()
    try:
        started = time.monotonic()
        assert waits.readable([read_end], 0.0004) == []
        assert time.monotonic() - started >= 0.0004
    finally:
        os.close(read_end)
        os.close(write_end)
