"""Schedules a mix of workflows and runs them to their end in this process,
the way a worker would: python -m tests.apps.obs_workload SERVER_URL SCHEMA

Run with PROMETHEUS_MULTIPROC_DIR set, so the engine's metrics land in the
folder. Prints one JSON line: how many runs ended how."""

import collections
import json
import sys

import everystep
from tests.apps import obs_workflows
from tests.conftest import Database

ORDERS = [("o-1", 10), ("o-2", 25), ("o-3", -5), ("out-of-stock", 7), ("o-4", 3)]

if __name__ == "__main__":
    server_url, schema = sys.argv[1:]
    db = Database(server_url, schema)
    with db.connect() as conn, everystep.transaction(conn):
        for order, amount in ORDERS:
            everystep.schedule(obs_workflows.place_order, order, amount)
    ended = db.run_pending(runner="web-0-0")
    db.close()
    print(json.dumps(collections.Counter(ended.values())))
