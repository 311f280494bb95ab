"""How a step retries a failed attempt (`@step(retries=, backoff=, retry_on=)`)."""

from __future__ import annotations

import random
from typing import NamedTuple


class Backoff(NamedTuple):
    """The wait before retry n (n = 1, 2, ...): min(maximum, initial *
    factor ** (n - 1)) seconds, multiplied by a random factor in
    [1 - jitter, 1]. The default: 1 s, 2 s, 4 s, ... at most 300 s."""
    initial: float = 1.0
    factor: float = 2.0
    maximum: float = 300.0
    jitter: float = 0.2

    def wait(self, retry: int) -> float:
        base = min(self.maximum, self.initial * self.factor ** (retry - 1))
        return base * (1 - self.jitter * random.random())


class RetryPolicy(NamedTuple):
    """How a step is retried."""
    retries: int  # further attempts after the first
    backoff: Backoff
    retry_on: tuple[type[BaseException], ...] | None  # None: every Exception (safe steps only)

    def retried(self, unsafe: bool, exc: Exception, failed_before: int) -> bool:
        """Whether an attempt that raised `exc` is tried again: within the
        count, and of a type retried (an unsafe step only on the types listed)."""
        if failed_before >= self.retries:
            return False
        if self.retry_on is None:
            return not unsafe
        return isinstance(exc, self.retry_on)
