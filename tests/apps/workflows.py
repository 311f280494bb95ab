"""Workflows that worker and supervisor processes under test import.

Each step appends a line `<run id> <tag> <pid>` to `<marks>/steps`, so a test
can count real executions across processes. `wait_for_file` lets a test hold
a step mid-execution until it releases it (or kills the process)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path

import everystep
from everystep import step, workflow


def mark(marks: str, tag: str) -> None:
    line = f"{everystep.current().workflow_id} {tag} {os.getpid()}\n"
    with open(Path(marks) / "steps", "a") as f:
        f.write(line)


def marks_of(marks: str | Path) -> list[tuple[str, str, int]]:
    path = Path(marks) / "steps"
    if not path.exists():
        return []
    return [(run, tag, int(pid)) for run, tag, pid in (line.split() for line in path.read_text().splitlines())]


@step
def work(marks: str, tag: str, seconds: float = 0.0) -> str:
    mark(marks, tag)
    if seconds:
        time.sleep(seconds)
    mark(marks, tag + ":end")
    return tag


@step
def hold_first_time(marks: str, tag: str, release: str) -> str:
    """Block on the first execution until `release` exists; later executions pass."""
    first = sum(1 for m in marks_of(marks) if m[0] == str(everystep.current().workflow_id) and m[1] == tag) == 0
    mark(marks, tag)
    while first and not os.path.exists(release):
        time.sleep(0.02)
    mark(marks, tag + ":end")
    return tag


@step
def hold(marks: str, tag: str, release: str) -> str:
    """Block on every execution until `release` exists."""
    mark(marks, tag)
    while not os.path.exists(release):
        time.sleep(0.02)
    return tag


@step
def hold_until(marks: str, tag: str, release: str) -> str:
    """Mark the start, block until `release` exists, mark the end: two
    executions at once show as two starts before an end."""
    mark(marks, tag)
    while not os.path.exists(release):
        time.sleep(0.02)
    mark(marks, tag + ":end")
    return tag


@step(unsafe_to_repeat=True)
def unsafe_effect(marks: str, release: str) -> str:
    mark(marks, "effect")
    while not os.path.exists(release):
        time.sleep(0.02)
    return "effect done"


@step
def kill_my_process(marks: str) -> None:
    mark(marks, "poison")
    os.kill(os.getpid(), signal.SIGKILL)


@step
def thread_name(release: str | None) -> str:
    """The name of the thread it runs on, once `release` exists (None: at once)."""
    while release is not None and not os.path.exists(release):
        time.sleep(0.02)
    return threading.current_thread().name


@workflow
def on_which_thread(release: str | None = None) -> str:
    return thread_name(release)


@workflow
def collector_settings() -> dict:
    """How the garbage collector of the process that runs it is set."""
    return {"threshold": list(gc.get_threshold()), "frozen": gc.get_freeze_count()}


@workflow
def two_steps(marks: str) -> str:
    work(marks, "a")
    work(marks, "b")
    return "ok"


@step(write_behind=True)
def work_behind(marks: str, tag: str) -> str:
    mark(marks, tag)
    mark(marks, tag + ":end")
    return tag


@workflow
def two_steps_behind(marks: str) -> str:
    work_behind(marks, "a")
    work_behind(marks, "b")
    return "ok"


@workflow
def behind_then_held(marks: str, release: str) -> list:
    return [work_behind(marks, "one"), hold_first_time(marks, "two", release), work(marks, "three")]


@workflow
def three_steps_held(marks: str, release: str) -> list:
    return [work(marks, "one"), hold_first_time(marks, "two", release), work(marks, "three")]


@workflow
def held(marks: str, release: str) -> str:
    return hold(marks, "held", release)


@workflow
def timed_steps(marks: str, count: int, seconds: float) -> int:
    for i in range(count):
        work(marks, f"s{i}", seconds)
    return count


@workflow
def unsafe_then_done(marks: str, release: str) -> str:
    return unsafe_effect(marks, release)


@workflow
def poison(marks: str) -> None:
    kill_my_process(marks)


@workflow
def quick(marks: str) -> str:
    return work(marks, "q")


@step
def exit_the_process(marks: str) -> None:
    mark(marks, "exit")
    raise SystemExit(3)


@workflow
def exits(marks: str) -> None:
    exit_the_process(marks)


@workflow
def held_once(marks: str, release: str) -> str:
    return hold_until(marks, "held", release)


@workflow
def held_then_quick(marks: str, release: str) -> list:
    return [hold_until(marks, "held", release), work(marks, "after")]


@workflow
def recorded_then_held(marks: str, release: str) -> list:
    return [work(marks, "one"), hold_until(marks, "held", release), work(marks, "after")]


@workflow
def held_then_unsafe(marks: str, release: str) -> list:
    return [hold_until(marks, "held", release), unsafe_effect(marks, release)]
