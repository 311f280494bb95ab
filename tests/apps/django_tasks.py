"""The tasks of tests/test_django_tasks.py (a Django project's tasks module:
imported once Django is set up, by tests/apps/django_tasks_project.py or a
worker with DJANGO_SETTINGS_MODULE=tests.apps.django_tasks_settings)."""

from __future__ import annotations

import asyncio

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task

import everystep
from everystep import step, workflow


@task
def add(a: int, b: int = 1) -> int:
    return a + b


@task
def fails(message: str) -> None:
    raise ValueError(message)


@task
async def add_later(a: int, b: int) -> int:
    await asyncio.sleep(0.01)
    return a + b


@step
def double(n: int) -> int:
    return n * 2


@task
@workflow
def durable(n: int) -> int:
    """A task that is a workflow: its steps are recorded."""
    return double(n) + double(n + 1)


@task
@step(retries=2, backoff=0.01)
def flaky(marker: list) -> str:
    everystep.current()  # (a step sees its run)
    return "ok"


@task(takes_context=True)
def with_context(context, n: int) -> list:
    return [context.task_result.id, n]
