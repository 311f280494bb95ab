"""Per-thread run context and step-id allocation (the dotpath rules).

Each scope (the workflow body, each parallel branch) has a counter starting at
1; every step call and every `parallel` call advances it by one. An unnamed call
takes the counter value as its id segment; a named one (`everystep_id=`) takes
the name. A `parallel` call is a fork: branch i is the scope `<fork>.<i>`.
"""

from __future__ import annotations

import contextvars
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from everystep.errors import HALTS, EverystepError
from everystep.retries import RetryPolicy
from everystep.schema import MAX_STEP_ID

# A name is one dotpath segment: no dots, no spaces, and not all digits
# (those are the positional ids, so a name could never collide with one).
_NAME = re.compile(r"(?!\d+$)[A-Za-z0-9_\-:]+")
# The same rule, for other names that become one segment of a step id (a patch's).
SEGMENT = _NAME


@dataclass(frozen=True)
class Outcome:
    """A recorded step: `status` is done, failed, started or retrying."""

    name: str
    status: str
    result: Any = None
    error: BaseException | None = None


class Recorder(Protocol):
    """What records and serves a run's steps: the runner's replay of it."""

    def step(self, scope: Scope, fn: Callable, name: str, unsafe: bool, args: tuple, kwargs: dict,
             everystep_id: str | None, retry: RetryPolicy | None = None, timeout: float | None = None,
             rate_limit: str | None = None, transactional: bool = False, write_behind: bool = False) -> Any: ...

    def sleep(self, scope: Scope, seconds: float | None, until: Any) -> None: ...

    def fork(self, scope: Scope, branches: tuple, everystep_id: str | None) -> tuple: ...

    def outcomes(self) -> Mapping[str, Outcome]: ...

    def patched(self, scope: Scope, patch: str) -> bool: ...

    def wait_for(self, scope: Scope, topic: str, timeout: float | None) -> Any: ...

    def set_event(self, scope: Scope, key: str, value_json: str) -> None: ...

    def start_child(self, scope: Scope, child_name: str, args_json: str) -> uuid.UUID: ...

    def child_result(self, scope: Scope, child: uuid.UUID, timeout: float | None) -> Any: ...

    def gather(self, scope: Scope, aws: tuple, everystep_id: str | None) -> Any: ...

    def call_child(self, scope: Scope, child_name: str, args_json: str) -> Any: ...

    def diverged(self, message: str) -> BaseException: ...

    def started_task(self, task: Any) -> None: ...

    @property
    def asynchronous(self) -> bool: ...


class RunContext:
    """What `everystep.current()` returns inside a running workflow."""

    def __init__(self, workflow_id: uuid.UUID, workflow_name: str, runner: str, replay: Recorder):
        self.workflow_id = workflow_id
        self.workflow_name = workflow_name
        self.runner = runner  # the claimer executing it
        self.replay = replay  # the runner's Replay: records and serves steps

    @property
    def outcomes(self) -> Mapping[str, Outcome]:
        """Recorded outcomes by step id, as of now."""
        return self.replay.outcomes()

    def __repr__(self) -> str:
        return f"<everystep run {self.workflow_id} {self.workflow_name}>"


class Scope:
    """One counter of the dotpath: the workflow body or one parallel branch."""

    __slots__ = ("run", "prefix", "counter", "used", "lock")

    def __init__(self, run: RunContext, prefix: str = ""):
        self.run = run
        self.prefix = prefix
        self.counter = 0
        self.used: set[str] = set()
        self.lock = threading.Lock()

    def next_id(self, everystep_id: str | None) -> str:
        """Advance the counter and return the full step id of this call."""
        with self.lock:
            self.counter += 1
            if everystep_id is None:
                segment = str(self.counter)
            else:
                if not isinstance(everystep_id, str) or not _NAME.fullmatch(everystep_id):
                    raise EverystepError(
                        f"bad everystep_id {everystep_id!r}: use letters, digits, '_', '-' or ':', "
                        "not only digits, and no dots"
                    )
                segment = everystep_id
            full = self.prefix + segment
            if segment in self.used:
                raise EverystepError(f"duplicate step id {full!r} in one scope")
            if len(full) > MAX_STEP_ID:
                raise EverystepError(f"step id {full[:60]}... is {len(full)} characters; at most {MAX_STEP_ID}")
            self.used.add(segment)
            return full

    def branch(self, fork_id: str, index: int) -> Scope:
        return Scope(self.run, f"{fork_id}.{index}.")


# The scope that step calls on this thread are recorded in; None outside a
# workflow and while a step's own function runs (nested steps are plain calls).
current_scope: ContextVar[Scope | None] = ContextVar("everystep_scope", default=None)
# The running workflow, also visible from inside a step's function.
current_run: ContextVar[RunContext | None] = ContextVar("everystep_run", default=None)
# The step whose function runs here, and its try (1, 2, ... as retried):
# what a stream entry written from inside a step is tagged with.
current_step: ContextVar[tuple[str, int] | None] = ContextVar("everystep_step", default=None)


def current() -> RunContext | None:
    """The running workflow's context, or None outside a workflow."""
    return current_run.get()


def run_branches(branches: tuple, scopes: list[Scope] | None) -> tuple:
    """Run each branch on its own thread (the last on this one), wait for all,
    and return their results in order; raise one failure as is, several as an
    ExceptionGroup. With `scopes`, each branch records into its scope."""
    results: list[Any] = [None] * len(branches)
    errors: list[BaseException | None] = [None] * len(branches)

    def run_one(i: int) -> None:
        if scopes is not None:
            current_scope.set(scopes[i])
        try:
            branch = branches[i]
            if isinstance(branch, (list, tuple)):
                results[i] = tuple(call() for call in branch)
            else:
                results[i] = branch()
        except BaseException as exc:  # noqa: BLE001  (re-raised by the caller)
            errors[i] = exc

    for branch in branches:
        calls = branch if isinstance(branch, (list, tuple)) else [branch]
        for call in calls:
            if not callable(call):
                raise TypeError(f"parallel() takes zero-argument callables or lists of them, not {call!r}")
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(run_one, i), daemon=True)
        for i in range(len(branches) - 1)
    ]
    for thread in threads:
        thread.start()
    if branches:
        contextvars.copy_context().run(run_one, len(branches) - 1)
    for thread in threads:
        thread.join()

    return joined(results, errors, "parallel branches")


def joined(results: list, errors: list[BaseException | None], what: str) -> tuple:
    """The results of concurrent branches that all ran to their end, in
    order; or the one failure as is, several as an ExceptionGroup, a halt of
    the run (or a BaseException) first."""
    failures = [exc for exc in errors if exc is not None]
    for exc in failures:
        if isinstance(exc, HALTS) or not isinstance(exc, Exception):
            raise exc
    if len(failures) == 1:
        raise failures[0]
    if failures:
        raise ExceptionGroup(f"{len(failures)} of {len(errors)} {what} failed", failures)
    return tuple(results)
