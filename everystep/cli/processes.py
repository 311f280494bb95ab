"""The commands that run a process until a signal stops it: `everystep
worker`, `maintenance` and `ui`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from everystep.cli.common import (
    EXIT_REFUSED,
    Add,
    CliError,
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
                        help="module defining workflows (repeatable)")
    worker.add_argument("--workflows", action="append", type=_workflow_pattern, metavar="PATTERN",
                        help="run only the workflows whose name matches PATTERN ('*' any characters, '?' one); "
                             "repeat for several (default: every workflow)")
    worker.add_argument("--threads", type=whole_number_argument(1), default=8, help="runs in flight (default 8)")
    worker.add_argument("--poll", type=seconds_argument(zero=False), default=1.0,
                        help="seconds between polls (default 1)")
    worker.add_argument("--drain", type=seconds_argument(zero=True), default=30.0,
                        help="seconds to drain on TERM; 0 waits for ever")
    worker.add_argument("--grace", type=seconds_argument(zero=True), default=10.0,
                        help="seconds without its lock before the worker abandons its runs (default 10)")
    worker.add_argument("--max-crashes", type=whole_number_argument(1), default=3,
                        help="claims that die without progress before a run fails (default 3)")
    worker.add_argument("--direct-url", metavar="URL",
                        help="when the database URL goes through PgBouncer (transaction pooling): a URL straight to "
                        "PostgreSQL for the control session (default: -c FILE's database.direct_url)")
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
    """Run one worker in this process until TERM/INT (drain) or QUIT (fast stop)."""
    from everystep import logs  # noqa: PLC0415
    from everystep.signals import stop_on_signals  # noqa: PLC0415
    from everystep.worker import Worker  # noqa: PLC0415

    logs.configure(args.log_level)
    url = database_url(args)
    direct_url = args.direct_url
    if direct_url is None and getattr(args, "config", None):
        direct_url = load_config(args.config).database.direct_url or None
    import_modules(args.imports)
    worker = Worker(url, args.name, threads=args.threads, poll=args.poll, drain=args.drain, grace=args.grace,
                    max_crashes=args.max_crashes, workflows=args.workflows, direct_url=direct_url)
    stop_on_signals(worker)
    worker.run()
    sys.stdout.flush()
    # Steps still running past the drain deadline were requeued; do not wait for their threads.
    os._exit(0)



def cmd_maintenance(args: argparse.Namespace) -> int:
    """Run the dead-claimer sweep and the recurring schedules in this process
    until TERM, INT or QUIT. Options given win over -c FILE's recovery.*."""
    from everystep import logs  # noqa: PLC0415
    from everystep.config import RecoveryConfig  # noqa: PLC0415
    from everystep.maintenance import Maintenance  # noqa: PLC0415
    from everystep.signals import stop_on_signals  # noqa: PLC0415

    recovery, imports = RecoveryConfig(), list(args.imports)
    if getattr(args, "config", None):
        config = load_config(args.config)
        recovery, imports = config.recovery, [*config.imports, *args.imports]
    logs.configure(args.log_level)
    url = database_url(args)
    import_modules(imports)
    maintenance = Maintenance(
        url,
        interval=recovery.interval if args.interval is None else args.interval,
        grace=recovery.grace if args.grace is None else args.grace,
        max_crashes=recovery.max_crashes if args.max_crashes is None else args.max_crashes,
    )
    stop_on_signals(maintenance)
    log.info(
        "maintenance: the dead-claimer sweep every %g s (grace %g s), the recurring schedules every second",
        maintenance.interval, maintenance.sweep.grace)
    maintenance.run()
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    """Serve the operators' web UI in this process until TERM/INT."""
    from everystep import logs  # noqa: PLC0415
    from everystep.ui.core import Credentials, bind_problem  # noqa: PLC0415

    url = database_url(args)
    bind, port = args.bind, args.port
    viewer = os.environ.get("EVERYSTEP_UI_VIEWER_TOKEN", "")
    operator = os.environ.get("EVERYSTEP_UI_OPERATOR_TOKEN", "")
    if getattr(args, "config", None):
        from everystep.config import ConfigError, load  # noqa: PLC0415

        try:
            ui = load(args.config).ui
        except ConfigError as exc:
            raise CliError(str(exc)) from None
        if ui is not None:  # the file's ui: section, the command line's options first
            bind, port = bind or ui.bind, ui.port if port is None else port
            viewer, operator = ui.viewer_token or viewer, ui.operator_token or operator
    bind = bind or "127.0.0.1"
    problem = bind_problem(bind, viewer, operator, "set EVERYSTEP_UI_VIEWER_TOKEN and/or EVERYSTEP_UI_OPERATOR_TOKEN")
    if problem:
        raise CliError(problem)
    try:
        from everystep.ui import server  # noqa: PLC0415
    except ImportError as exc:
        raise CliError(f"the UI needs its libraries: pip install 'everystep[ui]' ({exc})") from None
    logs.configure(args.log_level)
    try:
        sock = server.bind(bind, 9118 if port is None else port)
    except OSError as exc:
        raise CliError(f"cannot listen on {bind}:{port}: {exc.strerror or exc}", EXIT_REFUSED) from None
    server.serve(sock, url, Credentials(viewer, operator))
    return 0

