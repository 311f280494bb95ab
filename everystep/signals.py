"""The signal wiring of a long-running loop (`Worker`, `Maintenance`): the
same in the `everystep` command, in the supervisor's children and in a
program that embeds them."""

from __future__ import annotations

import signal
from typing import Protocol


class Stoppable(Protocol):
    def stop(self, fast: bool = False) -> None: ...


def stop_on_signals(loop: Stoppable) -> None:
    """TERM and INT stop `loop` with a drain, QUIT stops it fast. Call it from
    the main thread, before `loop.run()`."""
    signal.signal(signal.SIGTERM, lambda *_: loop.stop())
    signal.signal(signal.SIGINT, lambda *_: loop.stop())
    signal.signal(signal.SIGQUIT, lambda *_: loop.stop(fast=True))
