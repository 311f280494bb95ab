"""An async graph member of tests/test_dags_async.py (apart from
dag_workflows.py: a worker that imports an async workflow takes more runs
at once than its threads, which tests/test_dags_workers.py counts on)."""

from __future__ import annotations

import everystep
from everystep import dags


@everystep.workflow
async def acombine(*keys):
    """dag_workflows.combine as an async member: `await dags.upstream(key)`."""
    return {key: await dags.upstream(key) for key in keys}
