"""`everystep-supervisor` in a subprocess, with a config written by the test."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import psycopg
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

import everystep
from supervisor import state_file
from tests.apps import workflows
from tests.support.processes import ROOT, wait_for


def process_state(pid: int) -> str | None:
    """The state of process `pid` (R, S, Z for a zombie...), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    return process_state(pid) not in (None, "Z")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time used so far by process `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


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
    """A config for tests: fast polls and recovery, any free HTTP port."""
    document = {
        "database": {"url": url},
        "name": name,
        "imports": ["tests.apps.workflows"],
        "workers": {"processes": 2, "threads": 4, "poll": 0.5, "drain": 10},
        "recovery": {"interval": 0.5, "grace": 1.5, "max_crashes": 3},
        "http": {"bind": "127.0.0.1", "port": 0},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(document.get(key), dict):
            document[key] = {**document[key], **value}
        else:
            document[key] = value
    return document


class SupervisorProcess:
    def __init__(self, document: dict, folder: Path, command: tuple = (sys.executable, "-m", "supervisor"),
                 cwd: Path = ROOT):
        folder.mkdir(parents=True, exist_ok=True)
        self.document = document
        self.config_path = folder / f"everystep-{document['name']}.yaml"
        self.write_config(document)
        started = time.monotonic_ns()
        self.log_path = folder / f"supervisor-{document['name']}-{started}.log"
        self.log = open(self.log_path, "w")
        # The supervisor's runtime folder (state file, metrics folder) goes in
        # here, where a test can look at it.
        self.tmp = folder / f"tmp-{document['name']}-{started}"
        self.tmp.mkdir()
        self.proc = subprocess.Popen(
            [*command, "-c", str(self.config_path)], cwd=cwd,
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.tmp)},
        )
        self.pid = self.proc.pid

    def write_config(self, document: dict) -> None:
        self.document = document
        self.config_path.write_text(yaml.safe_dump(document))

    @property
    def runtime_dir(self) -> Path:
        """The supervisor's runtime folder: its state file and metrics folder."""
        (folder,) = wait_for(lambda: list(self.tmp.glob("everystep-supervisor-*")), what="the runtime folder")
        return folder

    @property
    def port(self) -> int:
        """The port the HTTP child serves on now, as the supervisor's state file
        says (each HTTP child binds any free port: http.port is 0)."""
        return wait_for(lambda: (state := state_file.read_state(self.runtime_dir)) and state.http_port, timeout=30,
                        what="the port of the HTTP child")

    def output(self) -> str:
        return self.log_path.read_text()

    @property
    def metrics_folder(self) -> Path:
        """The multiprocess folder the supervisor made and its children write to."""
        return self.runtime_dir / "metrics"

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

    def kill_worker(self, name: str) -> int:
        """SIGKILL the worker child `name` and wait for the supervisor to start
        it again; returns the new pid."""
        old = self.workers()[name]
        os.kill(old, signal.SIGKILL)
        return wait_for(lambda: (pid := self.workers().get(name)) not in (None, old) and pid, timeout=30,
                        interval=0.005, what=f"{name} restarted after pid {old}")

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


def restart_workers(sup: SupervisorProcess, database_url: str, marks: str, restarts: int) -> None:
    """SIGKILL worker children of `sup` `restarts` times, each time the one
    that has just completed a run: a child that claimed work is not
    crash-looping, so the supervisor restarts it at once, without back-off."""
    counted = _runs_counted(sup)
    with psycopg.connect(database_url, autocommit=True) as conn:
        for _ in range(restarts):
            with everystep.transaction(conn):
                run = everystep.schedule(workflows.quick, marks)
            name = wait_for(partial(_completed_by, conn, run.id), timeout=30, interval=0.005,
                            what=f"run {run.id} completed")
            executed_by = {pid for r, _, pid in workflows.marks_of(marks) if r == str(run.id)}
            pid = sup.workers()[name]
            assert executed_by == {pid}, executed_by
            # Its title shows no run in flight, and its metrics count the run:
            # its execution is over (the slot is free from the moment the
            # run's end is being written, the run counted once that commits).
            wait_for(partial(_idle, pid), timeout=30, interval=0.005, what=f"{name} idle after run {run.id}")
            counted += 1
            wait_for(lambda: _runs_counted(sup) >= counted, timeout=30, interval=0.005,  # noqa: B023 (called here)
                     what=f"run {run.id} counted in {name}'s metrics")
            sup.kill_worker(name)


def _runs_counted(sup: SupervisorProcess, timeout: float = 30.0) -> float:
    """The runs the supervisor's processes have counted (everystep_workflow_runs),
    read from its metrics folder as its HTTP child reads it (again while a
    file being created there cannot be read yet)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(sup.metrics_folder))
    deadline = time.monotonic() + timeout
    while True:
        try:
            return sum(sample.value for metric in registry.collect() if metric.name == "everystep_workflow_runs"
                       for sample in metric.samples if sample.name == "everystep_workflow_runs_total")
        except (OSError, struct.error):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _idle(pid: int) -> bool:
    """Whether a worker's process title shows no run in flight."""
    return "[0/" in Path(f"/proc/{pid}/cmdline").read_text()


def _completed_by(conn: psycopg.Connection, run_id) -> str | None:
    status, claimed_by = conn.execute("SELECT status, claimed_by FROM everystep_workflow WHERE id = %s",
                                      (run_id,)).fetchone()
    return claimed_by if status == "completed" else None
