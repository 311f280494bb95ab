"""Sentry reports (the `sentry` extra). All of everystep's Sentry code is
here, and none of it imports sentry_sdk until Sentry is in use.

Reporting is on when the process has an active Sentry client: the
application's own (`sentry_sdk.init()` in its code), or the one `setup()`
makes for the supervisor's `sentry: {enabled: true}`.

A failed run is reported once, when its end is written (a run fails once,
whatever number of executions it took); a blocked run, as a warning saying
how to resolve it, each time it blocks.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

log = logging.getLogger("everystep")


def _sdk() -> Any:
    """The sentry_sdk module if a client is active, else None (imports nothing)."""
    sdk = sys.modules.get("sentry_sdk")
    if sdk is None or not sdk.get_client().is_active():
        return None
    return sdk


def enabled() -> bool:
    return _sdk() is not None


def _tag(scope: Any, run_id: Any, workflow: str, runner: str, step: str | None, attempt: int | None) -> None:
    scope.set_tag("everystep.workflow", workflow)
    scope.set_tag("everystep.runner", runner)
    scope.set_tag("everystep.step", step or "(workflow body)")
    scope.set_context("everystep run", {"run_id": str(run_id), "workflow": workflow, "runner": runner,
                                        "step": step, "execution": attempt})


def report_failed(run_id: Any, workflow: str, runner: str, step: str | None, exc: BaseException,
                  attempt: int | None) -> None:
    """The exception that failed a run, tagged with its workflow, the step it
    came from (if it came from one) and the runner."""
    sdk = _sdk()
    if sdk is None:
        return
    with sdk.new_scope() as scope:
        _tag(scope, run_id, workflow, runner, step, attempt)
        scope.capture_exception(exc)


def report_blocked(run_id: Any, workflow: str, runner: str, step_id: str | None, step: str | None,
                   attempt: int | None) -> None:
    """A blocked run: a warning with the command that resolves it."""
    sdk = _sdk()
    if sdk is None:
        return
    with sdk.new_scope() as scope:
        _tag(scope, run_id, workflow, runner, step, attempt)
        scope.fingerprint = ["everystep-blocked", workflow, step or ""]
        where = f"step {step_id} ({step})" if step_id else "a started step"
        scope.capture_message(
            f"everystep run {run_id} of {workflow} is blocked on {where}: an unsafe-to-repeat step was "
            f"interrupted and its effect is uncertain. Check whether it happened, then run "
            f"`everystep resolve-step {run_id} {step_id or 'STEP'} --result JSON` (it happened), "
            f"`--error MESSAGE` (it happened and failed) or `--discard` (it did not happen).",
            level="warning",
        )


def setup() -> None:
    """`sentry: {enabled: true}`: unless the application has set up Sentry,
    set it up from SENTRY_DSN (and SENTRY_ENVIRONMENT, SENTRY_RELEASE)."""
    import sentry_sdk  # noqa: PLC0415  (the sentry extra)

    if _sdk() is not None:
        log.info("sentry: using the application's Sentry setup")
        return
    if not os.environ.get("SENTRY_DSN"):
        log.warning("sentry: enabled, but SENTRY_DSN is not set: nothing is reported")
        return
    sentry_sdk.init()  # reads SENTRY_DSN, SENTRY_ENVIRONMENT, SENTRY_RELEASE


def shutdown() -> None:
    """Before a supervised child exits: send the events still queued."""
    sdk = _sdk()
    if sdk is not None:
        sdk.flush(timeout=2.0)
