"""How the application's modules are found: one rule for the supervisor's
`imports`, `everystep worker --import` and `everystep schedule MODULE:FUNC`."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def import_module(name: str) -> ModuleType:
    """Import `name` with the current directory first on sys.path, as
    `python -m` and gunicorn do, so a module next to where the command runs
    is found however the command was started (a console script's sys.path
    starts with its own bin folder instead)."""
    here = os.getcwd()
    if sys.path[:1] != [here]:
        sys.path.insert(0, here)
    return importlib.import_module(name)
