"""`everystep-supervisor -c everystep.yaml`

Exit status: 0 after a clean stop (TERM, INT, QUIT); 1 when the supervisor
cannot run (a workflow module does not import, a child cannot boot at start,
the migrations fail, the embedded database does not start); 2 for a bad
config or command line.

Only the standard library is imported at module level: the Prometheus
multiprocess folder must be in the environment before prometheus_client (and
so everystep) is first imported, in this process and in every child.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

EXIT_FATAL = 1
EXIT_CONFIG = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="everystep-supervisor", description="Run everystep workers under a process manager.",
        epilog="The configuration keys: docs/running.md, section Configuration.",
    )
    parser.add_argument("-c", "--config", default="everystep.yaml", help="config file (default: everystep.yaml)")
    args = parser.parse_args(argv)

    # The private multiprocess folder, empty, in the environment before the
    # first import of prometheus_client here and in every child.
    runtime_dir = tempfile.mkdtemp(prefix="everystep-supervisor-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(runtime_dir, "metrics")
    from supervisor import metrics_dir  # noqa: PLC0415

    metrics_dir.prepare(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    try:
        return _run(args.config, runtime_dir)
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _run(config_path: str, runtime_dir: str) -> int:
    from everystep.config import ConfigError, load  # noqa: PLC0415

    try:
        config = load(config_path)
    except ConfigError as exc:
        print(f"everystep-supervisor: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    from supervisor.arbiter import Arbiter, FatalError  # noqa: PLC0415

    try:
        return Arbiter(config, runtime_dir).run()
    except ConfigError as exc:  # what the config names that the code does not have
        print(f"everystep-supervisor: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except FatalError as exc:
        print(f"everystep-supervisor: {exc}", file=sys.stderr)
        return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main())
