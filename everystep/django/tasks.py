"""A backend of Django's tasks API whose tasks are everystep runs:

    TASKS = {"default": {"BACKEND": "everystep.django.tasks.EverystepBackend"}}

On Django 6 and later it is a backend of `django.tasks`; on older Django (or
Python 3.11) of the `django-tasks` backport (`django_tasks`, the same API).

- `enqueue` / `aenqueue` write the run in the current transaction of Django's
  connection: inside `transaction.atomic()` the task commits or rolls back
  with the rows around it (no `on_commit` window in which a crash loses it);
  outside, Django's autocommit commits it at once. `run_after` is a delayed
  start; `priority` is the run's (schedule(priority=...): higher first).
  The result's id is the run's id.
- A task's function runs as the one step of its run (retried as a step:
  stack `@everystep.step(retries=..., backoff=..., unsafe_to_repeat=...)`
  under `@task` for its options). Stack `@everystep.workflow` under `@task`
  instead and the function is the run's body: the @steps it calls are
  recorded, and the task is a durable workflow (sleeps, messages, children).
  `with idempotency_key("order:42"): send_receipt.enqueue(42)` enqueues once
  per key; `with attributes({"tenant": "acme"}): ...` gives the runs enqueued
  in the block those searchable attributes.
- `get_result` maps the run's status: scheduled, and waiting before its
  first step (a delayed start) -> READY; running, waiting after it began (a
  sleep, a message, a child, a retry's back-off) and blocked (an unsafe
  step waits for an operator: not finished, it may still succeed) ->
  RUNNING; completed -> SUCCESSFUL; failed, stopped and cancelled -> FAILED,
  with the run's error as the TaskError.
- `task_enqueued` is sent at enqueue, `task_started` and `task_finished` by
  the worker executing the run (at each execution's start, and once it has
  an outcome); a receiver that raises is logged and never fails the run.
- The worker runs the tasks once Django is set up in it before the tasks'
  module is imported: the supervisor does so when DJANGO_SETTINGS_MODULE is
  set, and `manage.py everystep_worker` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import uuid
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from django.core import checks
from django.db import connections
from django.utils import timezone

from everystep import api, db, registry, serde
from everystep.connections import DjangoCursorConnection
from everystep.context import current_run
from everystep.errors import LostClaim
from everystep.schema import RunStatus

try:  # Django 6 and later
    from django.tasks import TaskContext, TaskResult, TaskResultStatus
    from django.tasks import checks as _checks  # noqa: F401  (registers the backends' system check)
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # the backport
    from django_tasks import TaskContext, TaskResult, TaskResultStatus
    from django_tasks import checks as _checks  # noqa: F401
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import TaskError
    from django_tasks.exceptions import InvalidTaskError as InvalidTask
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started

log = logging.getLogger("everystep")

_key: ContextVar[str | None] = ContextVar("everystep_task_key", default=None)
_attributes: ContextVar[dict | None] = ContextVar("everystep_task_attributes", default=None)


@contextlib.contextmanager
def idempotency_key(key: str) -> Iterator[None]:
    """The tasks enqueued in this block with this key: a second enqueue of the
    same task and key returns the first one's result (as schedule() does)."""
    token = _key.set(key)
    try:
        yield
    finally:
        _key.reset(token)


@contextlib.contextmanager
def attributes(values: dict) -> Iterator[None]:
    """The tasks enqueued in this block get these run attributes (as
    schedule(attributes=...) takes them), searchable with everystep.find_runs."""
    token = _attributes.set(dict(values))
    try:
        yield
    finally:
        _attributes.reset(token)


class EverystepBackend(BaseTaskBackend):
    """Django tasks as everystep runs. OPTIONS: {"DATABASE": alias} (default
    "default"), the Django database whose transaction enqueue joins."""

    supports_defer = True
    supports_priority = True  # the run's priority (-100..100, higher first), as schedule(priority=...) takes it
    supports_async_task = True
    supports_get_result = True

    def __init__(self, alias: str, params: dict):
        super().__init__(alias, params)
        self.database = self.options.get("DATABASE", "default")

    def validate_task(self, task: Any) -> None:
        """Django's checks, and everystep's: arguments by position only (a run
        stores them so); then the task's workflow is registered, so that a
        worker importing the task's module can run it."""
        super().validate_task(task)
        parameters = inspect.signature(task.func).parameters.values()
        if any(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in parameters):
            raise InvalidTask("everystep stores a task's arguments by position: no keyword-only parameters "
                              "or **kwargs")
        if task.takes_context and registry.workflow_name(task.func) is not None:
            raise InvalidTask("a task that is an @everystep.workflow takes no context: use everystep.current()")
        _register(self, task)

    # ------------------------------------------------------------ enqueue

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        positional = _positional(task, args, kwargs)
        at = task.run_after
        if at is not None and timezone.is_naive(at):
            at = timezone.make_aware(at)
        conn = DjangoCursorConnection(connections[self.database])
        run = api.schedule(registry.WORKFLOWS[_name(task)], *positional, idempotency_key=_key.get(),
                           conn=conn, at=at, priority=task.priority or None,  # 0: the workflow's default
                           attributes=_attributes.get())
        result = self._result(task, str(run.id), TaskResultStatus.READY, positional, timezone.now())
        if not run.created:
            result = self.get_result(str(run.id))
        _send(task_enqueued, type(self), result)
        return result

    # ------------------------------------------------------------ results

    def get_result(self, result_id: str) -> TaskResult:
        try:
            run_id = uuid.UUID(str(result_id))
        except ValueError:
            raise TaskResultDoesNotExist(result_id) from None
        conn = DjangoCursorConnection(connections[self.database])
        row = db.load_run(conn, run_id)
        if row is None:
            raise TaskResultDoesNotExist(result_id)
        row = {key: _loaded(value) if key in ("args", "result", "error") else value for key, value in row.items()}
        task = _TASKS.get(row["name"])
        if task is None:
            raise TaskResultDoesNotExist(f"{result_id} is a run of {row['name']}, not of a task of this process")
        steps = db.load_steps(conn, run_id)
        started = [step["started_at"] for step in steps if step["started_at"] is not None]
        result = self._result(task, str(run_id), _status(row, steps), serde.from_json(row["args"]),
                              row["created_at"], started[0] if started else None,
                              started[-1] if started else None, row["completed_at"],
                              [row["claimed_by"]] if row["claimed_by"] else [])
        if row["status"] == RunStatus.COMPLETED:
            object.__setattr__(result, "_return_value", serde.from_json(row["result"]))
        if row["error"] is not None:
            result.errors.append(TaskError(exception_class_path=row["error"].get("type") or "Exception",
                                           traceback=row["error"].get("message") or ""))
        return result

    def _result(self, task: Any, result_id: str, status: Any, args: list, enqueued_at: Any,
                started_at: Any = None, last_attempted_at: Any = None, finished_at: Any = None,
                worker_ids: list | None = None) -> TaskResult:
        return TaskResult(task=task, id=result_id, status=status, enqueued_at=enqueued_at, started_at=started_at,
                          finished_at=finished_at, last_attempted_at=last_attempted_at, args=list(args), kwargs={},
                          backend=self.alias, errors=[], worker_ids=worker_ids or [])

    # ------------------------------------------------------------ checks

    def check(self, **kwargs: Any) -> list:
        messages = list(super().check(**kwargs))
        try:
            missing = db.missing_migrations(DjangoCursorConnection(connections[self.database]))
        except Exception as exc:  # the database is away: Django's own checks say so
            log.debug("could not check everystep's schema: %s", exc)
            return messages
        if missing:
            messages.append(checks.Error(
                f"the database {self.database!r} lacks everystep's schema ({len(missing)} migrations not applied, "
                f"from {missing[0]})", hint="run `everystep --database-url URL migrate` (the supervisor does at "
                "start with migrate: true)", obj=self, id="everystep.E001"))
        return messages


def _loaded(value: Any) -> Any:
    """A JSON column as data: Django's connection gives it as text."""
    return json.loads(value) if isinstance(value, str) else value


def _status(row: dict, steps: list[dict]) -> Any:
    status = row["status"]
    if status == RunStatus.COMPLETED:
        return TaskResultStatus.SUCCESSFUL
    if status in (RunStatus.FAILED, RunStatus.STOPPED, RunStatus.CANCELLED):
        return TaskResultStatus.FAILED
    if status == RunStatus.SCHEDULED or (status == RunStatus.WAITING and not steps):
        return TaskResultStatus.READY
    return TaskResultStatus.RUNNING  # running, waiting after it began, blocked


def _positional(task: Any, args: Any, kwargs: Any) -> tuple:
    """The task's arguments by position (defaults of the ones not given left to the function)."""
    try:
        bound = inspect.signature(task.func).bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise InvalidTask(f"{task.module_path}: {exc}") from None
    if bound.kwargs:
        raise InvalidTask(f"{task.module_path}: arguments by position only")
    return bound.args


# ---------------------------------------------------------------- the tasks' workflows

_TASKS: dict[str, Any] = {}  # the first Task validated under each workflow name, by it


def _name(task: Any) -> str:
    return registry.workflow_name(task.func) or task.module_path


def _register(backend: EverystepBackend, task: Any) -> None:
    """The workflow of a task, registered under the task's name: its body
    sends task_started, calls the task's workflow (an @workflow) or its one
    step, and sends task_finished with the outcome."""
    known = _TASKS.get(_name(task))
    if known is not None and known.func is task.func:
        return  # (a copy of it: task.using(...))
    _TASKS[_name(task)] = task
    fn = task.func
    if registry.workflow_name(fn) is not None:
        call = fn  # the body is the workflow's own
    elif hasattr(fn, "__everystep_step__"):
        call = fn  # a step already, with its options
    else:
        call = api.step(_with_context(backend, task) if task.takes_context else fn)

    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__wrapped__", None)):
        @functools.wraps(fn)
        async def body(*args: Any) -> Any:
            await asyncio.to_thread(_started, backend, task, args)
            try:
                value = await call(*args)
            except Exception as exc:
                if not isinstance(exc, LostClaim):  # (its run goes on elsewhere)
                    await asyncio.to_thread(_finished, backend, task, args, exc, None)
                raise
            await asyncio.to_thread(_finished, backend, task, args, None, value)
            return value
    else:
        @functools.wraps(fn)
        def body(*args: Any) -> Any:
            _started(backend, task, args)
            try:
                value = call(*args)
            except Exception as exc:
                if not isinstance(exc, LostClaim):  # (its run goes on elsewhere)
                    _finished(backend, task, args, exc, None)
                raise
            _finished(backend, task, args, None, value)
            return value

    body.__everystep_concurrency__ = getattr(fn, "__everystep_concurrency__", None)  # type: ignore[attr-defined]
    if task.takes_context:  # a run stores the arguments after the context: what schedule() checks
        parameters = list(inspect.signature(fn).parameters.values())[1:]
        body.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    registry.register(body)


def _with_context(backend: EverystepBackend, task: Any) -> Any:
    """A task function that takes a context, as a step function that does not
    (the context is not an argument a run can store): it reads the task's
    result when it runs."""
    fn = task.func

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def with_context(*args: Any) -> Any:
            context = TaskContext(task_result=await backend.aget_result(str(current_run.get().workflow_id)))
            return await fn(context, *args)
    else:
        @functools.wraps(fn)
        def with_context(*args: Any) -> Any:
            return fn(TaskContext(task_result=backend.get_result(str(current_run.get().workflow_id))), *args)
    return with_context


def _started(backend: EverystepBackend, task: Any, args: tuple) -> None:
    run = current_run.get()
    now = timezone.now()
    result = backend._result(task, str(run.workflow_id), TaskResultStatus.RUNNING, list(args), None, now, now,
                             worker_ids=[run.runner])
    _send(task_started, type(backend), result)


def _finished(backend: EverystepBackend, task: Any, args: tuple, exc: BaseException | None, value: Any) -> None:
    run = current_run.get()
    now = timezone.now()
    status = TaskResultStatus.SUCCESSFUL if exc is None else TaskResultStatus.FAILED
    result = backend._result(task, str(run.workflow_id), status, list(args), None, None, now, now,
                             worker_ids=[run.runner])
    if exc is None:
        object.__setattr__(result, "_return_value", value)
    else:
        error = serde.encode_exception(exc)
        result.errors.append(TaskError(exception_class_path=error["type"], traceback=error["message"]))
    _send(task_finished, type(backend), result)


def _send(signal: Any, sender: type, result: TaskResult) -> None:
    """Send a task signal; a receiver that raises is logged, never raised."""
    for receiver, response in signal.send_robust(sender=sender, task_result=result):
        if isinstance(response, Exception):
            log.error("a receiver of a task signal raised: %s: %s", type(response).__name__, response,
                      exc_info=response, extra={"receiver": getattr(receiver, "__qualname__", repr(receiver))})


__all__ = ["EverystepBackend", "idempotency_key"]
