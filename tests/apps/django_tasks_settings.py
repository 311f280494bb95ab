"""Django settings for the tasks tests' worker processes: the test database
from EVERYSTEP_TEST_DJANGO_URL (a libpq string, its schema in the options)."""

from __future__ import annotations

import os

from psycopg import conninfo

_params = conninfo.conninfo_to_dict(os.environ["EVERYSTEP_TEST_DJANGO_URL"])
DATABASES = {"default": {
    "ENGINE": "django.db.backends.postgresql", "NAME": _params["dbname"], "USER": _params.get("user", ""),
    "HOST": _params.get("host", ""), "PORT": _params.get("port", ""),
    "OPTIONS": {"options": _params.get("options", "")},
}}
INSTALLED_APPS = ["everystep.django"]
TASKS = {"default": {"BACKEND": "everystep.django.tasks.EverystepBackend"}}
USE_TZ = True
SECRET_KEY = "tests"
