"""`everystep replay-check`: the runs of a history (`everystep runs
export`) replayed against the current code before a deploy, without
executing any step (everystep.history)."""

from __future__ import annotations

import argparse
from typing import Any

from everystep import history
from everystep.cli.common import EXIT_REFUSED, Add, CliError, import_modules, load_config, output_option, print_json


def add_commands(commands: Any, add: Add) -> None:
    check = add(commands, "replay-check", cmd_replay_check,
                "replay a history's runs against the current code without executing any step; exit status 1 "
                "if any diverges")
    check.add_argument("history", metavar="HISTORY", help="a file written by `everystep runs export`")
    check.add_argument("--imports", "--import", dest="imports", action="append", default=[], metavar="MODULE",
                       help="module defining the workflows (repeatable; -c FILE's imports too)")
    output_option(check)


def cmd_replay_check(args: argparse.Namespace) -> int:
    config = load_config(args.config) if getattr(args, "config", None) else None
    import_modules([*(config.imports if config else ()), *args.imports])
    try:
        recorded = history.load(args.history)
    except OSError as exc:
        raise CliError(f"cannot read {args.history}: {exc.strerror}") from None
    except ValueError as exc:
        raise CliError(f"{args.history}: {exc}") from None
    report = history.replay(recorded)
    if args.output == "json":
        print_json({"ok": report.ok, "runs": report.data()})
    else:
        print(report.text())
    return 0 if report.ok else EXIT_REFUSED
