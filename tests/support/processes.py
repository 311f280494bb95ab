"""Real processes under test: worker processes, and waiting on conditions."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def wait_for(predicate: Callable[[], object], timeout: float = 20.0, interval: float = 0.05, what: str = "") -> object:
    """Poll until `predicate()` is truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports that nobody listens on now."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def console_script(name: str) -> str:
    """The installed command `name` (everystep, everystep-supervisor) next to this Python."""
    script = Path(sys.executable).parent / name
    assert script.exists(), f"{script} is not installed: pip install -e . installs it"
    return str(script)


class WorkerProcess:
    """`everystep worker` in a subprocess, logging to a file. With `config`,
    it is given `-c config`; an option given as None is left out (the file's
    value, else the default, applies)."""

    def __init__(self, url: str | None, name: str, log_dir: Path, threads: int | None = 4, poll: float | None = 0.5,
                 drain: float | None = 10, grace: float | None = 2, max_crashes: int | None = 3,
                 imports: tuple = ("tests.apps.workflows",), workflows: tuple = (),
                 command: tuple = (sys.executable, "-m", "everystep.cli"), cwd: Path = ROOT,
                 direct_url: str | None = None, config: Path | None = None, async_slots: int | None = None):
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
        args = [*command, *(["--database-url", url] if url else []), *(["-c", str(config)] if config else []),
                "worker", "--name", name]
        options = {"--threads": threads, "--async-slots": async_slots, "--poll": poll, "--drain": drain,
                   "--grace": grace, "--max-crashes": max_crashes}
        args += [word for option, value in options.items() if value is not None for word in (option, str(value))]
        for module in imports:
            args += ["--import", module]
        for pattern in workflows:
            args += ["--workflows", pattern]
        if direct_url:
            args += ["--direct-url", direct_url]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.pid = self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_logged(self, text: str, timeout: float = 20.0) -> None:
        wait_for(lambda: text in self.output(), timeout, what=f"{text!r} in the log of {self.name}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.kill()
        self.log.close()
