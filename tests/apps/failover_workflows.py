"""The failover tests' workload: orders of three steps, the second unsafe to
repeat (a card charged). Every execution of a step appends two lines to
`<marks>/steps` — `<run> <step> start <pid> <time>` before it works and
`<run> <step> end <pid> <time>` after — so a test counts executions, and sees
two executions of a run at once, outside the database."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

import everystep
from everystep import step, workflow


class Mark(NamedTuple):
    run: str
    step: str
    event: str  # start, end
    pid: int
    at: float  # epoch seconds


def _mark(marks: str, name: str, event: str) -> None:
    line = f"{everystep.current().workflow_id} {name} {event} {os.getpid()} {time.time():.6f}\n"
    with open(Path(marks) / "steps", "a") as f:  # one write of a short line: lines never interleave
        f.write(line)


def marks_of(marks: str | Path) -> list[Mark]:
    path = Path(marks) / "steps"
    if not path.exists():
        return []
    return [Mark(run, name, event, int(pid), float(at))
            for run, name, event, pid, at in (line.split() for line in path.read_text().splitlines())]


def _work(marks: str, name: str, seconds: float) -> str:
    _mark(marks, name, "start")
    time.sleep(seconds)
    _mark(marks, name, "end")
    return name


@step
def work(marks: str, name: str, seconds: float) -> str:
    return _work(marks, name, seconds)


@step(unsafe_to_repeat=True)
def charge(marks: str, seconds: float) -> str:
    return _work(marks, "charge", seconds)


@workflow
def order(marks: str, seconds: float) -> list:
    return [work(marks, "reserve", seconds), charge(marks, seconds), work(marks, "ship", seconds)]
