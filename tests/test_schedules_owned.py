"""Reviewed plans (digests), manifests owned by sources, the schedules API
(everystep.schedules), auto-pause, and the JSON outputs of the schedules and
runs commands, against a real PostgreSQL."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import psycopg
import pytest

import everystep
import everystep.db
from everystep import scheduler, schedules, workflow
from everystep.errors import EverystepError
from everystep.scheduler import Manifest, Schedule
from tests.support.processes import ROOT
from tests.test_schedules import Clock, at, cli, write_manifest

FAILING = {"on": True}  # what `flaky` does, set by the tests


@workflow
def flaky(label):
    if FAILING["on"]:
        raise RuntimeError(f"{label} failed")
    return label


@workflow
def report(label):
    return f"report {label}"


REPORT = "tests.test_schedules_owned.report"


@pytest.fixture
def clock(db):
    return Clock(db)


def manifest_text(source: str | None, **crons: str) -> str:
    lines = [f"source: {source}"] if source else []
    for key, cron in crons.items():
        lines += [f"{key}:", f"  workflow: {REPORT}", f"  args: [{key}]", f'  cron: "{cron}"']
    return "\n".join(lines) + "\n"


def versions(db) -> dict:
    return dict(db.query("SELECT key, version FROM everystep_schedule"))


def plan_json(manifest: str, db, url: str | None = None) -> dict:
    done = cli(*(["--database-url", url] if url else []), "schedules", "plan", "-c", manifest, "-o", "json", db=db)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# ---------------------------------------------------------------- reviewed plans


def test_apply_with_the_reviewed_digest_applies(db, clock, tmp_path):
    clock.set("2026-01-10 02:00:00")
    manifest = write_manifest(tmp_path / "everystep.yaml", manifest_text(None, nightly="0 3 * * *"))
    reviewed = plan_json(manifest, db, clock.url)
    text = cli("--database-url", clock.url, "schedules", "plan", "-c", manifest, db=db).stdout.splitlines()
    assert text[-1] == f"digest: {reviewed['digest']}"
    assert reviewed["digest"].startswith("sha256:") and db.value("SELECT count(*) FROM everystep_schedule") == 0

    clock.set("2026-01-10 02:20:00")  # time passing does not change the plan
    applied = cli("--database-url", clock.url, "schedules", "apply", "-c", manifest,
                  "--plan-digest", reviewed["digest"], db=db)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.splitlines()[-2:] == ["applied: 1 added (source deployment)",
                                                 f"digest: {reviewed['digest']}"]
    assert versions(db) == {"nightly": 1}


def test_a_plan_that_changed_since_review_writes_nothing(db, tmp_path):
    manifest = write_manifest(tmp_path / "everystep.yaml", manifest_text(None, nightly="0 3 * * *"))
    assert cli("schedules", "apply", "-c", manifest, db=db).returncode == 0
    write_manifest(tmp_path / "everystep.yaml", manifest_text(None, nightly="0 4 * * *", hourly="@hourly"))
    reviewed = plan_json(manifest, db)["digest"]

    # Someone else applies a different change to the same key meanwhile.
    other = write_manifest(tmp_path / "other.yaml", manifest_text(None, nightly="0 5 * * *"))
    assert cli("schedules", "apply", "-c", other, db=db).returncode == 0
    before = db.query("SELECT * FROM everystep_schedule ORDER BY key")

    stale = cli("schedules", "apply", "-c", manifest, "--plan-digest", reviewed, db=db)
    assert stale.returncode == 4
    now = plan_json(manifest, db)["digest"]
    assert stale.stderr == (f"everystep: the plan changed since it was reviewed: its digest is now {now}, "
                            f"not {reviewed}; nothing was written\n")
    assert stale.stdout.splitlines()[1].startswith('~ nightly: change cron "0 5 * * *" -> "0 4 * * *" (next fire ')
    assert db.query("SELECT * FROM everystep_schedule ORDER BY key") == before

    as_json = cli("schedules", "apply", "-c", manifest, "--plan-digest", reviewed, "-o", "json", db=db)
    assert as_json.returncode == 4
    document = json.loads(as_json.stdout)
    assert (document["applied"], document["expected_digest"], document["digest"]) == (False, reviewed, now)
    assert db.query("SELECT * FROM everystep_schedule ORDER BY key") == before

    assert cli("schedules", "apply", "-c", manifest, "--plan-digest", now, db=db).returncode == 0
    assert versions(db) == {"nightly": 3, "hourly": 1}


def test_the_digest_covers_exactly_what_apply_writes(db):
    with db.connect() as conn:
        empty = scheduler.plan(conn, Manifest({}))
        one = scheduler.plan(conn, Manifest({"a": Schedule(REPORT, "@daily")}))
        other_source = scheduler.plan(conn, Manifest({"a": Schedule(REPORT, "@daily")}, source="team"))
        other_args = scheduler.plan(conn, Manifest({"a": Schedule(REPORT, "@daily", args=(1,))}))
        assert len({empty.digest, one.digest, other_source.digest, other_args.digest}) == 4
        scheduler.apply(conn, Manifest({"a": Schedule(REPORT, "@daily")}))
        # nothing left to write: the digest of an empty write set of that source
        assert scheduler.plan(conn, Manifest({"a": Schedule(REPORT, "@daily")})).digest == empty.digest


# ---------------------------------------------------------------- owned manifests


def test_two_sources_coexist_and_never_touch_each_others_keys(db, tmp_path):
    team_a = write_manifest(tmp_path / "a.yaml", manifest_text("team-a", a1="0 1 * * *", a2="0 2 * * *"))
    team_b = write_manifest(tmp_path / "b.yaml", manifest_text("team-b", b1="0 3 * * *"))
    assert cli("schedules", "apply", "-c", team_a, db=db).returncode == 0
    applied_b = cli("schedules", "apply", "-c", team_b, "-o", "json", db=db)
    assert applied_b.returncode == 0, applied_b.stderr
    assert [e["key"] for e in json.loads(applied_b.stdout)["entries"]] == ["b1"]  # a1, a2 not reported
    assert dict(db.query("SELECT key, source FROM everystep_schedule")) == {
        "a1": "team-a", "a2": "team-a", "b1": "team-b"}

    # team-a drops a2 and changes a1: team-b's key is neither changed nor reported
    write_manifest(tmp_path / "a.yaml", manifest_text("team-a", a1="30 1 * * *"))
    plan = plan_json(team_a, db)
    assert [(e["key"], e["action"]) for e in plan["entries"]] == [("a1", "change"), ("a2", "not_in_file")]
    assert cli("schedules", "apply", "-c", team_a, db=db).returncode == 0
    assert versions(db) == {"a1": 2, "a2": 1, "b1": 1}

    # team-b claiming one of team-a's keys is refused, and writes nothing at all
    write_manifest(tmp_path / "b.yaml", manifest_text("team-b", b1="0 4 * * *", a1="0 5 * * *"))
    for command in ("plan", "apply"):
        refused = cli("schedules", command, "-c", team_b, db=db)
        assert refused.returncode == 1 and refused.stdout == ""
        assert refused.stderr == ("everystep: source 'team-b' cannot apply 'a1' (team-a): other sources own them; "
                                  "nothing was written (use other keys, or retire them from their own source first)\n")
    assert versions(db) == {"a1": 2, "a2": 1, "b1": 1}

    # retire is per source: team-b cannot retire team-a's key, unless forced
    refused = cli("schedules", "retire", "a2", "-c", team_b, db=db)
    assert (refused.returncode, refused.stderr) == (
        1, "everystep: schedule 'a2' belongs to source 'team-a', not 'team-b': it is left alone\n")
    assert cli("schedules", "retire", "a2", "--source", "team-a", "-c", team_b, db=db).returncode == 0
    forced = cli("schedules", "retire", "a1", "--force", "-c", team_b, "-o", "json", db=db)
    assert forced.returncode == 0, forced.stderr
    document = json.loads(forced.stdout)
    assert (document["key"], document["source"], document["forced"]) == ("a1", "team-a", True)
    assert db.query("SELECT key FROM everystep_schedule WHERE retired_at IS NULL") == [("b1",)]
    listing = cli("schedules", "list", "--all", "--source", "team-a", "-c", team_a, db=db).stdout.splitlines()
    assert [line.split()[:3] for line in listing[1:]] == [["a1", "retired", "team-a"], ["a2", "retired", "team-a"]]
    bad = cli("schedules", "retire", "b1", "--source", "no such", "-c", team_b, db=db)
    assert (bad.returncode, bad.stderr) == (2, "everystep: --source: must be 1 to 100 letters, digits, '.', '_' or "
                                               "'-', starting with a letter or digit, got 'no such'\n")


def test_a_manifest_without_a_source_belongs_to_deployment(db, tmp_path):
    manifest = write_manifest(tmp_path / "everystep.yaml", manifest_text(None, nightly="0 3 * * *"))
    assert plan_json(manifest, db)["source"] == "deployment"
    bad = write_manifest(tmp_path / "bad.yaml", manifest_text("has space", nightly="0 3 * * *"))
    done = cli("schedules", "plan", "-c", bad, db=db)
    assert done.returncode == 2
    assert done.stderr == (f"everystep: {bad}: schedules.source: must be 1 to 100 letters, digits, '.', '_' or '-', "
                           "starting with a letter or digit, got 'has space'\n")


# ---------------------------------------------------------------- the API


def test_put_pause_resume_retire_and_get(db, clock):
    clock.set("2026-01-10 02:00:00")
    with clock.connect() as conn:
        assert schedules.get("customer-1", conn=conn) is None
        with everystep.transaction(conn):
            put = schedules.put("customer-1", report, ["c1"], cron="0 3 * * *", timezone="Europe/Paris")
        assert (put.state, put.source, put.version, put.args) == ("active", "api", 1, ["c1"])
        assert put.next_fire_at == at("2026-01-11 02:00")  # 03:00 in Paris
        with conn.transaction():
            assert schedules.put("customer-1", REPORT, ("c1",), cron="0 3 * * *", timezone="Europe/Paris",
                                 conn=conn).version == 1  # unchanged: no new version
            changed = schedules.put("customer-1", report, ["c1"], cron="0 4 * * *", timezone="Europe/Paris",
                                    catchup="fire_all", max_catchup=3, overlap="forbid", max_lateness_seconds=30,
                                    auto_pause_after=5, conn=conn)
        assert (changed.version, changed.cron, changed.max_catchup, changed.overlap, changed.auto_pause_after) == (
            2, "0 4 * * *", 3, "forbid", 5)

        with everystep.transaction(conn):
            assert schedules.pause("customer-1").state == "paused"
        assert schedules.get("customer-1", conn=conn).version == 3
        clock.set("2026-01-13 05:00:00")
        assert clock.tick() == []  # paused: fires nothing
        with everystep.transaction(conn):
            resumed = schedules.resume("customer-1")
        assert (resumed.state, resumed.version, resumed.next_fire_at) == ("active", 4, at("2026-01-14 03:00"))

        with everystep.transaction(conn):
            retired_at = schedules.retire("customer-1")
        info = schedules.get("customer-1", conn=conn)
        assert (info.state, info.retired_at) == ("retired", retired_at)


def test_the_api_writes_in_the_callers_transaction(db):
    with db.connect() as conn:
        with pytest.raises(RuntimeError), everystep.transaction(conn):
            schedules.put("c", report, ["c"], cron="@daily")
            raise RuntimeError("the caller's work failed")
        assert schedules.get("c", conn=conn) is None
        with pytest.raises(EverystepError, match=r"everystep.schedules.put\(\) needs an open transaction"):
            schedules.put("c", report, ["c"], cron="@daily", conn=conn)
    assert db.value("SELECT count(*) FROM everystep_schedule") == 0


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"cron": "0 25 * * *"}, "everystep.schedules.put(): schedules.k.cron: invalid cron expression '0 25 * * *'"),
    ({"cron": "@daily", "timezone": "Mars/Base"},
     "everystep.schedules.put(): schedules.k.timezone: must be an IANA time zone like UTC or Europe/Paris, "
     "got 'Mars/Base'"),
    ({"cron": "@daily", "max_catchup": 3},
     "everystep.schedules.put(): schedules.k.max_catchup: only applies to catchup: fire_all"),
    ({"cron": "@daily", "overlap": "sometimes"},
     "everystep.schedules.put(): schedules.k.overlap: must be one of allow, forbid, got 'sometimes'"),
    ({"cron": "@daily", "auto_pause_after": 0},
     "everystep.schedules.put(): schedules.k.auto_pause_after: must be an integer >= 1, got 0"),
    ({"cron": "@daily", "max_lateness_seconds": -1},
     "everystep.schedules.put(): schedules.k.max_lateness_seconds: must be a number > 0, got -1"),
    ({"cron": "@daily", "args": [object()]}, "everystep.schedules.put(): schedules.k.args: cannot be stored"),
    ({"cron": "@daily", "workflow": lambda: None}, "is not an @workflow function"),
    ({"cron": "@daily", "workflow": "not a name"},
     "everystep.schedules.put(): schedules.k.workflow: must be the module.qualname of an @workflow"),
    ({"cron": "@daily", "source": ""}, "everystep.schedules: source: must be 1 to 100 letters"),
    ({"cron": "@daily", "key": "a b"}, "everystep.schedules.put(): schedules: the key 'a b' must be 1 to 200"),
])
def test_bad_input_to_put_is_one_clear_error_and_writes_nothing(db, kwargs, error):
    arguments = {"key": "k", "workflow": report, "args": [], **kwargs}
    with db.connect() as conn, everystep.transaction(conn):
        with pytest.raises(schedules.ScheduleError) as raised:
            schedules.put(**arguments)
    assert error in str(raised.value) and "\n" not in str(raised.value)
    assert db.value("SELECT count(*) FROM everystep_schedule") == 0


def test_the_api_and_a_manifest_own_their_keys(db, tmp_path):
    manifest = write_manifest(tmp_path / "everystep.yaml", manifest_text(None, nightly="0 3 * * *"))
    assert cli("schedules", "apply", "-c", manifest, db=db).returncode == 0
    with db.connect() as conn, everystep.transaction(conn):
        schedules.put("customer-1", report, ["c1"], cron="@hourly")
        for refused, message in [
            (lambda: schedules.put("nightly", report, ["n"], cron="@hourly"),
             "schedule 'nightly' belongs to source 'deployment', not 'api': it is left alone"),
            (lambda: schedules.pause("nightly"), "schedule 'nightly' belongs to source 'deployment', not 'api'"),
            (lambda: schedules.retire("nightly"), "schedule 'nightly' belongs to source 'deployment', not 'api'"),
            (lambda: schedules.resume("nobody"), "no schedule 'nobody'"),
        ]:
            with pytest.raises(schedules.ScheduleError, match=message):
                refused()
        assert schedules.pause("nightly", source="deployment").paused  # its owner may
    assert versions(db) == {"nightly": 2, "customer-1": 1}
    plan = plan_json(manifest, db)  # the API's key is not the manifest's business
    assert [(e["key"], e["action"]) for e in plan["entries"]] == [("nightly", "change")]
    assert plan["entries"][0]["changes"] == {"paused": {"from": True, "to": False}}
    refused = cli("schedules", "apply", "-c", write_manifest(tmp_path / "everystep.yaml", manifest_text(
        None, nightly="0 3 * * *", **{"customer-1": "@daily"})), db=db)
    assert refused.returncode == 1 and "'customer-1' (api)" in refused.stderr


# ---------------------------------------------------------------- auto-pause


def test_a_schedule_pauses_itself_after_n_failed_runs_in_a_row(db, clock, caplog, tmp_path):
    FAILING["on"] = True
    clock.set("2026-01-10 00:00:30")
    with clock.connect() as conn, everystep.transaction(conn):
        schedules.put("flaky", flaky, ["f"], cron="* * * * *", auto_pause_after=3, conn=conn)
    minute = 1

    def fire_and_run() -> None:
        nonlocal minute
        clock.set(f"2026-01-10 00:{minute:02d}:05")
        minute += 1
        [fired] = clock.tick()
        assert db.run_pending() == {fired.run_id: "failed" if FAILING["on"] else "completed"}

    fire_and_run()
    fire_and_run()
    FAILING["on"] = False
    fire_and_run()  # a success breaks the streak
    FAILING["on"] = True
    fire_and_run()
    fire_and_run()
    assert schedules.get("flaky", conn=db.connect()).state == "active"
    fire_and_run()  # the third failure in a row
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="everystep"):
        clock.set(f"2026-01-10 00:{minute:02d}:05")
        assert clock.tick() == []  # paused before firing
        assert clock.tick() == []
    minute += 1
    info = schedules.get("flaky", conn=db.connect())
    assert info.state == "auto-paused" and info.paused
    assert info.paused_reason == f"auto-paused: its last 3 runs failed (latest: run {info.last_run_id})"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [  # said once
        f"schedule flaky {info.paused_reason}; resume it with everystep.schedules.resume('flaky') or an apply "
        "that un-pauses it"]

    listing = cli("schedules", "list", "--database-url", clock.url, db=db).stdout.splitlines()
    assert listing[1].split()[:3] == ["flaky", "auto-paused", "api"]
    assert listing[2] == f"flaky: {info.paused_reason}"
    with db.connect() as conn:
        assert everystep.db.auto_paused_schedules(conn) == 1

    # Resumed, it fires again, and the failures before the resume no longer count.
    with clock.connect() as conn, everystep.transaction(conn):
        schedules.resume("flaky")
    fire_and_run()
    fire_and_run()
    assert schedules.get("flaky", conn=db.connect()).state == "active"
    fire_and_run()
    clock.set(f"2026-01-10 00:{minute:02d}:05")
    assert clock.tick() == []
    assert schedules.get("flaky", conn=db.connect()).state == "auto-paused"


def test_a_manifest_schedule_auto_paused_is_resumed_by_a_reviewed_apply(db, clock, tmp_path):
    FAILING["on"] = True
    clock.set("2026-01-10 00:00:30")
    manifest = write_manifest(tmp_path / "everystep.yaml", """
        flaky:
          workflow: tests.test_schedules_owned.flaky
          args: [f]
          cron: "* * * * *"
          auto_pause_after: 1
    """)
    url = ["--database-url", clock.url]
    assert cli(*url, "schedules", "apply", "-c", manifest, db=db).returncode == 0
    clock.set("2026-01-10 00:01:05")
    [fired] = clock.tick()
    assert db.run_pending() == {fired.run_id: "failed"}
    clock.set("2026-01-10 00:02:05")
    assert clock.tick() == []
    plan = cli(*url, "schedules", "plan", "-c", manifest, db=db).stdout.splitlines()
    assert plan[0] == (f"~ flaky: change paused true -> false [it auto-paused: its last run failed (latest: run "
                       f"{fired.run_id})] (next fire 2026-01-10T00:03:00+00:00)")
    digest = plan[-1].removeprefix("digest: ")
    assert cli(*url, "schedules", "apply", "-c", manifest, "--plan-digest", digest, db=db).returncode == 0
    info = schedules.get("flaky", conn=db.connect())
    assert (info.state, info.paused_reason, info.version) == ("active", None, 3)
    clock.set("2026-01-10 00:03:05")
    assert len(clock.tick()) == 1  # fires again; the failure before the apply no longer counts


def test_auto_pause_is_off_by_default_and_set_in_the_manifest(db, clock, tmp_path):
    FAILING["on"] = True
    clock.set("2026-01-10 00:00:30")
    clock.apply(flaky=Schedule("tests.test_schedules_owned.flaky", "* * * * *", args=("f",)))
    for minute in range(1, 6):
        clock.set(f"2026-01-10 00:{minute:02d}:05")
        [fired] = clock.tick()
        assert db.run_pending() == {fired.run_id: "failed"}
    assert schedules.get("flaky", conn=db.connect()).state == "active"

    manifest = write_manifest(tmp_path / "everystep.yaml", """
        flaky:
          workflow: tests.test_schedules_owned.flaky
          args: [f]
          cron: "* * * * *"
          auto_pause_after: 2
    """)
    plan = plan_json(manifest, db, clock.url)
    assert plan["entries"][0]["changes"] == {"auto_pause_after": {"from": None, "to": 2}}


# ---------------------------------------------------------------- JSON outputs


def test_the_json_outputs_carry_what_the_text_shows(db, clock, tmp_path):
    clock.set("2026-01-10 02:00:00")
    manifest = write_manifest(tmp_path / "everystep.yaml", manifest_text("ops", nightly="0 3 * * *"))
    url = ["--database-url", clock.url]
    plan = plan_json(manifest, db, clock.url)
    assert plan == {"source": "ops", "digest": plan["digest"], "entries": [{
        "key": "nightly", "action": "add", "changes": {}, "next_fire_at": "2026-01-10T03:00:00+00:00",
        "paused": False, "version": None, "paused_reason": None}],
        "counts": {"add": 1, "revive": 0, "change": 0, "unchanged": 0, "not_in_file": 0}}
    applied = json.loads(cli(*url, "schedules", "apply", "-c", manifest, "-o", "json", db=db).stdout)
    assert applied == {**plan, "applied": True, "expected_digest": None}

    clock.set("2026-01-10 03:00:05")
    [fired] = clock.tick()
    listed = json.loads(cli(*url, "schedules", "list", "-o", "json", db=db).stdout)
    [row] = listed["schedules"]
    text = cli(*url, "schedules", "list", db=db).stdout.splitlines()[1].split()
    assert [row["key"], row["state"], row["source"], row["timezone"], row["workflow"], row["next_fire_at"],
            row["last_fire_at"], row["last_run_id"], row["last_run_status"]] == [
        text[0], text[1], text[2], text[8], text[9], text[10], text[11], text[12], text[13]]
    assert (row["version"], row["args"], row["cron"]) == (1, ["nightly"], "0 3 * * *")

    runs = json.loads(cli(*url, "runs", "list", "-o", "json", db=db).stdout)
    assert [(r["id"], r["status"], r["name"]) for r in runs] == [(str(fired.run_id), "scheduled", REPORT)]
    shown = json.loads(cli(*url, "runs", "show", str(fired.run_id), "-o", "json", db=db).stdout)
    assert (shown["id"], shown["idempotency_key"], shown["steps"]) == (
        str(fired.run_id), "schedule:nightly:2026-01-10T03:00:00+00:00", [])
    assert cli(*url, "runs", "show", str(fired.run_id), "--json", db=db).stdout == \
        cli(*url, "runs", "show", str(fired.run_id), "-o", "json", db=db).stdout

    retired = json.loads(cli(*url, "schedules", "retire", "nightly", "-c", manifest, "-o", "json", db=db).stdout)
    assert retired == {"key": "nightly", "source": "ops", "retired_at": "2026-01-10T03:00:05+00:00",
                       "forced": False}
    assert json.loads(cli(*url, "schedules", "list", "-o", "json", db=db).stdout) == {"schedules": []}


def test_a_database_of_the_previous_version_migrates_in_place(db):
    """0004 on a database whose schedules predate it: they belong to
    deployment, keep their state and version, and keep firing."""
    with db.connect() as conn:
        conn.execute("DROP TABLE everystep_schedule_run")
        conn.execute("ALTER TABLE everystep_schedule DROP COLUMN source, DROP COLUMN auto_pause_after,"
                     " DROP COLUMN paused_reason")
        conn.execute("DELETE FROM everystep_migration WHERE name = '0004_schedule_sources'")
        conn.execute("INSERT INTO everystep_schedule (key, workflow, args, cron, timezone, catchup, max_catchup,"
                     " overlap, max_lateness_seconds, paused, version, next_fire_at) VALUES ('nightly', %s, '[]',"
                     " '* * * * *', 'UTC', 'fire_once', 10, 'allow', 60, false, 7, date_trunc('minute', now()))",
                     (REPORT,))
        assert everystep.db.migrate(conn) == ["0004_schedule_sources"]
        row = everystep.db.load_schedule(conn, "nightly")
        assert (row["source"], row["version"], row["auto_pause_after"], row["paused_reason"]) == (
            "deployment", 7, None, None)
        assert [f.key for f in scheduler.tick(conn)] == ["nightly"]
        plan = scheduler.plan(conn, Manifest({"nightly": Schedule(REPORT, "* * * * *")}))
        assert [e.action for e in plan.entries] == ["unchanged"]
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("UPDATE everystep_schedule SET auto_pause_after = 0")


def test_the_api_joins_the_django_transaction(db):
    result = subprocess.run([sys.executable, "-m", "tests.apps.django_schedules", db.url], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"put": ["active", 1, ["/tmp"]], "paused": ["paused", 2],
                                         "get": ["paused", "api", 2, ["/tmp"]], "rolled_back": True}
    assert versions(db) == {"customer-1": 2}
