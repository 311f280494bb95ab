"""The state file: what the arbiter tells the HTTP child.

The arbiter holds no database connection and serves nothing; it tells the HTTP
child which processes should be alive, and which workers said they hold their
lock, through a small JSON file in the runtime folder, replaced atomically
whenever that changes (`write_state`). The HTTP child (supervisor.http_server)
reads it on every health and readiness probe. The file also holds the port
the HTTP child bound, for whoever runs the supervisor with `http.port: 0`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

STATE_FILE = "supervisor-state.json"
ROLES = ("worker", "http", "maintenance", "ui")


class Child(NamedTuple):
    role: str  # worker, http or maintenance
    name: str
    pid: int


class SupervisorState(NamedTuple):
    supervisor_pid: int
    children: list[Child]
    expected_workers: list[str]  # runner names that should hold their lock
    locked_workers: list[str]  # runner names whose worker child reported holding its lock
    http_port: int | None = None  # the port the HTTP child bound; None while it is not serving


def write_state(
    runtime_dir: str | os.PathLike,
    supervisor_pid: int,
    children: list[tuple[str, str, int]],
    expected_workers: list[str],
    locked_workers: list[str],
    http_port: int | None = None,
) -> None:
    """Replace the state file: the supervisor's pid, its live children as
    (role, name, pid), the worker names it expects to run, those whose
    worker child said it holds its lock, and the port the HTTP child bound."""
    for role, name, _ in children:
        if role not in ROLES:
            raise ValueError(f"child {name!r}: role {role!r} is not one of {', '.join(ROLES)}")
    document = {
        "supervisor_pid": supervisor_pid,
        "children": [{"role": role, "name": name, "pid": pid} for role, name, pid in children],
        "expected_workers": list(expected_workers),
        "locked_workers": list(locked_workers),
        "http_port": http_port,
    }
    folder = Path(runtime_dir)
    aside = folder / f".{STATE_FILE}.{os.getpid()}.tmp"
    aside.write_text(json.dumps(document, indent=1))
    os.replace(aside, folder / STATE_FILE)  # readers see the old file or the new one, never half of one


def read_state(runtime_dir: str | os.PathLike) -> SupervisorState | None:
    """The state the arbiter last wrote; None before it wrote any."""
    try:
        document = json.loads((Path(runtime_dir) / STATE_FILE).read_text())
    except FileNotFoundError:
        return None
    return SupervisorState(
        supervisor_pid=int(document["supervisor_pid"]),
        children=[Child(c["role"], c["name"], int(c["pid"])) for c in document["children"]],
        expected_workers=[str(name) for name in document["expected_workers"]],
        locked_workers=[str(name) for name in document["locked_workers"]],
        http_port=document.get("http_port"),
    )

