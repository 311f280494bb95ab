"""UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then randomness, so ids
sort in creation order."""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last = 0


def uuid7() -> uuid.UUID:
    return uuid7_many(1)[0]


def uuid7_many(count: int) -> list[uuid.UUID]:
    """`count` UUIDv7s in increasing order (one clock read and one read of
    randomness for all: bulk scheduling makes tens of thousands)."""
    # rand_a carries 12 more bits of clock (RFC 9562 method 3), made strictly
    # increasing within this process, so ids made here sort in call order.
    global _last
    with _lock:
        first = max(time.time_ns() // 1000 * 4096 // 1000, _last + 1)  # units of 1/4096 ms
        _last = first + count - 1
    randomness = os.urandom(8 * count)
    ids = []
    for i in range(count):
        millis, fraction = divmod(first + i, 4096)
        rand_b = int.from_bytes(randomness[8 * i:8 * i + 8], "big") & ((1 << 62) - 1)
        ids.append(uuid.UUID(int=(millis << 80) | (0x7 << 76) | (fraction << 64) | (0b10 << 62) | rand_b))
    return ids
