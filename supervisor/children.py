"""What each kind of supervised child runs, after the fork.

Every child builds its own database connections (nothing is inherited across
the fork), asks the kernel for SIGTERM when the supervisor dies, reports on
its status pipe once it has booted (`B`) and when it first claims work (`C`),
and leaves with os._exit so nothing of the parent's runs at its exit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from setproctitle import setproctitle

from everystep import logs

log = logging.getLogger("everystep.supervisor")

BOOTED = b"B"
CLAIMED = b"C"
EXIT_BOOT_FAILED = 3  # the child could not start; the supervisor gives up rather than crash-loop
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildSpec:
    role: str  # worker, http, maintenance, migrate
    name: str  # the runner name of a worker; the role otherwise
    database_url: str
    runtime_dir: str


def run_child(spec: ChildSpec, config, status_fd: int, parent_pid: int) -> None:
    """The body of a forked child. Never returns."""
    code = 0
    try:
        try:
            _after_fork(spec, parent_pid)
            target = {"worker": _worker, "http": _http, "maintenance": _maintenance, "migrate": _migrate}[spec.role]
        except BaseException:
            log.exception("%s %s could not boot", spec.role, spec.name)
            code = EXIT_BOOT_FAILED
        else:
            target(spec, config, _Status(status_fd))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        log.exception("%s %s failed", spec.role, spec.name)
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


class _Status:
    """The child's end of its status pipe to the supervisor."""

    def __init__(self, fd: int):
        self.fd = fd
        self.claimed = False

    def booted(self) -> None:
        os.write(self.fd, BOOTED)

    def claimed_work(self, _count: int = 0) -> None:
        if not self.claimed:
            self.claimed = True
            os.write(self.fd, CLAIMED)


def _after_fork(spec: ChildSpec, parent_pid: int) -> None:
    # The parent's signal handling is not ours: back to the defaults.
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGCHLD,
                signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_DFL)
    # Exit with the supervisor: SIGTERM (a drain) when it dies, however it dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(0)
    logs.configure()
    setproctitle(f"everystep: {spec.role} {spec.name}" if spec.role != spec.name else f"everystep: {spec.role}")


def _stop_on(signals: tuple, stop) -> None:
    for sig in signals:
        signal.signal(sig, lambda *_: stop())


# ---------------------------------------------------------------- the children


def _worker(spec: ChildSpec, config, status: _Status) -> None:
    from everystep.worker import Worker  # noqa: PLC0415

    workers = config.workers
    worker = Worker(
        spec.database_url, spec.name, threads=workers.threads, poll=workers.poll, drain=workers.drain,
        grace=config.recovery.grace, max_crashes=config.recovery.max_crashes, on_claim=status.claimed_work,
        on_load=lambda inflight, threads: setproctitle(f"everystep: worker {spec.name} [{inflight}/{threads}]"),
    )
    _stop_on((signal.SIGTERM, signal.SIGINT), worker.stop)
    signal.signal(signal.SIGQUIT, lambda *_: worker.stop(fast=True))
    status.booted()
    worker.run()


def _http(spec: ChildSpec, config, status: _Status) -> None:
    from supervisor import http  # noqa: PLC0415

    status.booted()
    http.serve(  # returns on SIGTERM/SIGINTconfig.http.bind, config.http.port, spec.database_url, Path(spec.runtime_dir),
               Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]))


def _maintenance(spec: ChildSpec, config, status: _Status) -> None:
    """The dead-claimer sweep (and the recurring schedules), every few seconds."""
    from everystep.liveness import DeadClaimerSweep  # noqa: PLC0415

    stopped = threading.Event()
    _stop_on((signal.SIGTERM, signal.SIGINT, signal.SIGQUIT), stopped.set)
    status.booted()
    sweep = DeadClaimerSweep(config.recovery.grace, config.recovery.max_crashes)
    conn = None
    delay = config.recovery.interval
    while not stopped.is_set():
        try:
            if conn is None:
                conn = psycopg.connect(spec.database_url, autocommit=True, connect_timeout=5,
                                       application_name="everystep maintenance")
            sweep.sweep(conn)
            delay = sweep.next_probe_in(config.recovery.interval)
        except psycopg.OperationalError as exc:
            log.warning("maintenance: database unreachable (%s)", str(exc).strip().splitlines()[0])
            if conn is not None:
                conn.close()
            conn = None
            delay = min(config.recovery.interval, 2.0)
        stopped.wait(delay)


def _migrate(spec: ChildSpec, config, status: _Status) -> None:
    """Apply the migrations, waiting for the database as long as it takes."""
    from everystep import store  # noqa: PLC0415

    _stop_on((signal.SIGTERM, signal.SIGINT, signal.SIGQUIT), lambda: os._exit(0))
    status.booted()
    delay = 0.5
    while True:
        try:
            with psycopg.connect(spec.database_url, autocommit=True, connect_timeout=5,
                                 application_name="everystep migrate") as conn:
                applied = store.migrate(conn)
            log.info("migrations: %s", f"applied {', '.join(applied)}" if applied else "up to date")
            return
        except psycopg.OperationalError as exc:
            log.warning("migrate: database unreachable (%s); retrying in %.0f s",
                        str(exc).strip().splitlines()[0], delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
