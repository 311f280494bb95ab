"""The supervisor's config file: defaults, environment expansion, and one
exact one-line message for every kind of mistake."""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import sys
import textwrap
import zoneinfo
from pathlib import Path

import pytest

from everystep.config import (
    Config,
    ConfigError,
    DatabaseConfig,
    HttpConfig,
    RecoveryConfig,
    ScheduleConfig,
    WorkersConfig,
    load,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """Work in a temporary folder so messages name the file as `everystep.yaml`."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("ES_TEST_"):
            monkeypatch.delenv(name)
    return tmp_path


def load_text(text: str) -> Config:
    Path("everystep.yaml").write_text(textwrap.dedent(text))
    return load("everystep.yaml")


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as raised:
        load_text(text)
    return str(raised.value)


# ---------------------------------------------------------------- defaults


def test_an_empty_file_gives_the_documented_defaults(config_dir):
    config = load_text("")
    assert config == Config(
        path=Path("everystep.yaml"),
        database=DatabaseConfig(url=""),
        name=socket.gethostname(),
        imports=(),
        migrate=True,
        workers=WorkersConfig(processes=2, threads=8, poll=1.0, drain=30.0),
        recovery=RecoveryConfig(interval=5.0, grace=10.0, max_crashes=3),
        http=HttpConfig(bind="0.0.0.0", port=9117),
        schedules={},
    )


def test_sections_may_be_empty_or_partial(config_dir):
    config = load_text("""
        workers:
        recovery: {grace: 0}
        http:
          port: 0
        name: ""
    """)
    assert config.workers == WorkersConfig()
    assert config.recovery == RecoveryConfig(grace=0.0)
    assert config.http.port == 0  # any free port
    assert config.name == socket.gethostname()


def test_every_key_is_read(config_dir):
    config = load_text("""
        database: {url: "postgresql://db/app"}
        name: web-0
        imports: [myapp.workflows, myapp.billing.flows]
        migrate: false
        workers: {processes: 4, threads: 16, poll: 2, drain: 0}
        recovery: {interval: 1.5, grace: 3, max_crashes: 5}
        http: {bind: "127.0.0.1", port: 9000}
    """)
    assert config.database.url == "postgresql://db/app"
    assert config.name == "web-0"
    assert config.imports == ("myapp.workflows", "myapp.billing.flows")
    assert config.migrate is False
    assert config.workers == WorkersConfig(processes=4, threads=16, poll=2.0, drain=0.0)
    assert isinstance(config.workers.poll, float)  # ints are accepted for floats
    assert config.recovery == RecoveryConfig(interval=1.5, grace=3.0, max_crashes=5)
    assert config.http == HttpConfig(bind="127.0.0.1", port=9000)


def test_the_config_is_frozen(config_dir):
    config = load_text("")
    with pytest.raises(AttributeError):
        config.workers.threads = 3  # type: ignore[misc]


def test_the_shipped_example_runs_the_demo_with_the_defaults(monkeypatch):
    monkeypatch.delenv("EVERYSTEP_DATABASE_URL", raising=False)
    monkeypatch.delenv("POD_NAME", raising=False)
    config = load(ROOT / "everystep.yaml")
    demo = {f"demo-orders-{customer}": ScheduleConfig("everystep.demo.process_order", "* * * * *", (customer,))
            for customer in ("ada", "grace", "linus")}
    assert config == Config(path=ROOT / "everystep.yaml", name=socket.gethostname(), imports=("everystep.demo",),
                            schedules=demo)


def test_the_shipped_example_takes_the_url_and_name_from_the_environment(monkeypatch):
    monkeypatch.setenv("EVERYSTEP_DATABASE_URL", "postgresql://db.internal/app")
    monkeypatch.setenv("POD_NAME", "everystep-3")
    config = load(ROOT / "everystep.yaml")
    assert config.database.url == "postgresql://db.internal/app"
    assert config.name == "everystep-3"


# ---------------------------------------------------------------- environment


def test_variables_are_expanded_in_strings(config_dir, monkeypatch):
    monkeypatch.setenv("ES_TEST_HOST", "db.internal")
    monkeypatch.setenv("ES_TEST_EMPTY", "")
    config = load_text("""
        database: {url: "postgresql://${ES_TEST_HOST}/app?sslmode=${ES_TEST_SSL:-require}"}
        name: ${ES_TEST_EMPTY:-web}${ES_TEST_EMPTY}
        imports: ["${ES_TEST_MODULE:-myapp.flows}"]
    """)
    assert config.database.url == "postgresql://db.internal/app?sslmode=require"
    assert config.name == "web"  # the default also covers a variable set but empty
    assert config.imports == ("myapp.flows",)


def test_dollar_signs_that_are_not_substitutions(config_dir, monkeypatch):
    monkeypatch.setenv("ES_TEST_PASSWORD", "pa$$word")
    config = load_text("""
        database: {url: "host=h password=pa$word application_name='${ES_TEST_PASSWORD} $${ES_TEST_PASSWORD} $$ $'"}
    """)
    # a lone $ stays; $$ is one $; a substituted value is not expanded again
    assert config.database.url == "host=h password=pa$word application_name='pa$$word ${ES_TEST_PASSWORD} $ $'"


def test_substituted_numbers_and_booleans_are_read_as_yaml_scalars(config_dir, monkeypatch):
    monkeypatch.setenv("ES_TEST_WORKERS", "4")
    monkeypatch.setenv("ES_TEST_MIGRATE", "false")
    config = load_text("""
        migrate: ${ES_TEST_MIGRATE}
        workers: {processes: "${ES_TEST_WORKERS}", poll: "${ES_TEST_POLL:-0.5}"}
        http: {port: "${ES_TEST_PORT:-9200}"}
        schedules:
          nightly:
            workflow: myapp.flows.nightly
            cron: "0 3 * * *"
            args: ["${ES_TEST_WORKERS}", 4]
    """)
    assert config.migrate is False
    assert config.workers.processes == 4 and config.workers.poll == 0.5
    assert config.http.port == 9200
    assert config.schedules["nightly"].args == ("4", 4)  # in args a substitution stays a string
    assert type(config.schedules["nightly"].args[0]) is str


def test_a_quoted_number_without_substitution_is_still_a_string(config_dir):
    assert error_of('workers: {processes: "4"}') == (
        "everystep.yaml: workers.processes: must be an integer >= 1, got '4'"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("database: {url: '${ES_TEST_UNSET}'}",
         "database.url: environment variable ES_TEST_UNSET is not set (write ${ES_TEST_UNSET:-default} "
         "to give it a default)"),
        ("imports: [a, '${ES_TEST_UNSET}']", "imports[1]: environment variable ES_TEST_UNSET is not set"),
        ("name: 'web-${ES_TEST_UNSET'", "name: unterminated '${' in 'web-${ES_TEST_UNSET'"),
        ("name: '${1X}'", "name: bad substitution '${1X}' (write ${VAR} or ${VAR:-default}, or $$ for a literal $)"),
        ("name: '${X:=y}'", "name: bad substitution '${X:=y}'"),
        ("workers: {threads: '${ES_TEST_THREADS:-many}'}",
         "workers.threads: must be an integer >= 1, got 'many'"),
    ],
)
def test_substitution_errors(config_dir, text, message):
    assert error_of(text).startswith(f"everystep.yaml: {message}")


# ---------------------------------------------------------------- mistakes, one line each


@pytest.mark.parametrize(
    "text, message",
    [
        # types and ranges
        ("workers: {threads: eight}", "workers.threads: must be an integer >= 1, got 'eight'"),
        ("workers: {threads: 0}", "workers.threads: must be an integer >= 1, got 0"),
        ("workers: {processes: true}", "workers.processes: must be an integer >= 1, got true"),
        ("workers: {processes: 2.5}", "workers.processes: must be an integer >= 1, got 2.5"),
        ("workers: {processes: null}", "workers.processes: must be an integer >= 1, got null"),
        ("workers: {poll: 0}", "workers.poll: must be a number > 0, got 0"),
        ("workers: {poll: fast}", "workers.poll: must be a number > 0, got 'fast'"),
        ("workers: {poll: .nan}", "workers.poll: must be a number > 0, got nan"),
        ("workers: {drain: -1}", "workers.drain: must be a number >= 0, got -1"),
        ("workers: {drain: .inf}", "workers.drain: must be a number >= 0, got inf"),
        ("workers: {drain: false}", "workers.drain: must be a number >= 0, got false"),
        ("recovery: {interval: 0}", "recovery.interval: must be a number > 0, got 0"),
        ("recovery: {grace: -0.5}", "recovery.grace: must be a number >= 0, got -0.5"),
        ("recovery: {max_crashes: 0}", "recovery.max_crashes: must be an integer >= 1, got 0"),
        ("http: {port: 70000}", "http.port: must be an integer from 0 to 65535, got 70000"),
        ("http: {port: -1}", "http.port: must be an integer from 0 to 65535, got -1"),
        ("http: {port: '9117'}", "http.port: must be an integer from 0 to 65535, got '9117'"),
        ("http: {bind: ''}", "http.bind: must be an address or host name, got ''"),
        ("http: {bind: [a]}", "http.bind: must be a string, got a list"),
        ("migrate: 'yes'", "migrate: must be true or false, got 'yes'"),
        ("migrate: 1", "migrate: must be true or false, got 1"),
        ("database: {url: 5432}", "database.url: must be a string, got 5432"),
        ("database: {url: localhost}", 'database.url: not a PostgreSQL URL or connection string: missing "=" '
                                       'after "..." in connection info string'),
        ("database: {url: 'postgresql://u:se cret@h/app'}", "database.url: not a PostgreSQL URL or connection "
         'string: unexpected spaces found in "...", use percent-encoded spaces (%20) instead'),
        ("database: {url: 'host=h colour=blue'}",
         'database.url: not a PostgreSQL URL or connection string: invalid connection option "..."'),
        # the runner name
        ("name: web 0", "name: must be printable characters without whitespace, got 'web 0'"),
        ("name: \"web\\t0\"", "name: must be printable characters without whitespace, got 'web\\t0'"),
        (f"name: {'w' * 249}", "name: must be at most 248 characters (runner names are <name>-<index>), got 249"),
        ("name: 12", "name: must be a string, got 12"),
        # imports
        ("imports: myapp.workflows", "imports: must be a list, got 'myapp.workflows'"),
        ("imports: [my-app.flows]", "imports[0]: must be a dotted module name like myapp.workflows, "
                                    "got 'my-app.flows'"),
        ("imports: [ok, class.flows]", "imports[1]: must be a dotted module name like myapp.workflows, "
                                       "got 'class.flows'"),
        ("imports: [3]", "imports[0]: must be a dotted module name like myapp.workflows, got 3"),
        # structure
        ("workers: {thread: 8}", "workers.thread: unknown key (did you mean 'threads'?)"),
        ("wokers: {}", "wokers: unknown key (did you mean 'workers'?)"),
        ("colour: red", "colour: unknown key (known keys: database, name, imports, migrate, workers, recovery, "
                        "http, schedules, logging, tracing, sentry, ui, workflows, rate_limits, retention)"),
        ("workers: [1, 2]", "workers: must be a mapping, got a list"),
        ("http: 9117", "http: must be a mapping, got 9117"),
    ],
)
def test_mistakes(config_dir, text, message):
    assert error_of(text) == f"everystep.yaml: {message}"


def test_the_file_must_be_a_mapping(config_dir):
    assert error_of("- workers") == "everystep.yaml: the file must be a mapping of sections, got a list"


def test_a_missing_file(config_dir):
    with pytest.raises(ConfigError) as raised:
        load("nowhere.yaml")
    assert str(raised.value) == "nowhere.yaml: cannot read the file: No such file or directory"


def test_a_file_that_is_not_text(config_dir):
    Path("everystep.yaml").write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ConfigError) as raised:
        load("everystep.yaml")
    assert str(raised.value) == "everystep.yaml: cannot read the file: it is not UTF-8 text"


def test_yaml_syntax_errors_give_line_and_column(config_dir):
    message = error_of("""\
        workers:
          threads: 8
         processes: 2
    """)
    assert message.startswith("everystep.yaml: line 3, column ")
    assert "\n" not in message


def test_an_unclosed_bracket(config_dir):
    assert error_of("imports: [a, b\nname: x\n").startswith("everystep.yaml: line 2, column ")


def test_a_key_given_twice_is_an_error(config_dir):
    message = error_of("""\
        workers: {threads: 4}
        http: {port: 1}
        workers: {threads: 8}
    """)
    assert message == "everystep.yaml: line 3, column 1: duplicate key 'workers'"


def test_merge_keys_may_be_overridden(config_dir):
    config = load_text("""
        schedules:
          hourly: &report {workflow: myapp.flows.report, cron: "0 * * * *"}
          daily: {<<: *report, cron: "0 3 * * *"}
    """)
    assert config.schedules["daily"] == ScheduleConfig(workflow="myapp.flows.report", cron="0 3 * * *")


# ---------------------------------------------------------------- schedules


def test_a_schedule_with_every_key(config_dir):
    config = load_text("""
        schedules:
          nightly-cleanup:
            workflow: myapp.maintenance.cleanup
            args: [{"older_than_days": 30}, 2026-01-02, [1, 2]]
            cron: "0   3 * * *"
            timezone: Europe/Paris
            catchup: fire_all
            max_catchup: 5
            overlap: forbid
            max_lateness_seconds: 3600
            paused: true
          hourly.report:
            workflow: myapp.reports.Hourly.run
            cron: "@hourly"
    """)
    assert config.schedules == {
        "nightly-cleanup": ScheduleConfig(
            workflow="myapp.maintenance.cleanup",
            args=({"older_than_days": 30}, dt.date(2026, 1, 2), [1, 2]),
            cron="0 3 * * *",
            timezone="Europe/Paris",
            catchup="fire_all",
            max_catchup=5,
            overlap="forbid",
            max_lateness_seconds=3600.0,
            paused=True,
        ),
        "hourly.report": ScheduleConfig(
            workflow="myapp.reports.Hourly.run", cron="@hourly", args=(), timezone="UTC", catchup="fire_once",
            max_catchup=10, overlap="allow", max_lateness_seconds=60.0, paused=False,
        ),
    }


GOOD = "workflow: myapp.flows.nightly, cron: '0 3 * * *'"


@pytest.mark.parametrize(
    "entry, message",
    [
        ("{cron: '0 3 * * *'}", "schedules.s.workflow: is required"),
        ("{workflow: myapp.flows.nightly}", "schedules.s.cron: is required"),
        ("{workflow: nightly, cron: '0 3 * * *'}",
         "schedules.s.workflow: must be the module.qualname of an @workflow, got 'nightly'"),
        ("{workflow: myapp.flows.<locals>.f, cron: '0 3 * * *'}",
         "schedules.s.workflow: must be the module.qualname of an @workflow, got 'myapp.flows.<locals>.f'"),
        ("{workflow: myapp.flows.nightly, cron: '0 3 * *'}",
         "schedules.s.cron: must have 5 fields (minute hour day-of-month month day-of-week) or be one of "
         "@yearly, @annually, @monthly, @weekly, @daily, @midnight, @hourly, got '0 3 * *'"),
        ("{workflow: myapp.flows.nightly, cron: '0 0 3 * * *'}", "schedules.s.cron: must have 5 fields"),
        ("{workflow: myapp.flows.nightly, cron: '61 3 * * *'}",
         "schedules.s.cron: invalid cron expression '61 3 * * *': [61 3 * * *] is not acceptable, out of range"),
        ("{workflow: myapp.flows.nightly, cron: '0 3 30 2 *'}",
         "schedules.s.cron: invalid cron expression '0 3 30 2 *': failed to find next date"),
        ("{workflow: myapp.flows.nightly, cron: 3}", "schedules.s.cron: must be a string, got 3"),
        (f"{{{GOOD}, timezone: Mars/Olympus}}",
         "schedules.s.timezone: must be an IANA time zone like UTC or Europe/Paris, got 'Mars/Olympus'"),
        (f"{{{GOOD}, timezone: ../etc/passwd}}", "schedules.s.timezone: must be an IANA time zone"),
        (f"{{{GOOD}, catchup: always}}", "schedules.s.catchup: must be one of skip, fire_once, fire_all, got 'always'"),
        (f"{{{GOOD}, max_catchup: 3}}",
         "schedules.s.max_catchup: only applies to catchup: fire_all (this schedule has fire_once)"),
        (f"{{{GOOD}, catchup: fire_all, max_catchup: 0}}", "schedules.s.max_catchup: must be an integer >= 1, got 0"),
        (f"{{{GOOD}, overlap: never}}", "schedules.s.overlap: must be one of allow, forbid, got 'never'"),
        (f"{{{GOOD}, max_lateness_seconds: 0}}", "schedules.s.max_lateness_seconds: must be a number > 0, got 0"),
        (f"{{{GOOD}, paused: 'no'}}", "schedules.s.paused: must be true or false, got 'no'"),
        (f"{{{GOOD}, args: {{a: 1}}}}", "schedules.s.args: must be a list, got a mapping"),
        (f"{{{GOOD}, args: [!!set {{a: null}}]}}", "schedules.s.args: cannot be stored: "),
        (f"{{{GOOD}, args: [.nan]}}", "schedules.s.args: cannot be stored: cannot store the float nan"),
        (f"{{{GOOD}, state: paused}}", "schedules.s.state: unknown key (known keys: workflow, cron, args"),
        ("daily", "schedules.s: must be a mapping, got 'daily'"),
    ],
)
def test_schedule_mistakes(config_dir, entry, message):
    assert error_of(f"schedules:\n  s: {entry}\n").startswith(f"everystep.yaml: {message}")


def test_time_zones_do_not_need_the_hosts_time_zone_database(config_dir):
    # A slim container may have no /usr/share/zoneinfo: the tzdata package serves.
    zoneinfo.ZoneInfo.clear_cache()
    zoneinfo.reset_tzpath(to=[])
    try:
        config = load_text(f"schedules:\n  s: {{{GOOD}, timezone: America/Sao_Paulo}}\n")
    finally:
        zoneinfo.reset_tzpath()
    assert config.schedules["s"].timezone == "America/Sao_Paulo"


@pytest.mark.parametrize("key", ["a b", "-lead", "has:colon", "x" * 201, "é"])
def test_schedule_keys_are_restricted(config_dir, key):
    assert error_of(f"schedules:\n  '{key}': {{{GOOD}}}\n") == (
        f"everystep.yaml: schedules: the key {key!r} must be 1 to 200 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit"
    )


def test_schedules_must_be_a_mapping(config_dir):
    assert error_of("schedules: [a]") == "everystep.yaml: schedules: must be a mapping of schedule keys, got a list"


# ---------------------------------------------------------------- the everystep CLI reads -c FILE


def cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "everystep.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )


def cli_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "EVERYSTEP_DATABASE_URL"}
    return {**env, **extra}


def test_cli_migrate_takes_the_database_url_from_the_config_file(db, tmp_path):
    with db.connect() as conn:  # an empty schema, so migrate has something to do
        conn.execute(f"DROP SCHEMA {db.schema} CASCADE")
        conn.execute(f"CREATE SCHEMA {db.schema}")
    config = tmp_path / "everystep.yaml"
    config.write_text("database:\n  url: ${ES_TEST_CONFIG_URL}\n")
    done = cli("-c", str(config), "migrate", env=cli_env(ES_TEST_CONFIG_URL=db.url))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("applied 0001_initial")
    assert db.value("SELECT count(*) FROM everystep_migration") >= 1


def test_cli_reports_a_bad_config_file_in_one_line(tmp_path):
    config = tmp_path / "everystep.yaml"
    config.write_text("workers:\n  threads: eight\n")
    done = cli("-c", str(config), "migrate", env=cli_env())
    assert done.returncode == 2
    assert done.stderr == f"everystep: {config}: workers.threads: must be an integer >= 1, got 'eight'\n"


def test_the_documented_manifest_example_is_valid(config_dir):
    section = (ROOT / "docs" / "schedules.md").read_text()
    example = section[section.index("```yaml\n") + len("```yaml\n"):section.index("```\n")]
    schedules = load_text(example).schedules
    assert schedules["nightly-cleanup"] == ScheduleConfig(
        workflow="myapp.maintenance.cleanup", args=({"older_than_days": 30},), cron="30 2 * * *",
        timezone="Europe/Paris", catchup="fire_once", overlap="forbid", max_lateness_seconds=3600.0,
        auto_pause_after=3,
    )
    assert schedules.source == "ops"
    assert schedules["hourly-report"] == ScheduleConfig(
        workflow="myapp.reports.hourly", args=("sales",), cron="@hourly", paused=True
    )


def test_ui_section(tmp_path, monkeypatch):
    from everystep.config import ConfigError, UiConfig, load  # noqa: PLC0415

    def config(text: str):
        path = tmp_path / "everystep.yaml"
        path.write_text(text)
        return load(path)

    assert config("name: a\n").ui is None  # no section: no UI
    assert config("ui:\n").ui == UiConfig()
    monkeypatch.setenv("EVERYSTEP_UI_OPERATOR_TOKEN", "s3cret-token-of-the-operators")
    ui = config("ui:\n  bind: 0.0.0.0\n  port: 0\n  operator_token: ${EVERYSTEP_UI_OPERATOR_TOKEN}\n").ui
    assert ui == UiConfig(bind="0.0.0.0", port=0, operator_token="s3cret-token-of-the-operators")
    with pytest.raises(ConfigError, match=r"ui\.bind: bind '0\.0\.0\.0' is not a loopback address"):
        config("ui:\n  bind: 0.0.0.0\n")
    with pytest.raises(ConfigError, match=r"ui\.bind: bind 'example\.com' is not a loopback"):
        config("ui:\n  bind: example.com\n  viewer_token: ''\n")
    with pytest.raises(ConfigError, match=r"ui\.tokens: unknown key"):
        config("ui:\n  tokens: x\n")
    with pytest.raises(ConfigError, match=r"ui\.port: must be an integer from 0 to 65535"):
        config("ui:\n  port: 70000\n")
