"""everystep in a Django project: the tasks backend of Django's tasks API
(`everystep.django.tasks.EverystepBackend`), `manage.py everystep_worker`
(with "everystep.django" in INSTALLED_APPS), and the database URL of a
Django database for the engine. The operators' UI mounts with
`include("everystep.ui.django_urls")`."""

from __future__ import annotations

from typing import Any

from psycopg import conninfo


def database_url(alias: str = "default") -> str:
    """A libpq connection string to the PostgreSQL database of Django's
    DATABASES[alias] (its schema in the options, if any), for the engine's
    own connections (workers, migrations)."""
    from django.conf import settings  # noqa: PLC0415  (Django is configured by then)

    database: dict[str, Any] = settings.DATABASES[alias]
    options = dict(database.get("OPTIONS") or {})
    params = {"dbname": database.get("NAME"), "user": database.get("USER"), "password": database.get("PASSWORD"),
              "host": database.get("HOST"), "port": database.get("PORT")}
    params.update({key: value for key, value in options.items() if isinstance(value, (str, int))})
    return conninfo.make_conninfo(**{key: str(value) for key, value in params.items() if value not in (None, "")})
