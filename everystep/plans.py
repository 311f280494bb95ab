"""Code written once for a sync and an async caller: a generator that yields
what it needs done (a statement, a write, a pause...) and is sent back each
one's result, or has its exception thrown in. A driver does what is asked,
on its thread or awaiting on a loop; `Stepper` is what both drivers share."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

DONE: Any = object()  # what Stepper.next returns once the generator has returned


class Stepper:
    """Steps a generator: `next()` gives what it asks for next (DONE at its
    end, its value in `value`); the driver sets `sent` (the result) or
    `thrown` (the exception) before the next call."""

    __slots__ = ("plan", "sent", "thrown", "value")

    def __init__(self, plan: Generator):
        self.plan = plan
        self.sent: Any = None
        self.thrown: BaseException | None = None
        self.value: Any = None

    def next(self) -> Any:
        try:
            if self.thrown is None:
                return self.plan.send(self.sent)
            return self.plan.throw(self.thrown)
        except StopIteration as done:
            self.value = done.value
            return DONE
        finally:
            self.sent = self.thrown = None
