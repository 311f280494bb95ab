"""Run by tests/test_django.py in a process of its own (Django's settings are
global): schedule() inside and outside Django transactions, and schedule_many()."""

from __future__ import annotations

import json
import sys

import django
from django.conf import settings
from psycopg import conninfo

import everystep
from tests.apps.workflows import quick


def configure_django(url: str) -> None:
    """Django with one database: the test's (its schema in the options)."""
    params = conninfo.conninfo_to_dict(url)
    settings.configure(DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": params["dbname"], "USER": params.get("user", ""),
        "HOST": params.get("host", ""), "PORT": params.get("port", ""),
        "OPTIONS": {"options": params.get("options", "")},
    }})
    django.setup()


def main(url: str) -> None:
    configure_django(url)
    from django.db import transaction  # noqa: PLC0415

    with transaction.atomic():
        committed = everystep.schedule(quick, "/tmp", idempotency_key="django:1")
    again = everystep.schedule(quick, "/tmp", idempotency_key="django:1")
    try:
        with transaction.atomic():
            everystep.schedule(quick, "/tmp", idempotency_key="django:2")
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    with transaction.atomic():
        many = everystep.schedule_many(quick, [("/tmp",)] * 2, idempotency_keys=["django:1", "django:3"])
    print(json.dumps({"committed": str(committed.id), "again": str(again.id), "again_created": again.created,
                      "many": [[str(run.id), run.created] for run in many]}))


if __name__ == "__main__":
    main(sys.argv[1])
