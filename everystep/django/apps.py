"""The Django app of everystep: add "everystep.django" to INSTALLED_APPS for
`manage.py everystep_worker` and the tasks backend's system check."""

from __future__ import annotations

from django.apps import AppConfig


class EverystepConfig(AppConfig):
    name = "everystep.django"
    label = "everystep"
    verbose_name = "everystep"

    def ready(self) -> None:
        try:
            from everystep.django import tasks  # noqa: F401, PLC0415  (the tasks backend's system check)
        except ImportError:
            pass  # neither Django's tasks API (Django 6) nor its backport (django-tasks): no backend to check
