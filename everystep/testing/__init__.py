"""Testing workflows the way they run: the real engine on a real PostgreSQL.

A pytest plugin (registered by the package: nothing to enable; or
`-p everystep.testing`) and the functions a test calls::

    from everystep.testing import advance, assert_ended, drain

    def test_trial(everystep_db):
        with everystep.transaction(everystep_db):
            run = everystep.schedule(trial, 7)
        drain()                                   # the welcome step runs, the run sleeps 14 days
        advance(everystep_db, 14 * 24 * 3600)     # ... and 14 days pass, in milliseconds
        assert_ended(run.id, "completed")

Fixtures (each acts only when a test asks for it): `everystep_db`, a
connection (autocommit) to a schema of the test's own, migrated, dropped
after the test; `everystep_worker`, a worker on threads of the test's
process, drained and stopped after the test; `everystep_settings`, what they
use — `database_url` (the server the schemas go on; default: found as the
package's own tests find it) and `imports` (modules to import first) —, set
with `@pytest.mark.everystep(database_url=..., imports=[...])` or by
overriding the fixture.

The functions:

- drain(conn=None, *, timeout=10, scheduled=True, recursive=True): every
  runnable run through the real claim, replay and commit code until none is
  left; returns the counts by end status (everystep.testing.draining)
- advance(conn, seconds), now(conn), freeze(conn, at=None), reset_clock(conn):
  time travel on the engine's clock (everystep.testing.clock)
- scheduled_runs, assert_scheduled, assert_not_scheduled, assert_ended,
  step_result, messages_sent (everystep.testing.asserts)
- crash_after_step, crash_before_effect: fault injection (everystep.testing.crashes)
- replay(history, imports=()): the replay check of `everystep replay-check`
  (everystep.history)

Importing it connects to nothing and starts nothing.
"""

from __future__ import annotations

from everystep.history import ReplayReport, replay
from everystep.testing.asserts import (
    Message,
    Run,
    assert_ended,
    assert_not_scheduled,
    assert_scheduled,
    messages_sent,
    scheduled_runs,
    step_result,
)
from everystep.testing.clock import advance, freeze, now, reset_clock
from everystep.testing.crashes import crash_after_step, crash_before_effect
from everystep.testing.draining import Drained, DrainTimeout, drain
from everystep.testing.server import Settings
from everystep.testing.workers import BackgroundWorker

__all__ = [
    "BackgroundWorker", "DrainTimeout", "Drained", "Message", "ReplayReport", "Run", "Settings", "advance",
    "assert_ended", "assert_not_scheduled", "assert_scheduled", "crash_after_step", "crash_before_effect",
    "drain", "freeze", "messages_sent", "now", "replay", "reset_clock", "scheduled_runs", "step_result",
]

try:
    import pytest
except ImportError:  # the functions work without pytest; the fixtures need it
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    from everystep.testing.plugin import (  # noqa: F401  (the plugin's hook and fixtures, found here by pytest)
        everystep_db,
        everystep_settings,
        everystep_worker,
        pytest_configure,
    )
