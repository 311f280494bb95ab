"""Workflow names and functions, both ways, in one place: the registry that
@workflow fills, the `module.qualname` naming, resolving a stored name back
to its function, and importing what the application names (`imports`,
`--import`, `MODULE:FUNC`, and the classes the JSON codec stores by path)."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from everystep.errors import EverystepError
from everystep.logs import first_line
from everystep.schema import MAX_NAME

# Workflows by name, filled by @workflow at import time.
WORKFLOWS: dict[str, Callable] = {}



def qualified_name(fn: Callable) -> str:
    """The name a workflow or a step is known by: `module.qualname`."""
    return f"{fn.__module__}.{fn.__qualname__}"


def register(fn: Callable) -> str:
    """Register `fn` as the workflow of its name; returns the name."""
    name = qualified_name(fn)
    if len(name) > MAX_NAME:
        raise EverystepError(f"workflow name {name[:60]}... is longer than {MAX_NAME} characters")
    fn.__everystep_workflow__ = name  # type: ignore[attr-defined]
    WORKFLOWS[name] = fn
    return name


def workflow_name(fn: Any) -> str | None:
    """The registered name of an @workflow function, None for anything else."""
    return getattr(fn, "__everystep_workflow__", None)


def resolve(name: str) -> Callable:
    """The @workflow function of a stored name: registered by an import
    already, or importable under that name. TypeError if it is something
    else; ImportError if nothing has that name."""
    fn = WORKFLOWS.get(name)
    if fn is not None:
        return fn
    fn = import_path(name)
    if workflow_name(fn) != name:
        raise TypeError(f"{name} is not an @workflow function")
    return fn


def workflow_problem(name: str, args: tuple | list | None = None) -> str | None:
    """What is wrong with running the workflow `name` with `args` (positional;
    None: not checked): nothing defines it, it is a step or something else,
    or the arguments do not fit its parameters. None when nothing is."""
    try:
        fn = WORKFLOWS.get(name) or import_path(name)
    except ImportError:
        return f"no module defines {name} (is its module in imports:?)"
    except Exception as exc:  # whatever importing its module raises
        return f"importing {name} failed: {type(exc).__name__}: {first_line(exc)}"
    if workflow_name(fn) != name:
        if getattr(fn, "__everystep_step__", None) is not None:
            return f"{name} is a @step, not a @workflow: a schedule runs a workflow"
        return f"{name} is not an @workflow function"
    if args is not None:
        problem = arguments_problem(fn, args)
        if problem:
            return f"{name}{problem}"
    return None


def arguments_problem(fn: Callable, args: tuple | list) -> str | None:
    """Why `fn(*args)` could not be called ("(signature): why (given N)"), or None."""
    signature = _signatures.get(fn)
    if signature is None:
        try:
            signature = _signatures[fn] = inspect.signature(fn)
        except (TypeError, ValueError):
            return None  # no signature to check against
    try:
        signature.bind(*args)
    except TypeError as exc:
        count = len(args)
        return f"{signature}: {exc} (given {count} argument{'' if count == 1 else 's'})"
    return None


_signatures: dict[Callable, inspect.Signature] = {}  # the workflows' signatures, read once


def _found(name: str) -> Callable | None:
    """The @workflow function of a stored name, None when it resolves to nothing."""
    fn = WORKFLOWS.get(name)
    if fn is None:
        try:
            fn = resolve(name)
        except Exception:
            return None
    return fn


def timeout_of(name: str) -> float | None:
    """The @workflow(timeout=) of a stored name, in seconds (None: none, or
    not importable here)."""
    return getattr(_found(name), "__everystep_timeout__", None)


def is_async(name: str) -> bool:
    """Whether the workflow of a stored name is an `async def` one (False
    when the name resolves to nothing: the sync path reports it). Asked
    three times per run: found once per function."""
    fn = _found(name)
    if fn is None:
        return False
    answer = _asynchronous.get(fn)
    if answer is None:
        answer = _asynchronous[fn] = inspect.iscoroutinefunction(fn)
    return answer


_asynchronous: dict[Callable, bool] = {}  # is_async's answer by workflow function


def kinds() -> tuple[bool, bool]:
    """Whether the registered workflows include sync ones, and async ones
    (nothing registered: sync, the runs of names no import made fail there)."""
    count = len(WORKFLOWS)
    if _kinds[0] != count:
        asynchronous = sum(inspect.iscoroutinefunction(fn) for fn in list(WORKFLOWS.values()))
        _kinds[:] = [count, asynchronous < count or count == 0, asynchronous > 0]
    return _kinds[1], _kinds[2]


_kinds: list = [-1, True, False]  # (the count of workflows they were found for, sync, async)


def import_module(name: str) -> ModuleType:
    """Import `name` with the current directory first on sys.path, as
    `python -m` and gunicorn do, so a module next to where the command runs
    is found however the command was started (a console script's sys.path
    starts with its own bin folder instead). With DJANGO_SETTINGS_MODULE
    set, Django is set up first: a project's tasks and models import only
    in a set-up Django."""
    _current_directory_first()
    _set_up_django()
    return importlib.import_module(name)


def _current_directory_first() -> None:
    here = os.getcwd()
    if sys.path[:1] != [here]:
        sys.path.insert(0, here)


def _set_up_django() -> None:
    if not os.environ.get("DJANGO_SETTINGS_MODULE") or "django" in _ready:
        return
    import django  # noqa: PLC0415  (a Django project's only)
    from django.apps import apps  # noqa: PLC0415

    if not apps.ready:
        django.setup()
    _ready.add("django")


_ready: set[str] = set()


def import_path(path: str) -> Any:
    """Import `module.qualname`, trying the longest importable module prefix
    (the current directory first on sys.path, as for `import_module`: a
    stored name finds the module `everystep schedule` found there)."""
    _current_directory_first()
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise ImportError(f"cannot import {path!r}")


class TargetError(Exception):
    """A `MODULE:FUNC` that does not name an @workflow; the message is one line."""


def import_target(target: str) -> Callable:
    """The @workflow function a `MODULE:FUNC` names (the module imported the
    way `import_module` does)."""
    module_name, _, qualname = target.partition(":")
    if not module_name or not qualname:
        raise TargetError(f"expected MODULE:FUNC (e.g. myapp.workflows:provision_vm), not {target!r}")
    try:
        found: Any = import_module(module_name)
    except Exception as exc:  # whatever the module raises while importing
        raise TargetError(f"cannot import {module_name}: {type(exc).__name__}: {first_line(exc)}") from None
    try:
        for attr in qualname.split("."):
            found = getattr(found, attr)
    except AttributeError:
        raise TargetError(f"module {module_name} has no {qualname!r}") from None
    if workflow_name(found) is None:
        raise TargetError(f"{target} is not an @workflow")
    return found
