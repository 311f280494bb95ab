"""Run by tests/test_django_tasks.py in a process of its own (Django's
settings are global): enqueue in and out of transaction.atomic(), results in
every state, a deferred and an async task, signals, the system check; the
runs executed in this process by a Runner, as a worker would."""

from __future__ import annotations

import datetime
import json
import os
import sys


def main(url: str) -> None:
    os.environ["EVERYSTEP_TEST_DJANGO_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.apps.django_tasks_settings"
    import django  # noqa: PLC0415

    django.setup()
    from asgiref.sync import async_to_sync  # noqa: PLC0415
    from django.core import checks  # noqa: PLC0415
    from django.db import connection, transaction  # noqa: PLC0415
    from django.utils import timezone  # noqa: PLC0415

    from everystep.django.tasks import idempotency_key, task_finished, task_started  # noqa: PLC0415
    from everystep.testing import server  # noqa: PLC0415
    from tests.apps import django_tasks as tasks  # noqa: PLC0415
    from tests.conftest import Database  # noqa: PLC0415

    out: dict = {"api": "django.tasks" if django.VERSION >= (6,) else "django_tasks"}
    seen = []
    task_started.connect(lambda sender, task_result, **kw: seen.append(("started", task_result.id)), weak=False)
    task_finished.connect(lambda sender, task_result, **kw: seen.append(("finished", task_result.id,
                                                                         str(task_result.status))), weak=False)

    def raising(**kwargs):
        raise RuntimeError("a receiver that raises")

    task_finished.connect(raising, weak=False)

    with connection.cursor() as cur:
        cur.execute("CREATE TABLE orders (id int)")
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("INSERT INTO orders VALUES (1)")
        committed = tasks.add.enqueue(2, b=3)
    try:
        with transaction.atomic():
            with connection.cursor() as cur:
                cur.execute("INSERT INTO orders VALUES (2)")
            tasks.add.enqueue(100)
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM everystep_workflow")
        out["runs_after_atomic"] = cur.fetchone()[0]
        cur.execute("SELECT id FROM orders")
        out["orders"] = [row[0] for row in cur.fetchall()]
    out["enqueued"] = [committed.id, str(committed.status)]
    out["ready"] = str(tasks.add.get_result(committed.id).status)

    failing = tasks.fails.enqueue("boom")
    later = tasks.add.using(run_after=timezone.now() + datetime.timedelta(hours=1)).enqueue(1)
    out["deferred"] = str(tasks.add.get_result(later.id).status)
    asynchronous = async_to_sync(tasks.add_later.aenqueue)(4, 5)
    durable = tasks.durable.enqueue(10)
    flaky = tasks.flaky.enqueue([1])
    contextual = tasks.with_context.enqueue(7)
    with idempotency_key("once"):
        first, again = tasks.add.enqueue(1, 1), tasks.add.enqueue(1, 1)
    out["keyed"] = first.id == again.id

    database = Database.__new__(Database)  # on this URL as it is (its schema first on the search path)
    server.Database.__init__(database, url, schema="")
    try:
        out["executed"] = {str(k): v for k, v in database.run_pending().items()}
    finally:
        database.close()
    for name, result in [("committed", committed), ("failing", failing), ("async", asynchronous),
                         ("durable", durable), ("flaky", flaky), ("contextual", contextual)]:
        result.refresh()
        value = result.return_value if str(result.status) == "SUCCESSFUL" else None
        out[name] = [str(result.status), value, [e.exception_class_path for e in result.errors]]
    out["async_result"] = str(async_to_sync(tasks.add_later.aget_result)(asynchronous.id).status)
    with connection.cursor() as cur:
        cur.execute("SELECT step_id FROM everystep_step WHERE workflow_id = %s ORDER BY step_id", [durable.id])
        out["durable_steps"] = [row[0] for row in cur.fetchall()]
        # The statuses a run can have that these runs did not reach.
        for status, steps in [("running", False), ("blocked", True), ("waiting", True), ("cancelled", True)]:
            cur.execute("UPDATE everystep_workflow SET status = %s WHERE id = %s", [status, later.id])
            if steps:
                cur.execute("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status) "
                            "VALUES (%s, '1', 'x', '[]', '{}', 'started') ON CONFLICT DO NOTHING", [later.id])
            out[f"status_{status}"] = str(tasks.add.get_result(later.id).status)
    out["signals"] = sorted({kind for kind, *_ in seen})
    out["finished"] = sorted(str(status) for kind, _, *rest in seen if kind == "finished" for status in rest)
    out["check"] = [message.id for message in checks.run_checks()]
    with connection.cursor() as cur:
        cur.execute("DROP TABLE everystep_migration")
    out["check_without_schema"] = [message.id for message in checks.run_checks()]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
