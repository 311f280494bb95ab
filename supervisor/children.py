"""What each kind of supervised child runs, after the fork.

Every child builds its own database connections (nothing is inherited across
the fork), asks the kernel for SIGTERM when the supervisor dies, reports on
its status pipe, one line per message, once it has booted (`B`), when it
first claims work (`C`), for a worker when it takes (`L`) or loses (`U`) the
lock of its name, and for the HTTP child the port it bound (`P9117`), and
leaves with os._exit so nothing of the parent's runs at its exit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg
from setproctitle import setproctitle

from everystep import liveness, logs, observe
from everystep.errors import DatabaseRefused
from everystep.logs import first_line
from everystep.signals import stop_on_signals

log = logging.getLogger("everystep.supervisor")

BOOTED = b"B"
CLAIMED = b"C"
LOCKED = b"L"
UNLOCKED = b"U"
PORT = b"P"  # followed by the port number
EXIT_BOOT_FAILED = 3  # the child could not start (see the arbiter for what it does then)
EXIT_REFUSED = 4  # the child refused the database (a newer schema, no such database): the supervisor stops
_PR_SET_PDEATHSIG = 1
# The signals the supervisor handles: blocked around the fork, back to their
# defaults in the child (see `_after_fork`).
SUPERVISOR_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGCHLD,
                      signal.SIGTTIN, signal.SIGTTOU)


@dataclass(frozen=True)
class ChildSpec:
    role: str  # worker, http, maintenance, setup
    name: str  # the runner name of a worker; the role otherwise
    database_url: str
    runtime_dir: str
    direct_url: str = ""  # database.direct_url: the workers' pools use database_url (PgBouncer)

    @property
    def session_url(self) -> str:
        """The URL for what needs a session of its own (locks, LISTEN, psycopg's prepared statements)."""
        return self.direct_url or self.database_url


def run_child(spec: ChildSpec, config, status_fd: int, parent_pid: int) -> None:
    """The body of a forked child. Never returns. A child that fails before
    it reports booted exits with EXIT_BOOT_FAILED."""
    status = _Status(status_fd)
    code = 0
    try:
        _after_fork(spec, parent_pid, config)
        {"worker": _worker, "http": _http, "maintenance": _maintenance, "setup": _setup, "ui": _ui}[spec.role](
            spec, config, status
        )
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except DatabaseRefused as exc:
        log.error("%s %s: %s", spec.role, spec.name, exc)  # one line: no traceback to read
        code = EXIT_REFUSED
    except BaseException:
        log.exception("%s %s %s", spec.role, spec.name, "failed" if status.was_booted else "could not boot")
        code = 1 if status.was_booted else EXIT_BOOT_FAILED
    finally:
        observe.shutdown()  # the spans and reports still buffered: os._exit skips exit handlers
        logging.shutdown()
        os._exit(code)


class _Status:
    """The child's end of its status pipe to the supervisor."""

    def __init__(self, fd: int):
        self.fd = fd
        self.was_booted = False
        self.claimed = False

    def booted(self) -> None:
        self.was_booted = True
        self._send(BOOTED)

    def claimed_work(self, _count: int = 0) -> None:
        if not self.claimed:
            self.claimed = True
            self._send(CLAIMED)

    def lock(self, held: bool) -> None:
        self._send(LOCKED if held else UNLOCKED)

    def port(self, port: int) -> None:
        self._send(PORT + str(port).encode())

    def _send(self, message: bytes) -> None:
        try:
            os.write(self.fd, message + b"\n")  # one write: a line never interleaves with another
        except BrokenPipeError:
            pass  # the supervisor is gone: this child is on its way out (SIGTERM), nobody to tell


def _after_fork(spec: ChildSpec, parent_pid: int, config) -> None:
    # The parent's signal handling is not ours: back to the defaults. The
    # parent forked with its signals blocked, so one sent meanwhile (a TERM
    # right after the fork) waits, and takes effect when they are unblocked
    # at the end of this function.
    signal.set_wakeup_fd(-1)
    for sig in SUPERVISOR_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    # Exit with the supervisor: SIGTERM (a drain) when it dies, however it dies.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(0)
    logs.configure(format=config.logging.format)
    observe.setup(config.tracing.enabled, config.sentry.enabled)  # after the fork: their threads are per process
    setproctitle(f"everystep: {spec.role} {spec.name}" if spec.role != spec.name else f"everystep: {spec.role}")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SUPERVISOR_SIGNALS)


# ---------------------------------------------------------------- the children


def _worker(spec: ChildSpec, config, status: _Status) -> None:
    from everystep import metrics  # noqa: PLC0415
    from everystep.config import worker_options  # noqa: PLC0415
    from everystep.worker import Worker, freeze_what_is_loaded  # noqa: PLC0415

    worker = Worker(
        spec.database_url, spec.name, **worker_options(config), on_claim=status.claimed_work,
        on_load=lambda inflight, threads: setproctitle(f"everystep: worker {spec.name} [{inflight}/{threads}]"),
        on_lock=status.lock, direct_url=spec.direct_url or None,
        allow_newer_schema=config.database.allow_newer_schema,
    )
    metrics.declare_runner(spec.name)
    stop_on_signals(worker)
    freeze_what_is_loaded()
    status.booted()
    worker.run()


def _http(spec: ChildSpec, config, status: _Status) -> None:
    from supervisor import http_server  # noqa: PLC0415  (the arbiter serves nothing)

    def bound(port: int) -> None:  # a port in use is a boot failure
        status.port(port)
        status.booted()

    http_server.serve(config.http.bind, config.http.port, spec.session_url, Path(spec.runtime_dir),
                      Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]), on_ready=bound)


def _ui(spec: ChildSpec, config, status: _Status) -> None:
    """The operators' web UI on its own port (`ui:`); SIGTERM stops it."""
    from everystep.ui import server  # noqa: PLC0415
    from everystep.ui.core import Credentials  # noqa: PLC0415

    ui = config.ui
    sock = server.bind(ui.bind, ui.port)  # a port in use is a boot failure
    status.booted()
    server.serve(sock, spec.database_url, Credentials.from_config(ui))


def _maintenance(spec: ChildSpec, config, status: _Status) -> None:
    from everystep.config import maintenance_options  # noqa: PLC0415
    from everystep.maintenance import Maintenance  # noqa: PLC0415

    maintenance = Maintenance(spec.session_url, **maintenance_options(config))
    stop_on_signals(maintenance)
    status.booted()
    maintenance.run()


def _setup(spec: ChildSpec, config, status: _Status) -> None:
    """Before the workers start: apply the migrations (`migrate: true`) and
    the schedules of the config, waiting for the database as long as it takes."""
    from everystep import db, scheduler  # noqa: PLC0415
    from everystep.maintenance import Outage  # noqa: PLC0415

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, lambda *_: os._exit(0))
    status.booted()
    outage = Outage("setup", first_wait=0.5)
    while True:
        try:
            with psycopg.connect(spec.session_url, **liveness.connection_kwargs("everystep setup")) as conn:
                if config.migrate:
                    applied = db.migrate(conn, config.database.allow_newer_schema)
                    log.info("migrations: %s", f"applied {', '.join(applied)}" if applied else "up to date")
                if config.schedules:
                    for entry in scheduler.apply(conn, config.schedules).entries:
                        if entry.action != "unchanged":
                            log.info("schedule %s: %s", entry.key, entry.action.replace("_", " "))
            outage.over()
            return
        except psycopg.OperationalError as exc:
            time.sleep(outage.failed(exc))
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.InvalidSchemaName) as exc:
            # A role without the grants (no USAGE on the schema: none to create in).
            raise DatabaseRefused(f"the database refuses the setup: {first_line(exc)} (migrations need the role "
                                  "that owns the tables; a role with only the grants of `everystep roles` needs "
                                  "migrate: false)") from None
