"""Recurring schedules against a real PostgreSQL: plan/apply/retire/list
through the CLI, and the tick — database time, catch-up, overlap, pause,
concurrent schedulers, workflows that cannot be resolved.

Most tests set the engine's clock of their schema (everystep_now(), frozen
at the moment they say with everystep.db.set_clock), so the scheduler's
notion of time is whatever the test says, and never the host's.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import subprocess
import sys
import textwrap
import threading
import zoneinfo
from pathlib import Path

import psycopg
import pytest

import everystep.db
from everystep import scheduler, workflow
from everystep.scheduler import Schedule

ROOT = Path(__file__).resolve().parent.parent
UTC = dt.UTC
PARIS = zoneinfo.ZoneInfo("Europe/Paris")


@workflow
def report(label, options=None):
    return f"report {label}"


def not_a_workflow(label):
    return label


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


class Clock:
    """The test schema's clock, as every connection to it sees it."""

    def __init__(self, db):
        self.db = db
        self.url = db.url

    def set(self, moment: str) -> None:
        with self.db.connect() as conn:
            everystep.db.set_clock(conn, at(moment), True)  # time stands still until set again

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=True)

    def apply(self, **schedules: Schedule) -> list[scheduler.PlanEntry]:
        with self.connect() as conn:
            return scheduler.apply(conn, schedules).entries

    def tick(self) -> list[scheduler.Fired]:
        with self.connect() as conn:
            return scheduler.tick(conn)

    def fired_times(self) -> list[str]:
        """One tick: the fire times it fired, as 'MM-DD HH:MM'."""
        return [f.fire_time.astimezone(UTC).strftime("%m-%d %H:%M") for f in self.tick()]


@pytest.fixture
def clock(db):
    return Clock(db)


def nightly(**options) -> Schedule:
    return Schedule(workflow="tests.test_schedules.report", args=("nightly",), cron="0 3 * * *", **options)


def schedule_row(db, key: str) -> dict:
    with db.connect() as conn:
        return next(row for row in everystep.db.load_schedules(conn) if row["key"] == key)


def run_count(db) -> int:
    return db.value("SELECT count(*) FROM everystep_workflow")


# ---------------------------------------------------------------- firing


def test_a_schedule_fires_at_database_time_and_its_run_executes(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly())
    assert schedule_row(db, "nightly")["next_fire_at"] == at("2026-01-10 03:00")

    clock.set("2026-01-10 02:59:59")
    assert clock.tick() == []
    clock.set("2026-01-10 03:00:05")
    [fired] = clock.tick()
    assert (fired.key, fired.fire_time) == ("nightly", at("2026-01-10 03:00"))
    assert clock.tick() == []  # that fire time is done

    run = db.run(fired.run_id)
    assert run["name"] == "tests.test_schedules.report" and run["args"] == ["nightly"]
    assert run["idempotency_key"] == "schedule:nightly:2026-01-10T03:00:00+00:00"
    row = schedule_row(db, "nightly")
    assert row["next_fire_at"] == at("2026-01-11 03:00")
    assert (row["last_fire_at"], row["last_run_id"]) == (at("2026-01-10 03:00"), fired.run_id)

    assert db.run_pending() == {fired.run_id: "completed"}
    assert db.run(fired.run_id)["result"] == "report nightly"


def test_a_schedule_fires_with_the_real_database_clock(db):
    every_minute = Schedule(workflow="tests.test_schedules.report", args=("minute",), cron="* * * * *")
    with db.connect() as conn:
        scheduler.apply(conn, {"minute": every_minute})
        assert scheduler.tick(conn) == []  # applied now: its first fire time is in the future
        minute = conn.execute("UPDATE everystep_schedule SET next_fire_at = date_trunc('minute', now())"
                              " RETURNING next_fire_at").fetchone()[0]
        [fired] = scheduler.tick(conn)
    assert fired.fire_time == minute
    assert db.run_pending() == {fired.run_id: "completed"}


def test_a_fire_time_never_makes_a_second_run(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly())
    clock.set("2026-01-10 03:00:05")
    [fired] = clock.tick()
    # As if the schedule's state were restored to before that firing (a
    # failover to a stale replica): the idempotency key finds the run.
    with db.connect() as conn:
        conn.execute("UPDATE everystep_schedule SET next_fire_at = '2026-01-10 03:00+00'")
    assert clock.tick() == []
    assert run_count(db) == 1
    assert schedule_row(db, "nightly")["next_fire_at"] == at("2026-01-11 03:00")
    assert schedule_row(db, "nightly")["last_run_id"] == fired.run_id


def test_concurrent_schedulers_make_one_run_per_fire_time(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(**{f"s{i}": nightly() for i in range(5)})
    clock.set("2026-01-10 03:00:05")
    tickers = 4
    barrier = threading.Barrier(tickers)
    fired: list[scheduler.Fired] = []
    errors: list[BaseException] = []

    def ticker() -> None:
        try:
            with clock.connect() as conn:
                barrier.wait()
                for _ in range(3):
                    fired.extend(scheduler.tick(conn))
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=ticker) for _ in range(tickers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert sorted(f.key for f in fired) == ["s0", "s1", "s2", "s3", "s4"]
    assert run_count(db) == 5


def test_a_scheduler_that_finds_the_lock_taken_fires_nothing(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly())
    clock.set("2026-01-10 03:00:05")
    with clock.connect() as other, other.transaction():
        assert everystep.db.try_lock_scheduler(other)  # another scheduler, mid-tick
        assert clock.tick() == []
    assert len(clock.tick()) == 1


# ---------------------------------------------------------------- catch-up after downtime

# Applied on 01-05 at 02:00 (first fire time 01-05 03:00), then the scheduler
# is down until the clock below: 01-05 .. 01-09 are missed, 01-10 is due.
@pytest.mark.parametrize(
    "now, options, fired",
    [
        # 30 s after 03:00: 01-10 is on time (max_lateness_seconds 60)
        ("2026-01-10 03:00:30", {"catchup": "skip"}, ["01-10 03:00"]),
        ("2026-01-10 03:00:30", {"catchup": "fire_once"}, ["01-09 03:00", "01-10 03:00"]),
        ("2026-01-10 03:00:30", {"catchup": "fire_all", "max_catchup": 3},
         ["01-07 03:00", "01-08 03:00", "01-09 03:00", "01-10 03:00"]),
        ("2026-01-10 03:00:30", {"catchup": "fire_all"},
         ["01-05 03:00", "01-06 03:00", "01-07 03:00", "01-08 03:00", "01-09 03:00", "01-10 03:00"]),
        # two hours after 03:00: 01-10 is missed too
        ("2026-01-10 05:00:00", {"catchup": "skip"}, []),
        ("2026-01-10 05:00:00", {"catchup": "fire_once"}, ["01-10 03:00"]),
        ("2026-01-10 05:00:00", {"catchup": "fire_all", "max_catchup": 2}, ["01-09 03:00", "01-10 03:00"]),
        ("2026-01-10 05:00:00", {"catchup": "skip", "max_lateness_seconds": 7200}, ["01-10 03:00"]),
        ("2026-01-10 05:00:00", {"catchup": "fire_once", "max_lateness_seconds": 3 * 86400},
         ["01-07 03:00", "01-08 03:00", "01-09 03:00", "01-10 03:00"]),
    ],
)
def test_catch_up_policies(db, clock, now, options, fired):
    clock.set("2026-01-05 02:00:00")
    clock.apply(nightly=nightly(**options))
    clock.set(now)
    assert clock.fired_times() == fired
    assert clock.tick() == []
    assert schedule_row(db, "nightly")["next_fire_at"] == at("2026-01-11 03:00")
    assert run_count(db) == len(fired)


def test_skipping_missed_times_is_logged(db, clock, caplog):
    clock.set("2026-01-05 02:00:00")
    clock.apply(nightly=nightly(catchup="skip"))
    clock.set("2026-01-10 05:00:00")
    with caplog.at_level(logging.WARNING, logger="everystep"):
        assert clock.tick() == []
    assert "schedule nightly: fire times missed before 2026-01-11T03:00:00+00:00 were not fired (catchup: skip)" in (
        caplog.messages
    )


# ---------------------------------------------------------------- overlap, pause


def test_overlap_forbid_waits_for_the_previous_run(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly(overlap="forbid", max_lateness_seconds=7200))
    clock.set("2026-01-10 03:00:05")
    [first] = clock.tick()
    clock.set("2026-01-11 03:00:05")
    assert clock.tick() == []  # the 01-10 run is still scheduled
    assert schedule_row(db, "nightly")["next_fire_at"] == at("2026-01-11 03:00")
    assert db.run_pending() == {first.run_id: "completed"}
    clock.set("2026-01-11 03:20:00")
    assert clock.fired_times() == ["01-11 03:00"]  # within its lateness once the run ended


def test_overlap_forbid_judges_waiting_times_by_the_catch_up_policy(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly(overlap="forbid", catchup="skip"))
    clock.set("2026-01-10 03:00:05")
    assert len(clock.tick()) == 1
    clock.set("2026-01-11 03:00:05")
    assert clock.tick() == []
    db.run_pending()
    clock.set("2026-01-11 04:00:00")  # the run ended, but 01-11 03:00 is an hour late now
    assert clock.tick() == []
    assert schedule_row(db, "nightly")["next_fire_at"] == at("2026-01-12 03:00")


def test_overlap_forbid_catches_up_one_run_at_a_time(db, clock):
    clock.set("2026-01-05 02:00:00")
    clock.apply(nightly=nightly(overlap="forbid", catchup="fire_all", max_catchup=2))
    clock.set("2026-01-08 03:00:05")
    assert clock.fired_times() == ["01-06 03:00"]
    assert clock.tick() == []
    db.run_pending()
    assert clock.fired_times() == ["01-07 03:00"]
    db.run_pending()
    assert clock.fired_times() == ["01-08 03:00"]
    db.run_pending()
    assert clock.tick() == []


def test_overlap_allow_fires_while_the_previous_run_is_pending(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly())
    clock.set("2026-01-10 03:00:05")
    assert len(clock.tick()) == 1
    clock.set("2026-01-11 03:00:05")
    assert len(clock.tick()) == 1
    assert run_count(db) == 2


def test_a_paused_schedule_fires_nothing_and_resumes_from_the_next_time(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly(paused=True))
    clock.set("2026-01-12 03:00:05")
    assert clock.tick() == []
    clock.set("2026-01-12 03:00:10")
    [entry] = clock.apply(nightly=nightly(catchup="fire_all"))
    assert (entry.action, entry.changes) == ("change", {"catchup": ("fire_once", "fire_all"), "paused": (True, False)})
    assert clock.tick() == []  # nothing missed during the pause is caught up
    assert schedule_row(db, "nightly")["next_fire_at"] == at("2026-01-13 03:00")
    clock.set("2026-01-13 03:00:01")
    assert clock.fired_times() == ["01-13 03:00"]


def test_a_retired_schedule_never_fires(db, clock):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly())
    with clock.connect() as conn:
        everystep.db.retire_schedule(conn, "nightly")
    clock.set("2026-01-10 03:00:05")
    assert clock.tick() == []


# ---------------------------------------------------------------- workflows that cannot be resolved


@pytest.mark.parametrize(
    "workflow_name, error",
    [
        ("tests.test_schedules.no_such_flow",
         "cannot fire: workflow tests.test_schedules.no_such_flow: cannot import 'tests.test_schedules.no_such_flow'"),
        ("tests.test_schedules.not_a_workflow",
         "cannot fire: workflow tests.test_schedules.not_a_workflow: tests.test_schedules.not_a_workflow is not an "
         "@workflow function"),
    ],
)
def test_a_workflow_that_cannot_be_resolved_does_not_fire(db, clock, caplog, workflow_name, error):
    clock.set("2026-01-10 02:00:00")
    broken = Schedule(workflow=workflow_name, cron="0 3 * * *", max_lateness_seconds=3600)
    clock.apply(nightly=broken)
    clock.set("2026-01-10 03:00:05")
    with caplog.at_level(logging.ERROR, logger="everystep"):
        assert clock.tick() == []
        assert clock.tick() == []
    assert caplog.messages == [f"schedule nightly: {error}"]  # logged once, not on every tick
    row = schedule_row(db, "nightly")
    assert row["last_error"] == error
    assert row["next_fire_at"] == at("2026-01-10 03:00")  # still due
    assert run_count(db) == 0

    clock.set("2026-01-10 03:10:00")  # fixed within the lateness: the due time fires
    clock.apply(nightly=Schedule(workflow="tests.test_schedules.report", cron="0 3 * * *",
                                       max_lateness_seconds=3600))
    assert clock.fired_times() == ["01-10 03:00"]
    assert schedule_row(db, "nightly")["last_error"] is None


def test_one_schedule_failing_to_fire_leaves_the_others_firing(db, clock, caplog):
    clock.set("2026-01-10 02:00:00")
    clock.apply(good=nightly(), bad=nightly())
    with db.connect() as conn:  # arguments that no longer decode
        conn.execute("""UPDATE everystep_schedule SET args = '[{"$es": "bogus", "v": 1}]' WHERE key = 'bad'""")
    clock.set("2026-01-10 03:00:05")
    with caplog.at_level(logging.ERROR, logger="everystep"):
        assert [f.key for f in clock.tick()] == ["good"]
    error = "firing failed: EverystepError: unknown stored type tag 'bogus'"
    assert caplog.messages == [f"schedule bad: {error}"]
    assert schedule_row(db, "bad")["last_error"] == error
    assert schedule_row(db, "bad")["next_fire_at"] == at("2026-01-10 03:00")
    assert run_count(db) == 1


# ---------------------------------------------------------------- the fire times themselves


def test_fire_times_follow_the_time_zone_across_daylight_saving():
    def fired(cron: str, since: str, now: str) -> list[str]:
        decision = scheduler.decide(cron, "Europe/Paris", at(since), at(now), "fire_all", 100, 60)
        return [t.astimezone(PARIS).isoformat() for t in decision.fire]

    # spring forward (02:00 -> 03:00 on 03-29): 02:30 does not exist and fires at 03:00
    assert fired("30 2 * * *", "2026-03-28 00:00", "2026-03-30 12:00") == [
        "2026-03-28T02:30:00+01:00", "2026-03-29T03:00:00+02:00", "2026-03-30T02:30:00+02:00",
    ]
    # fall back (03:00 -> 02:00 on 10-25): 02:30 happens twice, and fires twice
    assert fired("30 2 * * *", "2026-10-24 00:00", "2026-10-26 12:00") == [
        "2026-10-24T02:30:00+02:00", "2026-10-25T02:30:00+02:00", "2026-10-25T02:30:00+01:00",
        "2026-10-26T02:30:00+01:00",
    ]


def test_a_long_downtime_costs_only_the_times_kept():
    decision = scheduler.decide("* * * * *", "UTC", at("2016-01-01 00:00"), at("2026-01-10 03:00:30"),
                                "fire_all", 3, 60)
    assert [t.strftime("%H:%M") for t in decision.fire] == ["02:57", "02:58", "02:59", "03:00"]
    assert decision.dropped_missed and decision.next_fire_at == at("2026-01-10 03:01")


# ---------------------------------------------------------------- plan, apply, retire, list (CLI)


def cli(*args: str, db) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EVERYSTEP_DATABASE_URL"}
    return subprocess.run([sys.executable, "-m", "everystep.cli", *args], capture_output=True, text=True,
                          env={**env, "ES_TEST_SCHEDULES_URL": db.url}, cwd=ROOT, timeout=60)


def next_utc(cron: str, db) -> str:
    """The next fire time of `cron` (UTC) after the database's now."""
    return scheduler.iso_utc(scheduler.next_fire_time(cron, "UTC", db.value("SELECT now()")))


def write_manifest(path: Path, schedules: str) -> str:
    path.write_text("database:\n  url: ${ES_TEST_SCHEDULES_URL}\nschedules:\n" + textwrap.indent(
        textwrap.dedent(schedules), "  "))
    return str(path)


TWO_SCHEDULES = """
    nightly:
      workflow: tests.test_schedules.report
      args: [nightly]
      cron: "0 3 * * *"
    hourly:
      workflow: tests.test_schedules.report
      args: [hourly]
      cron: "@hourly"
      timezone: Europe/Paris
"""


def test_plan_is_read_only_and_apply_writes_it(db, tmp_path):
    manifest = write_manifest(tmp_path / "everystep.yaml", TWO_SCHEDULES)
    plan = cli("schedules", "plan", "-c", manifest, db=db)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    assert lines[0].startswith("+ hourly: add (next fire ") and lines[1].startswith("+ nightly: add (next fire ")
    assert lines[2] == "plan: 2 to add (source deployment)"
    assert lines[3].startswith("digest: sha256:") and len(lines) == 4
    assert db.value("SELECT count(*) FROM everystep_schedule") == 0

    applied = cli("schedules", "apply", "-c", manifest, db=db)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.splitlines()[-2] == "applied: 2 added (source deployment)"
    assert db.query("SELECT key, cron, timezone, args, version FROM everystep_schedule ORDER BY key") == [
        ("hourly", "@hourly", "Europe/Paris", ["hourly"], 1),
        ("nightly", "0 3 * * *", "UTC", ["nightly"], 1),
    ]
    again = cli("schedules", "plan", "-c", manifest, db=db)
    assert again.stdout.splitlines()[:3] == ["= hourly: unchanged", "= nightly: unchanged",
                                             "plan: 2 unchanged (source deployment)"]


def test_removed_keys_are_shown_and_kept_until_retired(db, tmp_path):
    manifest = write_manifest(tmp_path / "everystep.yaml", TWO_SCHEDULES)
    assert cli("schedules", "apply", "-c", manifest, db=db).returncode == 0
    write_manifest(tmp_path / "everystep.yaml", """
        nightly:
          workflow: tests.test_schedules.report
          args: [nightly, {full: true}]
          cron: "30 4 * * *"
          overlap: forbid
    """)
    plan = cli("schedules", "plan", "-c", manifest, db=db).stdout.splitlines()
    assert plan[0] == ('~ nightly: change args ["nightly"] -> ["nightly", {"full": true}]; '
                       'cron "0 3 * * *" -> "30 4 * * *"; overlap "allow" -> "forbid" (next fire '
                       f'{next_utc("30 4 * * *", db)})')
    assert plan[1] == ("! hourly: not in the file, still live: it keeps firing until retired "
                       "(everystep schedules retire hourly)")
    assert plan[2] == "plan: 1 to change, 1 not in the file (source deployment)"

    applied = cli("schedules", "apply", "-c", manifest, db=db)
    assert applied.stdout.splitlines()[-2] == "applied: 1 changed, 1 not in the file (source deployment)"
    assert db.query("SELECT key, version, retired_at IS NULL FROM everystep_schedule ORDER BY key") == [
        ("hourly", 1, True),  # never pruned silently
        ("nightly", 2, True),
    ]

    retired = cli("schedules", "retire", "hourly", "-c", manifest, db=db)
    assert retired.returncode == 0, retired.stderr
    assert retired.stdout.startswith("retired hourly at ")
    assert cli("schedules", "plan", "-c", manifest, db=db).stdout.splitlines()[-2] == \
        "plan: 1 unchanged (source deployment)"

    again = cli("schedules", "retire", "hourly", "-c", manifest, db=db)
    assert again.returncode == 1
    assert again.stderr.startswith("everystep: schedule 'hourly' was already retired at ")
    unknown = cli("schedules", "retire", "weekly", "-c", manifest, db=db)
    assert (unknown.returncode, unknown.stderr) == (1, "everystep: no schedule 'weekly'\n")

    # the key back in the file brings the schedule back
    manifest = write_manifest(tmp_path / "everystep.yaml", TWO_SCHEDULES)
    plan = cli("schedules", "plan", "-c", manifest, db=db).stdout.splitlines()
    assert plan[0].startswith("+ hourly: revive the retired schedule (next fire ")


def test_list_shows_state_and_last_run(db, clock, tmp_path):
    clock.set("2026-01-10 02:00:00")
    clock.apply(nightly=nightly(), paused_one=nightly(paused=True), gone=nightly())
    with clock.connect() as conn:
        everystep.db.retire_schedule(conn, "gone")
    clock.set("2026-01-10 03:00:05")
    [fired] = clock.tick()
    listing = cli("schedules", "list", "-c", write_manifest(tmp_path / "everystep.yaml", "{}"), db=db)
    assert listing.returncode == 0, listing.stderr
    header, *rows = listing.stdout.splitlines()
    assert header.split() == ["KEY", "STATE", "SOURCE", "CRON", "TIMEZONE", "WORKFLOW", "NEXT", "FIRE", "LAST",
                              "FIRE", "LAST", "RUN"]
    assert rows[0].split() == ["nightly", "active", "deployment", "0", "3", "*", "*", "*", "UTC",
                               "tests.test_schedules.report",
                               "2026-01-11T03:00:00+00:00", "2026-01-10T03:00:00+00:00", str(fired.run_id),
                               "scheduled"]
    assert rows[1].split()[:2] == ["paused_one", "paused"]
    assert len(rows) == 2
    everything = cli("--database-url", db.url, "schedules", "list", "--all", db=db).stdout.splitlines()
    assert [line.split()[:2] for line in everything[1:]] == [
        ["gone", "retired"], ["nightly", "active"], ["paused_one", "paused"],
    ]


@pytest.mark.parametrize("command", ["plan", "apply"])
def test_a_bad_manifest_writes_nothing(db, tmp_path, command):
    manifest = write_manifest(tmp_path / "everystep.yaml", """
        nightly: {workflow: tests.test_schedules.report, cron: "0 3 * * *"}
        broken: {workflow: tests.test_schedules.report, cron: "0 25 * * *"}
    """)
    done = cli("schedules", command, "-c", manifest, db=db)
    assert done.returncode == 2
    assert done.stderr == (
        f"everystep: {manifest}: schedules.broken.cron: invalid cron expression '0 25 * * *': "
        "[0 25 * * *] is not acceptable, out of range\n"
    )
    assert done.stdout == ""
    assert db.value("SELECT count(*) FROM everystep_schedule") == 0


def test_plan_and_apply_need_the_manifest(db):
    done = cli("--database-url", db.url, "schedules", "apply", db=db)
    assert (done.returncode, done.stderr) == (2, "everystep: schedules apply needs the manifest: -c everystep.yaml\n")


def test_an_unmigrated_database_is_reported(db):
    with db.connect() as conn:
        conn.execute("DROP TABLE everystep_schedule")
    done = cli("--database-url", db.url, "schedules", "list", db=db)
    assert (done.returncode, done.stderr) == (
        1, "everystep: this database has no schedule table: run `everystep migrate` first\n"
    )


def test_apply_waits_for_a_tick_in_progress(db, clock):
    clock.set("2026-01-10 02:00:00")
    with clock.connect() as ticking, ticking.transaction():
        everystep.db.lock_scheduler(ticking)
        applied = threading.Event()

        def apply() -> None:
            clock.apply(nightly=nightly())
            applied.set()

        thread = threading.Thread(target=apply)
        thread.start()
        assert not applied.wait(0.5)
    thread.join(10)
    assert applied.is_set()
    assert schedule_row(db, "nightly")["next_fire_at"] == at("2026-01-10 03:00")

