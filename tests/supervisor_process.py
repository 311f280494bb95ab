"""`everystep-supervisor` in a subprocess, with a config written by the test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.processes import ROOT, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> dict[int, str]:
    """Live child processes of `pid`: {pid: process title}."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            state = stat.rsplit(")", 1)[1].split()[0]
            if ppid == pid and state != "Z":
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return found


def config(url: str, name: str, **sections) -> dict:
    """A config for tests: fast polls and recovery, a free HTTP port."""
    document = {
        "database": {"url": url},
        "name": name,
        "imports": ["tests.workflows"],
        "workers": {"processes": 2, "threads": 4, "poll": 0.5, "drain": 10},
        "recovery": {"interval": 0.5, "grace": 1.5, "max_crashes": 3},
        "http": {"bind": "127.0.0.1", "port": free_port()},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(document.get(key), dict):
            document[key] = {**document[key], **value}
        else:
            document[key] = value
    return document


class SupervisorProcess:
    def __init__(self, document: dict, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.document = document
        self.config_path = folder / f"everystep-{document['name']}.yaml"
        self.write_config(document)
        self.log_path = folder / f"supervisor-{document['name']}-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "-c", str(self.config_path)], cwd=ROOT,
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.pid = self.proc.pid

    def write_config(self, document: dict) -> None:
        self.document = document
        self.config_path.write_text(yaml.safe_dump(document))

    @property
    def port(self) -> int:
        return self.document["http"]["port"]

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_logged(self, text: str, timeout: float = 30.0, count: int = 1) -> None:
        wait_for(lambda: self.output().count(text) >= count, timeout, what=f"{text!r} x{count} in the supervisor log")

    def workers(self) -> dict[str, int]:
        """{runner name: pid} of the live worker children."""
        found = {}
        for pid, title in children_of(self.pid).items():
            if title.startswith("everystep: worker "):
                found[title.split()[2]] = pid
        return found

    def wait_workers(self, names: set[str], timeout: float = 30.0) -> dict[str, int]:
        wait_for(lambda: set(self.workers()) == names, timeout, what=f"workers {sorted(names)}")
        return self.workers()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def kill_tree(self) -> None:
        """SIGKILL the supervisor and all its children at once (a lost pod)."""
        pids = [self.pid, *children_of(self.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill_tree()
        self.log.close()
