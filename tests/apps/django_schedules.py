"""Run by tests/test_schedules_owned.py in a process of its own (Django's
settings are global): everystep.schedules inside Django transactions."""

from __future__ import annotations

import json
import sys

import everystep
from tests.apps.django_scheduling import configure_django
from tests.apps.workflows import quick


def main(url: str) -> None:
    configure_django(url)
    from django.db import transaction  # noqa: PLC0415

    with transaction.atomic():
        put = everystep.schedules.put("customer-1", quick, ["/tmp"], cron="@daily")
        paused = everystep.schedules.pause("customer-1")
    try:
        with transaction.atomic():
            everystep.schedules.put("customer-2", quick, ["/tmp"], cron="@daily")
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    info = everystep.schedules.get("customer-1")
    print(json.dumps({"put": [put.state, put.version, put.args], "paused": [paused.state, paused.version],
                      "get": [info.state, info.source, info.version, info.args],
                      "rolled_back": everystep.schedules.get("customer-2") is None}))


if __name__ == "__main__":
    main(sys.argv[1])
