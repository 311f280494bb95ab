"""The CLI's error: one line for stderr and its exit code (the codes are
listed in everystep/cli/__init__.py)."""

from __future__ import annotations

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_DATABASE = 3
EXIT_PLAN_CHANGED = 4


class CliError(Exception):
    """One clear line for stderr, and the exit code that goes with it."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code
