"""The commands that run a process until a signal stops it: `everystep
worker`, `maintenance` and `ui`."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from everystep.cli.common import (
    EXIT_REFUSED,
    Add,
    CliError,
    allow_newer_schema,
    check_environment,
    database_url,
    import_modules,
    load_config,
    seconds_argument,
    whole_number_argument,
)
from everystep.schema import MAX_KEY

log = logging.getLogger("everystep")

MAX_RUNNER_NAME = MAX_KEY  # the width of claimed_by
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def add_commands(commands: Any, add: Add) -> None:
    worker = add(commands, "worker", cmd_worker, "run one worker in this process (the supervisor runs a pool of them)")
    worker.add_argument("--name", required=True, type=_runner_name,
                        help="runner name: the claimed_by of its runs; unique while alive")
    worker.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="module defining workflows (repeatable; -c FILE's imports too)")
    worker.add_argument("--workflows", action="append", type=_workflow_pattern, metavar="PATTERN",
                        help="run only the workflows whose name matches PATTERN ('*' any characters, '?' one); "
                             "repeat for several (default: workers.workflows of -c FILE, else every workflow)")
    worker.add_argument("--threads", type=whole_number_argument(1),
                        help="runs of sync workflows in flight, a thread each (default: workers.threads of -c FILE, "
                             "else 8)")
    worker.add_argument("--async-slots", type=whole_number_argument(1),
                        help="runs of async workflows in flight, on one event loop (default: workers.async_slots of "
                             "-c FILE, else 100)")
    worker.add_argument("--poll", type=seconds_argument(zero=False),
                        help="seconds between polls (default: workers.poll of -c FILE, else 1)")
    worker.add_argument("--drain", type=seconds_argument(zero=True),
                        help="seconds to drain on TERM; 0 waits for ever (default: workers.drain of -c FILE, else 30)")
    worker.add_argument("--grace", type=seconds_argument(zero=True),
                        help="seconds without its lock before the worker abandons its runs "
                             "(default: recovery.grace of -c FILE, else 10)")
    worker.add_argument("--max-crashes", type=whole_number_argument(1),
                        help="claims that die without progress before a run fails "
                             "(default: recovery.max_crashes of -c FILE, else 3)")
    worker.add_argument("--direct-url", metavar="URL",
                        help="when the database URL goes through PgBouncer (transaction pooling): a URL straight to "
                        "PostgreSQL for the control session (default: -c FILE's database.direct_url)")
    worker.add_argument("--allow-newer-schema", action="store_true",
                        help="run on a schema a newer everystep migrated, declaring it compatible "
                             "(config: database.allow_newer_schema)")
    worker.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)

    maintenance = add(commands, "maintenance", cmd_maintenance,
                      "recover the runs of dead workers and fire the recurring schedules, in this process")
    maintenance.add_argument("--interval", type=seconds_argument(zero=False), metavar="SECONDS",
                             help="seconds between dead-claimer sweeps (default: recovery.interval of -c FILE, else 5)")
    maintenance.add_argument("--grace", type=seconds_argument(zero=True), metavar="SECONDS",
                             help="seconds a claimer's lock must stay free before it is dead "
                                  "(default: recovery.grace of -c FILE, else 10)")
    maintenance.add_argument("--max-crashes", type=whole_number_argument(1), metavar="N",
                             help="claims that die without progress before a run fails "
                                  "(default: recovery.max_crashes of -c FILE, else 3)")
    maintenance.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                             help="module defining workflows (repeatable; -c FILE's imports too)")
    maintenance.add_argument("--direct-url", metavar="URL",
                             help="when the database URL goes through PgBouncer (transaction pooling): a URL "
                                  "straight to PostgreSQL for its session (default: -c FILE's database.direct_url)")
    maintenance.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)

    ui = add(commands, "ui", cmd_ui, "serve the operators' web UI (without a supervisor)")
    ui.add_argument("--bind", default=None, help="address to listen on (default 127.0.0.1, or the ui: section of -c)")
    ui.add_argument("--port", type=whole_number_argument(0, 65535), default=None,
                    help="port (default 9118; 0: any free port)")
    ui.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)


def _runner_name(text: str) -> str:
    if not 0 < len(text) <= MAX_RUNNER_NAME or not text.isprintable() or any(ch.isspace() for ch in text):
        raise argparse.ArgumentTypeError(
            f"expected 1 to {MAX_RUNNER_NAME} printable characters without whitespace, not {text!r}")
    return text



def _workflow_pattern(text: str) -> str:
    from everystep.config import WORKFLOW_PATTERN  # noqa: PLC0415

    if len(text) > 300 or not WORKFLOW_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a workflow name pattern like myapp.gpu.* (letters, digits, '_', '.', '*', '?')")
    return text


def cmd_worker(args: argparse.Namespace) -> int:
    """Run one worker in this process until TERM/INT (drain) or QUIT (fast stop).
    With -c FILE it runs as the supervisor's workers do; options given win."""
    from everystep.config import worker_options  # noqa: PLC0415
    from everystep.signals import stop_on_signals  # noqa: PLC0415
    from everystep.worker import Worker, freeze_what_is_loaded  # noqa: PLC0415

    config = _config(args)
    url = database_url(args)
    check_environment(args)
    direct_url = args.direct_url or (config.database.direct_url if config else None) or None
    options = _given(worker_options(config), args)
    with _supervised_as(args, config):
        from everystep.config import unmatched_patterns  # noqa: PLC0415

        for problem in unmatched_patterns(options["workflows"] or (),
                                          [*(config.imports if config else ()), *args.imports]):
            log.warning("worker %s: --workflows: %s", args.name, problem)
        worker = Worker(url, args.name, **options, direct_url=direct_url, allow_newer_schema=allow_newer_schema(args))
        stop_on_signals(worker)
        freeze_what_is_loaded()
        worker.run()
    sys.stdout.flush()
    # Steps still running past the drain deadline were requeued; do not wait for their threads.
    os._exit(0)


def cmd_maintenance(args: argparse.Namespace) -> int:
    """Run the dead-claimer sweep and the recurring schedules in this process
    until TERM, INT or QUIT. With -c FILE it runs as the supervisor's
    maintenance child does; options given win."""
    from everystep.config import maintenance_options  # noqa: PLC0415
    from everystep.maintenance import Maintenance  # noqa: PLC0415
    from everystep.signals import stop_on_signals  # noqa: PLC0415

    config = _config(args)
    # Its locks need a session: straight to PostgreSQL when database.url is a pooler's.
    url = args.direct_url or (config.database.direct_url if config else None) or database_url(args)
    check_environment(args)
    options = _given(maintenance_options(config), args)
    with _supervised_as(args, config):
        maintenance = Maintenance(url, **options)
        stop_on_signals(maintenance)
        log.info(
            "maintenance: the dead-claimer sweep every %g s (grace %g s), the recurring schedules every second",
            maintenance.interval, maintenance.sweep.grace)
        maintenance.run()
    return 0


def _config(args: argparse.Namespace) -> Any:
    """The config of -c FILE, None without one."""
    return load_config(args.config) if getattr(args, "config", None) else None


def _given(options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`options` (the file's, or the defaults), with those given on the command line instead."""
    given = {name: getattr(args, name, None) for name in options}
    return {name: value if given[name] is None else given[name] for name, value in options.items()}


@contextlib.contextmanager
def _supervised_as(args: argparse.Namespace, config: Any) -> Iterator[None]:
    """What the supervisor gives each child from the file, for a process
    started by hand: the log format, the imports (with --import's), traces
    and error reports; their buffers are flushed at the end."""
    from everystep import logs, observe  # noqa: PLC0415

    logs.configure(args.log_level, format=config.logging.format if config else "text")
    import_modules([*(config.imports if config else ()), *args.imports])
    if config is not None:
        observe.setup(config.tracing.enabled, config.sentry.enabled)
    try:
        yield
    finally:
        observe.shutdown()


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve the operators' web UI in this process until TERM/INT."""
    from everystep import logs  # noqa: PLC0415
    from everystep.ui.core import Credentials, bind_problem  # noqa: PLC0415

    url = database_url(args)
    check_environment(args)
    bind, port = args.bind, args.port
    viewer = os.environ.get("EVERYSTEP_UI_VIEWER_TOKEN", "")
    operator = os.environ.get("EVERYSTEP_UI_OPERATOR_TOKEN", "")
    config = _config(args)
    ui = config.ui if config is not None else None
    if ui is not None:  # the file's ui: section, the command line's options first
        bind, port = bind or ui.bind, ui.port if port is None else port
        viewer, operator = ui.viewer_token or viewer, ui.operator_token or operator
        credentials = Credentials(viewer, operator, ui.users, ui.trusted_user_header, ui.trusted_proxies,
                                  ui.trusted_user_role)
    else:
        credentials = Credentials(viewer, operator)
    bind = bind or "127.0.0.1"
    problem = bind_problem(bind, viewer, operator, "set EVERYSTEP_UI_VIEWER_TOKEN and/or EVERYSTEP_UI_OPERATOR_TOKEN",
                           others=bool(ui is not None and (ui.users or ui.trusted_user_header)))
    if problem:
        raise CliError(problem)
    try:
        from everystep.ui import server  # noqa: PLC0415
    except ImportError as exc:
        raise CliError(f"the UI needs its libraries: pip install 'everystep[ui]' ({exc})") from None
    logs.configure(args.log_level, format=config.logging.format if config else "text")
    try:
        sock = server.bind(bind, 9118 if port is None else port)
    except OSError as exc:
        raise CliError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}", EXIT_REFUSED) from None
    server.serve(sock, url, credentials)
    return 0

