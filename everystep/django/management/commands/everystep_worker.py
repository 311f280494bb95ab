"""`manage.py everystep_worker`: one everystep worker in this process, running
the project's tasks (the `tasks` modules of the installed apps, and any
--import) and workflows, until TERM/INT (drain) or QUIT (fast stop)."""

from __future__ import annotations

import os
import socket
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.utils.module_loading import autodiscover_modules

from everystep import logs, registry
from everystep.django import database_url


class Command(BaseCommand):
    help = "Run an everystep worker for this project's tasks and workflows."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", default=None,
                            help="runner name, unique while alive (default: <host>-<pid>)")
        parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                            help="a module of workflows or tasks to import besides the apps' tasks modules")
        parser.add_argument("--database", default="default",
                            help="the Django database the runs are in (default: default); "
                                 "settings.EVERYSTEP_DATABASE_URL wins when set")
        parser.add_argument("--threads", type=int, default=8, help="sync run slots (default 8)")
        parser.add_argument("--async-slots", type=int, default=100, help="async run slots (default 100)")
        parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    def handle(self, *args: Any, **options: Any) -> None:
        from everystep.signals import stop_on_signals  # noqa: PLC0415
        from everystep.worker import Worker, freeze_what_is_loaded  # noqa: PLC0415

        logs.configure(options["log_level"])
        autodiscover_modules("tasks")
        for module in options["imports"]:
            registry.import_module(module)
        url = getattr(settings, "EVERYSTEP_DATABASE_URL", None) or database_url(options["database"])
        name = options["name"] or f"{socket.gethostname()}-{os.getpid()}"
        worker = Worker(url, name, threads=options["threads"], async_slots=options["async_slots"])
        stop_on_signals(worker)
        freeze_what_is_loaded()
        worker.run()
