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
    # rand_a carries 12 more bits of clock (RFC 9562 method 3), made strictly
    # increasing within this process, so ids made here sort in call order.
    global _last
    with _lock:
        stamp = max(time.time_ns() // 1000 * 4096 // 1000, _last + 1)  # units of 1/4096 ms
        _last = stamp
    millis, fraction = divmod(stamp, 4096)
    rand_b = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
    value = (millis << 80) | (0x7 << 76) | (fraction << 64) | (0b10 << 62) | rand_b
    return uuid.UUID(int=value)
