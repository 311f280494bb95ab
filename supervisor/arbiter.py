"""The supervisor's parent process: fork, reap, restart, forward signals.

It stays single-threaded and holds no database connection. Everything that
talks to the database or serves HTTP is a supervised child: the workers
`<name>-0 .. <name>-(n-1)`, one HTTP child, one maintenance child (the
dead-claimer sweep and the recurring schedules), and at start a one-shot
setup child (migrations, the schedules of the config).

Signals: TERM/INT drain every child then exit 0; QUIT stops fast (workers
requeue at once); HUP re-reads the config and replaces the children, the
workers one at a time; TTIN/TTOU add or remove one worker; CHLD reaps (as
PID 1 in a container, whatever exits).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from setproctitle import setproctitle

from everystep import db, embedded, logs, registry, waits
from everystep.config import Config, ConfigError, check_workflows, load
from everystep.logs import first_line
from supervisor import metrics, metrics_dir, state_file
from supervisor.children import (
    BOOTED,
    CLAIMED,
    EXIT_BOOT_FAILED,
    EXIT_REFUSED,
    LOCKED,
    PORT,
    SUPERVISOR_SIGNALS,
    UNLOCKED,
    ChildSpec,
    run_child,
)

log = logging.getLogger("everystep.supervisor")

BACKOFF_FIRST = 0.5  # seconds before the second restart in a row; doubles from there
BACKOFF_CEILING = 30.0
STABLE_AFTER = 60.0  # a child that lived this long (or claimed work) was not crash-looping
KILL_AFTER_DRAIN = 10.0  # seconds past the drain before a child that will not exit is killed


class FatalError(Exception):
    """The supervisor cannot run; the message says why."""


@dataclass
class Slot:
    """A place for one child, kept across its restarts."""

    role: str
    name: str
    pid: int | None = None
    status_fd: int | None = None
    config: Config | None = None  # the config its child was started with
    started: float = 0.0
    booted: bool = False  # a child of this slot has booted, now or before
    claimed: bool = False
    locked: bool = False  # a worker that said it holds the lock of its name
    stopping: bool = False  # asked to exit: its exit is expected
    restart: bool = True  # start it again after it exits
    crashes: int = 0  # unexpected exits in a row
    start_at: float = 0.0  # monotonic time it may be started
    messages: bytes = field(default=b"", repr=False)  # the start of a status line not read whole yet


class Arbiter:
    def __init__(self, config: Config, runtime_dir: str):
        self.config = config
        self.runtime_dir = Path(runtime_dir)
        self.multiproc_dir = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
        self.slots: dict[str, Slot] = {}
        self.phase = "starting"  # starting (setup) -> running -> stopping
        self.fatal: str | None = None
        self.processes = config.workers.processes
        self.database_url = ""
        self.http_port: int | None = None  # the port the HTTP child bound
        self._stop_embedded = None
        self._kill_at: float | None = None
        self._replacing: Slot | None = None  # the worker a HUP's roll is replacing
        self._published: tuple | None = None  # the state last published, to publish only changes
        self._ui_exported = False

    # ---------------------------------------------------------------- life

    def run(self) -> int:
        logs.configure(format=self.config.logging.format)
        self._import_modules(self.config.imports)
        for warning in check_workflows(self.config):  # ConfigError: refused before anything starts
            log.warning("%s", warning)
        self.database_url = self._database_url()
        self._check_environment()
        self._install_signals()
        log.info("supervisor %s starting (pid %d, %d workers)", self.config.name, os.getpid(), self.processes)
        self._add("http", "http")
        if self.config.ui is not None:
            self._add("ui", "ui")  # the operators' web UI, on a port of its own
        if self.config.migrate or self.config.schedules:
            self._add("setup", "setup")  # the workers start once it is done
        else:
            self._start_workers()
        try:
            self._loop()
        finally:
            if self._stop_embedded:
                self._stop_embedded()
        if self.fatal:
            raise FatalError(self.fatal)
        log.info("supervisor %s stopped", self.config.name)
        return 0

    def _database_url(self) -> str:
        if self.config.database.url:
            return self.config.database.url
        try:
            url, self._stop_embedded = embedded.start()
        except embedded.EmbeddedError as exc:
            raise FatalError(str(exc)) from None
        return url

    def _check_environment(self) -> None:
        """With database.expected_environment, refuse (before any child
        starts, so before anything is written) a database that records
        another environment, or none."""
        expected = self.config.database.expected_environment
        if not expected:
            return
        try:
            with psycopg.connect(self.config.database.direct_url or self.database_url, autocommit=True,
                                 connect_timeout=10) as conn:
                recorded = db.recorded_environment(conn)
        except psycopg.Error as exc:
            raise FatalError(f"cannot read the database's environment: {first_line(exc)}") from None
        if recorded != expected:
            found = f"is {recorded!r}" if recorded else "records none (everystep migrate --environment NAME)"
            raise ConfigError(f"{self.config.path}: database.expected_environment: expects {expected!r}, but the "
                              f"database {found}: nothing started")

    def _import_modules(self, names: tuple[str, ...]) -> None:
        for module in names:
            try:
                registry.import_module(module)
            except Exception as exc:
                raise FatalError(f"cannot import workflow module {module}: {type(exc).__name__}: {exc}") from None

    def _start_workers(self) -> None:
        self.phase = "running"
        self._add("maintenance", "maintenance")
        for index in range(self.processes):
            self._add("worker", self._worker_name(index))

    def _worker_name(self, index: int) -> str:
        return f"{self.config.name}-{index}"

    def _add(self, role: str, name: str) -> Slot:
        slot = self.slots[name] = Slot(role, name)
        if role != "setup":
            metrics.CHILD_RESTARTS.labels(name)  # exported at 0 from the start: see everystep.metrics.declare_runner
        return slot

    # ---------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while True:
            self._roll()
            self._start_due()
            self._stop_the_rest()
            self._publish()
            if self.phase == "stopping" and not any(s.pid for s in self.slots.values()):
                return
            fds = [self._signal_r] + [s.status_fd for s in self.slots.values() if s.status_fd is not None]
            for fd in waits.readable(fds, self._next_timeout()):
                if fd == self._signal_r:
                    for signum in os.read(self._signal_r, 64):
                        self._on_signal(signum)
                else:
                    self._read_status(fd)
            self._reap()
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                for slot in self.slots.values():
                    if slot.pid:
                        log.warning("%s %s did not exit after the drain; killing it", slot.role, slot.name)
                        self._signal(slot, signal.SIGKILL)
                self._kill_at = None

    def _next_timeout(self) -> float:
        now = time.monotonic()
        waits = [1.0] + [s.start_at - now for s in self.slots.values() if self._startable(s)]
        return max(0.0, min(waits))

    def _startable(self, slot: Slot) -> bool:
        """Whether `slot` is to be started once its start_at has come."""
        return self.phase != "stopping" and slot.pid is None and slot.restart

    def _start_due(self) -> None:
        now = time.monotonic()
        for slot in list(self.slots.values()):
            if self._startable(slot) and slot.start_at <= now:
                self._spawn(slot)

    def _spawn(self, slot: Slot) -> None:
        read_fd, write_fd = os.pipe()
        spec = ChildSpec(slot.role, slot.name, self.database_url, str(self.runtime_dir),
                         direct_url=self.config.database.direct_url)
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        # Blocked across the fork: a signal sent to the child before it has
        # reset the handlers it inherits (no-ops here) would be lost. The child
        # unblocks them once its own are in place.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_SIGNALS)
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(read_fd)
            for fd in [self._signal_r, self._signal_w] + [s.status_fd for s in self.slots.values() if s.status_fd]:
                os.close(fd)
            run_child(spec, self.config, write_fd, parent)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        slot.pid, slot.status_fd, slot.started, slot.config = pid, read_fd, time.monotonic(), self.config
        slot.claimed = slot.locked = slot.stopping = False
        slot.messages = b""
        log.info("started %s %s (pid %d)", slot.role, slot.name, pid)

    def _read_status(self, fd: int) -> None:
        slot = next((s for s in self.slots.values() if s.status_fd == fd), None)
        if slot is None:
            return
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        *lines, slot.messages = (slot.messages + data).split(b"\n")
        for line in lines:
            kind = line[:1]
            if kind == BOOTED:
                slot.booted = True
            elif kind == CLAIMED:
                slot.claimed = True
                slot.crashes = 0  # it works: the back-off starts over
            elif kind in (LOCKED, UNLOCKED):
                slot.locked = kind == LOCKED
            elif kind == PORT:
                self.http_port = int(line[1:])

    # ---------------------------------------------------------------- exits

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = next((s for s in self.slots.values() if s.pid == pid), None)
            if slot is None:
                continue  # not ours (as PID 1, orphans are re-parented to us)
            self._exited(slot, status)

    def _exited(self, slot: Slot, status: int) -> None:
        metrics_dir.mark_dead(self.multiproc_dir, slot.pid)
        if slot.status_fd is not None:
            try:
                self._read_status(slot.status_fd)  # a last message may be waiting
            finally:
                os.close(slot.status_fd)
        cause = _describe(status)
        uptime = time.monotonic() - slot.started
        pid, slot.pid, slot.status_fd, slot.locked = slot.pid, None, None, False
        if slot.role == "http":
            self.http_port = None
        expected = slot.stopping or self.phase == "stopping"
        if slot.role == "setup":
            self._set_up(slot, status, cause)
            return
        if not expected and os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_REFUSED:
            # It refused the database (a newer schema): so would every restart.
            self._fail(f"{slot.role} {slot.name} refused the database (see its log line above); stopping")
            return
        boot_failed = not expected and os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_BOOT_FAILED
        if boot_failed and not slot.booted:
            # It never ran (at start, or a new slot): its code or its config
            # is broken, and restarting it in a loop would hide that.
            self._fail(f"{slot.role} {slot.name} could not boot (see its log above); not restarting it in a loop")
            return
        if expected:
            log.info("%s %s (pid %d) %s", slot.role, slot.name, pid, cause)
        elif boot_failed:
            # It ran before (a HUP changed its config: a port now taken, say):
            # keep the rest running, and try again with the crash back-off.
            log.error("%s %s (pid %d) could not boot (see its log above); trying again", slot.role, slot.name, pid)
        else:
            log.warning("%s %s (pid %d) %s unexpectedly after %.1f s", slot.role, slot.name, pid, cause, uptime)
        if not slot.restart:
            del self.slots[slot.name]
            return
        if expected:
            slot.start_at = time.monotonic()  # a roll (HUP): back at once, with the new config
            return
        if slot.claimed or uptime >= STABLE_AFTER:
            slot.crashes = 0
        slot.crashes += 1
        delay = 0.0 if slot.crashes == 1 else min(BACKOFF_CEILING, BACKOFF_FIRST * 2 ** (slot.crashes - 2))
        slot.start_at = time.monotonic() + delay
        metrics.CHILD_RESTARTS.labels(slot.name).inc()
        if delay:
            log.warning("%s %s: %d crashes in a row; restarting in %.1f s", slot.role, slot.name, slot.crashes, delay)

    def _set_up(self, slot: Slot, status: int, cause: str) -> None:
        del self.slots[slot.name]
        if self.phase != "starting":
            return
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            self._start_workers()
        else:
            self._fail(f"the setup (migrations, schedules) failed ({cause}); see the log above")

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        self.fatal = message
        self._stop(signal.SIGTERM, "the setup failed")

    # ---------------------------------------------------------------- signals

    def _install_signals(self) -> None:
        self._signal_r, self._signal_w = os.pipe()
        os.set_blocking(self._signal_r, False)
        os.set_blocking(self._signal_w, False)
        # The handlers do nothing: the wakeup fd carries the signal numbers to the loop.
        signal.set_wakeup_fd(self._signal_w, warn_on_full_buffer=False)
        for sig in SUPERVISOR_SIGNALS:
            signal.signal(sig, lambda *_: None)

    def _on_signal(self, signum: int) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            self._stop(signal.SIGQUIT if signum == signal.SIGQUIT else signal.SIGTERM, signal.Signals(signum).name)
        elif signum == signal.SIGHUP:
            self._reload()
        elif signum == signal.SIGTTIN:
            self._scale(self.processes + 1)
        elif signum == signal.SIGTTOU:
            self._scale(self.processes - 1)

    def _stop(self, how: int, cause: str) -> None:
        """Drain (TERM) or stop fast (QUIT): the workers first, then the rest
        once the workers are gone (see `_stop_the_rest`). `cause`: what the
        log names (the signal received: a Ctrl-C is SIGINT)."""
        first = self.phase != "stopping"
        self.phase = "stopping"
        log.info("%s: stopping %s", cause, "(draining workers)" if how == signal.SIGTERM else "fast")
        for slot in self.slots.values():
            if slot.role in ("worker", "setup"):
                self._signal(slot, how)
        if first and how == signal.SIGTERM and self.config.workers.drain > 0:
            self._kill_at = time.monotonic() + self.config.workers.drain + KILL_AFTER_DRAIN
        if how == signal.SIGQUIT:
            self._kill_at = time.monotonic() + KILL_AFTER_DRAIN

    def _signal(self, slot: Slot, sig: int) -> None:
        if slot.pid:
            slot.stopping = True
            try:
                os.kill(slot.pid, sig)
            except ProcessLookupError:
                pass

    def _scale(self, processes: int) -> None:
        if self.phase != "running":
            return
        if processes < 1:
            log.warning("TTOU: already at one worker")
            return
        self.processes = processes
        self._sync_workers()
        log.info("now %d workers", processes)

    def _sync_workers(self) -> None:
        """Make the worker slots `<name>-0 .. <name>-(processes-1)`: add the
        missing ones, drain and retire the others."""
        wanted = {self._worker_name(i) for i in range(self.processes)}
        for slot in list(self.slots.values()):
            if slot.role != "worker":
                continue
            if slot.name in wanted:
                slot.restart = True  # retired a moment ago and still draining: it comes back when it exits
            else:
                slot.restart = False
                if slot.pid:
                    self._signal(slot, signal.SIGTERM)
                else:
                    del self.slots[slot.name]
        for name in sorted(wanted - set(self.slots)):
            self._add("worker", name)

    def _reload(self) -> None:
        try:
            config = load(self.config.path)
            self._import_modules(tuple(m for m in config.imports if m not in self.config.imports))
            for warning in check_workflows(config):
                log.warning("HUP: %s", warning)
        except (ConfigError, FatalError) as exc:
            log.error("HUP: keeping the running config: %s", exc)
            return
        if config.database.url and config.database.url != self.database_url:
            self.database_url = config.database.url
        log.info("HUP: config reloaded; replacing the children, the workers one at a time")
        self.config = config
        if self.phase == "stopping":
            return
        self.processes = config.workers.processes
        for slot in self.slots.values():
            if slot.role in ("http", "maintenance", "ui"):
                slot.restart = slot.role != "ui" or config.ui is not None  # a ui: section removed: no UI
                self._signal(slot, signal.SIGTERM)  # each comes back with the new config when it exits
        if config.ui is not None and "ui" not in self.slots:
            self._add("ui", "ui")
        if self.phase == "running":  # else the workers start with the new config once the setup is done
            self._sync_workers()

    def _roll(self) -> None:
        """Replace the workers still running an older config (after a HUP) one
        at a time: the next one is told to drain only once the replacement of
        the previous one holds its lock, so a roll takes out one worker at most."""
        if self.phase != "running":
            return
        slot = self._replacing
        if slot is not None and self.slots.get(slot.name) is slot and slot.restart and not (
                slot.pid and not slot.stopping and slot.locked):
            return  # its replacement is not at work yet
        self._replacing = next((s for s in self.slots.values() if s.role == "worker" and s.pid and not s.stopping
                                and s.config is not self.config), None)
        if self._replacing is not None:
            log.info("HUP: replacing worker %s", self._replacing.name)
            self._signal(self._replacing, signal.SIGTERM)  # it comes back with the new config when it exits

    # ---------------------------------------------------------------- state

    def _stop_the_rest(self) -> None:
        """While stopping: once the workers are gone, the other children go."""
        if self.phase == "stopping" and not any(s.pid for s in self.slots.values() if s.role == "worker"):
            for slot in self.slots.values():
                if slot.pid and not slot.stopping:
                    self._signal(slot, signal.SIGTERM)

    def _publish(self) -> None:
        """The process title, the children gauge, and the state file the HTTP
        child reads for /healthz and /readyz."""
        live = [(s.role, s.name, s.pid) for s in self.slots.values() if s.pid]
        locked = sorted(s.name for s in self.slots.values() if s.role == "worker" and s.pid and s.locked)
        state = (self.phase, tuple(sorted(live)), tuple(locked), self.http_port)
        if state == self._published:
            return
        self._published = state
        workers = sum(1 for role, _, _ in live if role == "worker")
        setproctitle(f"everystep: supervisor {self.config.name} [{workers} workers]")
        # The ui role is exported once a UI was configured (0 after a HUP removes it).
        self._ui_exported = self._ui_exported or self.config.ui is not None
        for role in ("worker", "http", "maintenance") + (("ui",) if self._ui_exported else ()):
            metrics.CHILDREN.labels(role).set(sum(1 for r, _, _ in live if r == role))
        # Ready means every configured worker holds its lock: not yet during
        # the setup, no longer during a drain.
        expected = [self._worker_name(i) for i in range(self.processes)]
        state_file.write_state(self.runtime_dir, os.getpid(), [c for c in live if c[0] != "setup"], expected, locked,
                               self.http_port)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by signal {sig} ({signal.Signals(sig).name})"
    return f"exited with code {os.WEXITSTATUS(status)}"
