"""Run by tests/test_django.py in a process of its own: a graph created,
filled and sealed in Django's transaction, and one rolled back."""

from __future__ import annotations

import sys

from everystep import dags
from tests.apps.dag_workflows import noop, produce
from tests.apps.django_scheduling import configure_django


def main(url: str) -> None:
    configure_django(url)
    from django.db import transaction  # noqa: PLC0415

    with transaction.atomic():
        g = dags.create("django")
        first = g.add(produce, 1, key="first")
        g.add(noop, key="second", depends_on=[first])
        g.seal()
    try:
        with transaction.atomic():
            dags.create("django-gone").add(noop, key="x")
            raise RuntimeError("roll back")
    except RuntimeError:
        pass


if __name__ == "__main__":
    main(sys.argv[1])
