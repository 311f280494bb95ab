"""Workflows for the CLI tests. The CLI runs as a subprocess and imports them
as `tests.apps.cli_workflows`; the tests execute them in-process."""

from __future__ import annotations

import collections

from everystep import StepFailure, Terminal, step, workflow

calls: collections.Counter = collections.Counter()


class Crash(BaseException):
    """Stands for the worker dying mid-step: not recorded, leaves the run claimed."""


class Declined(Exception):
    pass


@step
def shout(name):
    return name.upper()


@workflow
def greet(name):
    return f"hello {shout(name)}"


@workflow
def describe(*values):
    """The type of each argument, to show how the CLI decoded them."""
    return [type(value).__name__ for value in values]


@step
def decline(amount):
    raise Declined(f"declined {amount}")


@workflow
def fails(amount):
    decline(amount)


@step
def hand_off(order):
    raise Terminal("handed to a human", {"order": order})


@workflow
def stops(order):
    hand_off(order)


@step(unsafe_to_repeat=True)
def send_money(amount):
    calls["send_money"] += 1
    if calls["send_money"] == 1:
        raise Crash()
    return f"sent {amount}"


@workflow
def pays(amount):
    try:
        return send_money(amount)
    except StepFailure as exc:
        return f"failed: {exc}"


def not_a_workflow():
    return "plain"
