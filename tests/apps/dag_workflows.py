"""Workflows of tests/test_dags.py: graph members and follow-ups."""

from __future__ import annotations

import os
import time

import everystep
from everystep import dags


@everystep.step
def _value(value):
    return value


@everystep.workflow
def produce(value):
    return _value(value)


@everystep.step
def _boom(message):
    raise ValueError(message)


@everystep.workflow
def fail(message):
    return _boom(message)


@everystep.step
def _fail_unless_file(path):
    if not os.path.exists(path):
        raise ValueError(f"{path} missing")
    return "fixed"


@everystep.workflow
def fail_unless(path):
    """Fails until `path` exists: the cause an operator fixes before re-running it."""
    return _fail_unless_file(path)


@everystep.workflow
def combine(*keys):
    """The results of its dependencies, by key (dags.upstream)."""
    return {key: dags.upstream(key) for key in keys}


@everystep.step
def _append(path, text):
    with open(path, "a") as f:
        f.write(text + "\n")


@everystep.workflow
def mark(path, text):
    """Appends `text` to `path` (a line per execution of its step)."""
    _append(path, text)
    return text


@everystep.step
def _wait_file(path, timeout):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(path)


@everystep.workflow
def wait_file(path, timeout=30.0):
    """Completes once `path` exists (up to `timeout` seconds)."""
    return _wait_file(path, timeout)


@everystep.workflow
def noop():
    return None


@everystep.step(unsafe_to_repeat=True)
def _unsafe():
    return "effect"


@everystep.workflow
def unsafe_member():
    return _unsafe()
