"""The supervisor's own metrics, written by the parent process (which holds no
database connection) into the multiprocess folder the HTTP child serves."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

CHILD_RESTARTS = Counter(
    "everystep_supervisor_child_restarts", "Children restarted after an unexpected exit, by child name.", ["child"]
)
CHILDREN = Gauge(
    "everystep_supervisor_children", "Children alive, by role (worker, http, maintenance, ui).", ["role"],
    multiprocess_mode="livesum",
)
