"""Every bad input refused, tried as a new user would: config files, CLI
commands, API calls and UI requests. Each case asserts the exit status (or
the exception, or the HTTP status), that the message is one line naming the
problem, and that nothing was written: a digest of every row of the runs,
steps, schedules, audit trail and environment tables is the same before and
after. One database (seeded once with a run in each state that matters, a
schedule and an environment) serves all the cases."""

from __future__ import annotations

import datetime
import json
import textwrap
import uuid

import pytest
import yaml

import everystep
import everystep.db
from everystep import schedules
from everystep.config import ConfigError, check_workflows, load
from everystep.errors import EverystepError
from everystep.testing import server
from tests.apps import cli_workflows
from tests.apps.cli_workflows import greet, shout
from tests.conftest import Database
from tests.support.inprocess import run_cli as cli
from tests.support.ui_process import Client, UiProcess

UNKNOWN = "0190e1f4-0000-7000-8000-000000000000"
ALICE = "alice-token-0123456789"  # an operator
BOB = "bob-token-0123456789"  # a viewer
TABLES = ("everystep_workflow", "everystep_step", "everystep_schedule", "everystep_audit", "everystep_environment")


class World:
    """The seeded database: a scheduled run S, a completed run C (with its
    step 1 done), a cancelled run X, a blocked run B (step 1 started), a
    keyed run K (greet("ada"), key k1), the schedule `nightly` of the source
    `deployment`, the environment `staging`; and a UI serving it."""

    def __init__(self, database: Database):
        self.db = database
        with database.connect() as conn, everystep.transaction(conn):
            self.S = everystep.schedule(greet, "sam").id
            self.K = everystep.schedule(greet, "ada", idempotency_key="k1").id
            schedules.put("nightly", greet, ["nightly"], cron="@daily", source="deployment")
            everystep.db.record_environment(conn, "staging", "tests")
        self.C, self.X, self.B = (uuid.uuid4() for _ in range(3))
        for run, name, status in [(self.C, "tests.apps.cli_workflows.greet", "completed"),
                                  (self.X, "tests.apps.cli_workflows.greet", "cancelled"),
                                  (self.B, "tests.apps.ui_workflows.charge_then_ship", "blocked")]:
            database.query("INSERT INTO everystep_workflow (id, name, args, status, completed_at) VALUES"
                           " (%s, %s, '[\"x\"]', %s, CASE WHEN %s IN ('completed', 'cancelled') THEN now() END)"
                           " RETURNING id", (run, name, status, status))
        database.query("INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result) VALUES"
                       " (%s, '1', 'tests.apps.cli_workflows.shout', '[\"x\"]', '{}', 'done', '\"X\"'),"
                       " (%s, '1', 'tests.apps.ui_workflows.charge', '[\"x\"]', '{}', 'started', NULL)"
                       " RETURNING id", (self.C, self.B))

    def fill(self, value):
        """`value` with {S}, {C}, ... replaced by the seeded runs' ids, in every string of it."""
        if isinstance(value, dict):
            return {k: self.fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.fill(v) for v in value]
        if isinstance(value, str):
            for name in ("S", "C", "X", "B", "K"):
                value = value.replace("{" + name + "}", str(getattr(self, name)))
            value = value.replace("{UNKNOWN}", UNKNOWN)
        return value

    def digest(self) -> dict:
        """Every row of every table that a command could write, as a digest."""
        return {table: self.db.value(f"SELECT count(*) || ':' || coalesce(md5(string_agg(t::text, '|' ORDER BY"
                                     f" t::text)), '') FROM {table} t") for table in TABLES}


@pytest.fixture(scope="module")
def world(server_url, tmp_path_factory):
    database = Database(server_url, server.create_schema(server_url, prefix="t_"))
    try:
        yield World(database)
    finally:
        server.drop(database, server_url)


@pytest.fixture
def unchanged(world):
    """Asserts, after the test, that nothing was written."""
    before = world.digest()
    yield
    assert world.digest() == before, "a refused input wrote something"


def one_line(message: str, needle: str) -> None:
    assert "\n" not in message.strip() and message.strip(), message
    assert needle in message, (needle, message)


# ---------------------------------------------------------------- the CLI

@pytest.fixture
def clean_env(monkeypatch, tmp_path, world):
    for name in ("EVERYSTEP_DATABASE_URL", "EVERYSTEP_UI_VIEWER_TOKEN", "EVERYSTEP_UI_OPERATOR_TOKEN",
                 "EVERYSTEP_OPERATOR"):
        monkeypatch.delenv(name, raising=False)
    contexts = tmp_path / "contexts.yaml"
    contexts.write_text(yaml.safe_dump({"contexts": {
        "staging": {"url": world.db.url, "environment": "staging"},
        "production": {"url": world.db.url, "environment": "production"}}}))
    monkeypatch.setenv("EVERYSTEP_CONTEXTS", str(contexts))
    return tmp_path


# The config cases: a file given to `everystep schedules apply -c FILE`
# (loaded, then what it names checked against the code, before the database
# is touched). The imports of the valid parts: the CLI tests' workflows.
GOOD_SCHEDULE = "{workflow: tests.apps.cli_workflows.greet, args: [x], cron: '@daily'}"
CONFIG_CASES = [
    ("schedule-of-no-module", "schedules: {a: {workflow: no_such_module.report, cron: '@daily'}}",
     "schedules.a.workflow: no module defines no_such_module.report"),
    ("schedule-of-no-function", "schedules: {a: {workflow: tests.apps.cli_workflows.nope, cron: '@daily'}}",
     "schedules.a.workflow: no module defines"),
    ("schedule-of-a-step", "schedules: {a: {workflow: tests.apps.cli_workflows.shout, args: [x], cron: '@daily'}}",
     "is a @step, not a @workflow"),
    ("schedule-of-a-class", "schedules: {a: {workflow: tests.apps.cli_workflows.Crash, cron: '@daily'}}",
     "is not an @workflow function"),
    ("schedule-args-missing", "schedules: {a: {workflow: tests.apps.cli_workflows.greet, cron: '@daily'}}",
     "schedules.a.args: tests.apps.cli_workflows.greet(name): missing a required argument: 'name'"),
    ("schedule-args-too-many",
     "schedules: {a: {workflow: tests.apps.cli_workflows.greet, args: [1, 2, 3], cron: '@daily'}}",
     "too many positional arguments"),
    ("schedule-args-not-a-list",
     "schedules: {a: {workflow: tests.apps.cli_workflows.greet, args: 5, cron: '@daily'}}",
     "schedules.a.args: must be a list"),
    ("schedule-workflow-not-dotted", "schedules: {a: {workflow: greet, cron: '@daily'}}",
     "schedules.a.workflow: must be the module.qualname"),
    ("schedule-no-workflow", "schedules: {a: {cron: '@daily'}}", "schedules.a.workflow: is required"),
    ("schedule-no-cron", "schedules: {a: {workflow: tests.apps.cli_workflows.greet, args: [x]}}",
     "schedules.a.cron: is required"),
    ("cron-three-fields", "schedules: {a: {workflow: tests.apps.cli_workflows.greet, args: [x], cron: '* * *'}}",
     "schedules.a.cron: must have 5 fields"),
    ("cron-minute-61", "schedules: {a: {workflow: tests.apps.cli_workflows.greet, args: [x], cron: '61 * * * *'}}",
     "schedules.a.cron: invalid cron expression"),
    ("cron-february-30",
     "schedules: {a: {workflow: tests.apps.cli_workflows.greet, args: [x], cron: '0 0 30 2 *'}}",
     "schedules.a.cron"),
    ("cron-unknown-macro",
     "schedules: {a: {workflow: tests.apps.cli_workflows.greet, args: [x], cron: '@fortnightly'}}",
     "schedules.a.cron"),
    ("timezone-unknown", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", timezone: Mars/Olympus}}",
     "schedules.a.timezone: must be an IANA time zone"),
    ("catchup-unknown", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", catchup: sometimes}}",
     "schedules.a.catchup: must be one of"),
    ("max-catchup-without-fire-all", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", max_catchup: 3}}",
     "schedules.a.max_catchup: only applies to catchup: fire_all"),
    ("max-catchup-zero", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", catchup: fire_all, max_catchup: 0}}",
     "schedules.a.max_catchup: must be an integer >= 1"),
    ("overlap-unknown", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", overlap: sometimes}}",
     "schedules.a.overlap: must be one of"),
    ("lateness-zero", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", max_lateness_seconds: 0}}",
     "schedules.a.max_lateness_seconds: must be a number > 0"),
    ("paused-not-boolean", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", paused: maybe}}",
     "schedules.a.paused: must be true or false"),
    ("auto-pause-zero", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", auto_pause_after: 0}}",
     "schedules.a.auto_pause_after: must be an integer >= 1"),
    ("schedule-unknown-key", "schedules: {a: " + GOOD_SCHEDULE[:-1] + ", crn: '@daily'}}",
     "schedules.a.crn: unknown key (did you mean 'cron'?)"),
    ("schedule-key-bad", "schedules: {'-a': " + GOOD_SCHEDULE + "}", "schedules: the key '-a' must be"),
    ("schedule-key-reserved", "schedules: {source: {workflow: x.y}}", "schedules.source: must be 1 to 100"),
    ("schedule-source-bad", "schedules: {source: 'not ok', a: " + GOOD_SCHEDULE + "}",
     "schedules.source: must be 1 to 100"),
    ("schedules-a-list", "schedules: [1, 2]", "schedules: must be a mapping of schedule keys"),
    ("schedule-not-a-mapping", "schedules: {a: 5}", "schedules.a: must be a mapping"),
    ("url-port-99999", "database: {url: 'postgresql://u@db.example:99999/app'}",
     "database.url: the port '99999' is not a port number (1 to 65535)"),
    ("url-port-0-in-a-list", "database: {url: 'postgresql://u@a:5432,b:0/app'}",
     "database.url: the port '0' is not a port number"),
    ("url-garbage", "database: {url: 'host'}", "database.url: not a PostgreSQL URL or connection string"),
    ("url-not-a-string", "database: {url: 5}", "database.url: must be a string"),
    ("direct-url-alone", "database: {direct_url: 'postgresql://u@h/app'}",
     "database.direct_url: needs database.url"),
    ("expected-environment-bad", "database: {expected_environment: 'pro duction'}",
     "database.expected_environment: must be 1 to 64 letters"),
    ("workflows-of-no-module", "workflows: {no_such_module.report: {concurrency: 2}}",
     "workflows.no_such_module.report: no module defines no_such_module.report"),
    ("workflows-of-a-step", "workflows: {tests.apps.cli_workflows.shout: {concurrency: 2}}",
     "workflows.tests.apps.cli_workflows.shout: tests.apps.cli_workflows.shout is a @step"),
    ("workflows-key-not-dotted", "workflows: {greet: {concurrency: 2}}",
     "workflows: the key 'greet' must be the module.qualname"),
    ("workflows-concurrency-zero", "workflows: {tests.apps.cli_workflows.greet: {concurrency: 0}}",
     "workflows.tests.apps.cli_workflows.greet.concurrency: must be an integer >= 1"),
    ("workflows-unknown-setting", "workflows: {tests.apps.cli_workflows.greet: {concurency: 2}}",
     "unknown key (did you mean 'concurrency'?)"),
    ("imports-missing-module", "imports: [no_such_module_at_all]",
     "imports[0]: cannot import no_such_module_at_all"),
    ("imports-not-dotted", "imports: ['my app']", "imports[0]: must be a dotted module name"),
    ("workers-processes-zero", "workers: {processes: 0}", "workers.processes: must be an integer >= 1"),
    ("workers-threads-text", "workers: {threads: many}", "workers.threads: must be an integer >= 1"),
    ("workers-poll-negative", "workers: {poll: -1}", "workers.poll: must be a number > 0"),
    ("workers-drain-text", "workers: {drain: soon}", "workers.drain: must be a number >= 0"),
    ("workers-workflows-empty", "workers: {workflows: []}", "workers.workflows: must list at least one pattern"),
    ("workers-workflows-bad-pattern", "workers: {workflows: ['my app/*']}", "workers.workflows[0]: must be"),
    ("recovery-max-crashes-zero", "recovery: {max_crashes: 0}", "recovery.max_crashes: must be an integer >= 1"),
    ("recovery-grace-negative", "recovery: {grace: -5}", "recovery.grace: must be a number >= 0"),
    ("http-port-70000", "http: {port: 70000}", "http.port: must be an integer from 0 to 65535"),
    ("http-bind-blank", "http: {bind: ' '}", "http.bind: must be an address"),
    ("ui-port-negative", "ui: {port: -1}", "ui.port: must be an integer from 0 to 65535"),
    ("ui-port-is-the-http-port", "http: {port: 9200}\nui: {port: 9200}",
     "ui.port: 9200 is http.port as well: the UI and /metrics each need a port of their own"),
    ("ui-port-is-the-default-http-port", "ui: {port: 9117}", "ui.port: 9117 is http.port as well"),
    ("ui-open-bind-without-credentials", "ui: {bind: 0.0.0.0}", "ui.bind: bind '0.0.0.0' is not a loopback"),
    ("ui-user-without-token", "ui: {users: {bob: {role: viewer}}}", "ui.users.bob.token: is required"),
    ("ui-user-role-unknown", "ui: {users: {bob: {token: bob-token-0123, role: admin}}}",
     "ui.users.bob.role: must be one of viewer, operator"),
    ("ui-user-token-short", "ui: {users: {bob: {token: abc}}}", "ui.users.bob.token: must be at least 8"),
    ("ui-user-name-bad", "ui: {users: {'bob smith': {token: bob-token-0123}}}", "ui.users: the name 'bob smith'"),
    ("ui-user-unknown-key", "ui: {users: {bob: {token: bob-token-0123, rol: viewer}}}",
     "ui.users.bob.rol: unknown key (did you mean 'role'?)"),
    ("ui-users-a-list", "ui: {users: [bob]}", "ui.users: must be a mapping of names"),
    ("ui-two-people-one-token",
     "ui: {users: {ann: {token: same-token-0123}, bob: {token: same-token-0123}}}",
     "ui.users: two credentials have the same token"),
    ("ui-user-token-is-the-operator-token",
     "ui: {operator_token: same-token-0123, users: {bob: {token: same-token-0123}}}",
     "two credentials have the same token"),
    ("ui-header-without-proxies", "ui: {trusted_user_header: X-Forwarded-User}",
     "ui.trusted_user_header: needs ui.trusted_proxies"),
    ("ui-proxies-without-header", "ui: {trusted_proxies: [10.0.0.1]}",
     "ui.trusted_proxies: only applies with ui.trusted_user_header"),
    ("ui-proxy-not-an-address", "ui: {trusted_user_header: X-User, trusted_proxies: [proxy.internal]}",
     "ui.trusted_proxies[0]: must be an IP address or CIDR"),
    ("ui-header-name-bad", "ui: {trusted_user_header: 'X User', trusted_proxies: [10.0.0.1]}",
     "ui.trusted_user_header: must be an HTTP header name"),
    ("ui-trusted-role-unknown",
     "ui: {trusted_user_header: X-User, trusted_proxies: [10.0.0.1], trusted_user_role: admin}",
     "ui.trusted_user_role: must be one of viewer, operator, none"),
    ("top-level-unknown-key", "schedule: {}", "schedule: unknown key (did you mean 'schedules'?)"),
    ("top-level-a-list", "- a\n- b", "the file must be a mapping of sections"),
    ("duplicate-key", "workers: {processes: 1}\nworkers: {processes: 2}", "duplicate key 'workers'"),
    ("yaml-syntax", "workers: {processes: 1", "line "),
    ("unset-variable", "database: {url: '${NOT_SET_ANYWHERE_XYZ}'}",
     "database.url: environment variable NOT_SET_ANYWHERE_XYZ is not set"),
    ("bad-substitution", "database: {url: '${1BAD}'}", "bad substitution"),
    ("logging-format", "logging: {format: xml}", "logging.format: must be one of text, json"),
    ("name-with-space", "name: 'web 1'", "name: must be printable characters without whitespace"),
    ("migrate-not-boolean", "migrate: sometimes", "migrate: must be true or false"),
    ("allow-newer-schema-not-boolean", "database: {allow_newer_schema: maybe}",
     "database.allow_newer_schema: must be true or false"),
    ("tracing-not-boolean", "tracing: {enabled: sometimes}", "tracing.enabled: must be true or false"),
]


@pytest.mark.parametrize(("text", "needle"), [case[1:] for case in CONFIG_CASES],
                         ids=[case[0] for case in CONFIG_CASES])
def test_a_bad_config_is_one_line_and_writes_nothing(world, clean_env, unchanged, text, needle):
    path = clean_env / "everystep.yaml"
    prefix = "" if "imports:" in text or text.startswith("- ") else "imports: [tests.apps.cli_workflows]\n"
    path.write_text(prefix + text + "\n")
    for command in ("plan", "apply"):
        code, out, err = cli("--database-url", world.db.url, "schedules", command, "-c", str(path))
        assert (code, out) == (2, ""), (command, err)
        assert err.startswith(f"everystep: {path}: ")
        one_line(err, needle)
    # The supervisor's reading of it says the same (load, then what the code lacks).
    with pytest.raises(ConfigError) as refused:
        check_workflows(load(path))
    one_line(str(refused.value), needle)


def test_a_workers_pattern_that_matches_nothing_is_a_warning(world, clean_env, unchanged):
    path = clean_env / "everystep.yaml"
    path.write_text("imports: [tests.apps.cli_workflows]\nworkers: {workflows: [tests.apps.cli_workflows.*, "
                    "myapp.gpu.*]}\n")
    assert check_workflows(load(path)) == [
        f"{path}: workers.workflows: the pattern 'myapp.gpu.*' matches no imported workflow "
        "(imports: tests.apps.cli_workflows)"]
    code, _, err = cli("--database-url", world.db.url, "schedules", "plan", "-c", str(path))
    assert code == 0 and err == f"everystep: warning: {path}: workers.workflows: the pattern 'myapp.gpu.*' " \
                                "matches no imported workflow (imports: tests.apps.cli_workflows)\n"


# The CLI cases: (argv, exit status, what the line names). {S}, {C}, ...: the seeded runs.
CLI_CASES = [
    ("list-unknown-workflow", "runs list --workflow no.such.wf", 2, "--workflow no.such.wf: no run has that name"),
    ("list-status-bogus", "runs list --status bogus", 2, "invalid choice: 'bogus'"),
    ("list-limit-zero", "runs list --limit 0", 2, "expected a whole number of at least 1"),
    ("list-parent-not-an-id", "runs list --parent 12", 2, "'12' is not a run id"),
    ("show-not-an-id", "runs show 12", 2, "'12' is not a run id"),
    ("show-unknown", "runs show {UNKNOWN}", 2, f"no run {UNKNOWN}"),
    ("export-nothing", "runs export", 2, "runs export takes run ids, or a filter"),
    ("export-unknown", "runs export {UNKNOWN}", 2, UNKNOWN),
    ("export-unknown-workflow", "runs export --workflow no.such.wf", 2, "--workflow no.such.wf: no run has"),
    ("schedule-not-module-func", "schedule greet", 2, "expected MODULE:FUNC"),
    ("schedule-no-module", "schedule no_such_module_xyz:greet", 2, "cannot import no_such_module_xyz"),
    ("schedule-no-function", "schedule tests.apps.cli_workflows:nope", 2, "has no 'nope'"),
    ("schedule-a-step", "schedule tests.apps.cli_workflows:shout '\"x\"'", 2, "is not an @workflow"),
    ("schedule-too-many-args", "schedule tests.apps.cli_workflows:greet 1 2", 2, "too many positional arguments"),
    ("schedule-missing-arg", "schedule tests.apps.cli_workflows:greet", 2, "missing a required argument: 'name'"),
    ("schedule-not-json", "schedule tests.apps.cli_workflows:greet {ann", 2, "is not valid JSON"),
    ("schedule-nan", "schedule tests.apps.cli_workflows:greet NaN", 2, "NaN is not JSON"),
    ("schedule-bad-tagged-value", "schedule tests.apps.cli_workflows:greet '{\"$es\": \"date\", \"v\": \"x\"}'",
     2, "is not a valid everystep value"),
    ("schedule-key-other-args", "schedule tests.apps.cli_workflows:greet '\"bob\"' --idempotency-key k1", 2,
     "has the idempotency key 'k1' with other arguments ([\"ada\"], not [\"bob\"])"),
    ("schedule-key-too-long", "schedule tests.apps.cli_workflows:greet '\"a\"' --idempotency-key " + "k" * 300, 2,
     "idempotency_key must be a string of at most"),
    ("resolve-not-an-id", "resolve-step 12 1 --discard", 2, "'12' is not a run id"),
    ("resolve-unknown-run", "resolve-step {UNKNOWN} 1 --discard", 2, f"no run {UNKNOWN}"),
    ("resolve-unknown-step", "resolve-step {B} 9 --discard", 2, "has no step '9'"),
    ("resolve-no-outcome", "resolve-step {B} 1", 2, "one of the arguments --result --error --discard is required"),
    ("resolve-two-outcomes", "resolve-step {B} 1 --discard --error boom", 2, "not allowed with argument"),
    ("resolve-result-not-json", "resolve-step {B} 1 --result {x", 2, "is not valid JSON"),
    ("resolve-a-completed-run", "resolve-step {C} 1 --discard", 1, "not blocked"),
    ("requeue-a-scheduled-run", "requeue {S}", 1, "is scheduled: it needs nothing"),
    ("requeue-a-completed-run", "requeue {C}", 1, "is completed: a finished run is never requeued"),
    ("requeue-unknown", "requeue {UNKNOWN}", 2, f"no run {UNKNOWN}"),
    ("requeue-not-an-id", "requeue nope", 2, "'nope' is not a run id"),
    ("cancel-a-completed-run", "cancel {C}", 1, "is completed already"),
    ("cancel-a-cancelled-run", "cancel {X}", 1, "is cancelled already"),
    ("cancel-unknown", "cancel {UNKNOWN}", 2, f"no run {UNKNOWN}"),
    ("cancel-one-unknown-of-two", "cancel {S} {UNKNOWN}", 2, f"no run {UNKNOWN}"),
    ("cancel-one-finished-of-two", "cancel {S} {C}", 1, "nothing was cancelled"),
    ("cancel-not-an-id", "cancel 12", 2, "'12' is not a run id"),
    ("reschedule-unknown", "reschedule {UNKNOWN}", 2, f"no run {UNKNOWN}"),
    ("reschedule-one-unknown-of-two", "reschedule {S} {UNKNOWN}", 2, f"no run {UNKNOWN}"),
    ("reschedule-not-an-id", "reschedule x", 2, "'x' is not a run id"),
    ("prune-zero-days", "prune --older-than 0", 2, "expected a whole number from 1 to 36500"),
    ("prune-too-many-days", "prune --older-than 36501", 2, "expected a whole number from 1 to 36500"),
    ("prune-not-a-number", "prune --older-than soon", 2, "expected a whole number"),
    ("prune-no-bound", "prune", 2, "nothing to prune: give --older-than DAYS, or -c FILE with a `retention:` section"),
    ("plan-without-manifest", "schedules plan", 2, "schedules plan needs the manifest: -c everystep.yaml"),
    ("apply-without-manifest", "schedules apply", 2, "schedules apply needs the manifest"),
    ("retire-bad-source", "schedules retire nightly --source 'no way'", 2, "--source: must be 1 to 100"),
    ("retire-of-another-source", "schedules retire nightly --source api", 1, "belongs to source 'deployment'"),
    ("retire-unknown", "schedules retire nope", 1, "no schedule 'nope'"),
    ("schedules-list-bogus-output", "schedules list -o yaml", 2, "invalid choice: 'yaml'"),
    ("migrate-bad-environment", "migrate --environment 'pro duction'", 2, "an environment is 1 to 64 letters"),
    ("migrate-force-alone", "migrate --force", 2, "--force only goes with --environment"),
    ("migrate-another-environment", "migrate --environment production", 2,
     "this database is recorded as 'staging', not 'production'"),
    ("context-unknown", "--context nope runs list", 2, "--context nope: no such context"),
    ("context-of-another-environment", "--context production cancel {S}", 2,
     "--context production expects the environment 'production', but this database is 'staging'"),
    ("context-and-url", "--context staging --database-url postgresql://x/y runs list", 2,
     "--database-url and --context staging both name a database"),
    ("context-expects-another-environment", "--context production migrate --environment staging", 2,
     "--environment staging, but --context production expects 'production'"),
    ("url-port-99999", "--database-url postgresql://u@127.0.0.1:99999/x runs list", 2, "99999"),
    ("url-garbage", "--database-url 'host' runs list", 2, "bad database URL"),
    ("config-missing", "-c /nonexistent/everystep.yaml runs list", 2, "cannot read the file"),
    ("worker-empty-name", "worker --name ''", 2, "--name"),
    ("worker-negative-drain", "worker --name w --drain -1", 2, "expected a number of seconds >= 0"),
    ("maintenance-grace-text", "maintenance --grace soon", 2, "expected a number of seconds >= 0"),
    ("ui-open-bind-without-tokens", "ui --bind 0.0.0.0", 2, "bind '0.0.0.0' is not a loopback address"),
    ("roles-bad-prefix", "roles --prefix 1-bad", 2, "expected letters, digits and '_'"),
    ("replay-check-missing-file", "replay-check /nonexistent/history.json", 2, "/nonexistent/history.json"),
    ("unknown-command", "frobnicate", 2, "invalid choice: 'frobnicate'"),
    ("no-command", "", 2, "the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize(("argv", "code", "needle"), [case[1:] for case in CLI_CASES],
                         ids=[case[0] for case in CLI_CASES])
def test_a_bad_command_is_one_line_and_writes_nothing(world, clean_env, unchanged, argv, code, needle):
    import shlex  # noqa: PLC0415

    words = shlex.split(world.fill(argv))
    if "--database-url" not in words and "--context" not in words:
        words = ["--database-url", world.db.url, *words]
    status, out, err = cli(*words)
    assert (status, out) == (code, ""), err
    assert err.startswith("everystep"), err
    one_line(err, needle)


# ---------------------------------------------------------------- the API

def _local_workflow():
    @everystep.workflow
    def inner():
        return 1


API_CASES = [
    ("schedule-too-many-args-is-an-everystep-error", lambda: everystep.schedule(greet, 1, 2, 3), EverystepError,
     "too many positional arguments"),
    ("schedule-too-many-args", lambda: everystep.schedule(greet, 1, 2, 3), TypeError,
     "schedule(): tests.apps.cli_workflows.greet(name): too many positional arguments (given 3 arguments)"),
    ("schedule-missing-arg", lambda: everystep.schedule(greet), TypeError, "missing a required argument: 'name'"),
    ("schedule-a-step", lambda: everystep.schedule(shout, "x"), TypeError, "schedule() takes an @workflow function"),
    ("schedule-a-plain-function", lambda: everystep.schedule(print, "x"), TypeError, "takes an @workflow function"),
    ("schedule-unstorable-arg", lambda: everystep.schedule(greet, object()), EverystepError, "object"),
    ("schedule-key-not-text", lambda: everystep.schedule(greet, "x", idempotency_key=5), EverystepError,
     "idempotency_key must be a string"),
    ("schedule-at-and-after", lambda: everystep.schedule(greet, "x", at=datetime.datetime.now(datetime.UTC),
                                                         after=5), EverystepError, "at= or after=, not both"),
    ("schedule-at-naive", lambda: everystep.schedule(greet, "x", at=datetime.datetime(2030, 1, 1)), EverystepError,
     "at=..."),
    ("schedule-after-negative", lambda: everystep.schedule(greet, "x", after=-1), EverystepError, "after=..."),
    ("schedule-many-too-many-args", lambda: everystep.schedule_many(greet, [("a",), ("a", "b")]), TypeError,
     "schedule_many() run 1: tests.apps.cli_workflows.greet(name): too many positional arguments"),
    ("schedule-many-not-tuples", lambda: everystep.schedule_many(greet, ["a"]), EverystepError,
     "each must be a tuple or list"),
    ("schedule-many-a-string", lambda: everystep.schedule_many(greet, "abc"), EverystepError,
     "takes a list of argument tuples"),
    ("schedule-many-keys-count", lambda: everystep.schedule_many(greet, [("a",)], idempotency_keys=["k", "l"]),
     EverystepError, "idempotency_keys has 2 keys for 1 runs"),
    ("workflow-inside-a-function", _local_workflow, EverystepError,
     "_local_workflow.<locals>.inner is defined inside a function"),
    ("workflow-concurrency-zero", lambda: everystep.workflow(concurrency=0), EverystepError,
     "concurrency must be a whole number >= 1"),
    ("put-args-missing", lambda: schedules.put("k", greet, [], cron="@daily"), schedules.ScheduleError,
     "schedule 'k': tests.apps.cli_workflows.greet(name): missing a required argument: 'name'"),
    ("put-args-too-many", lambda: schedules.put("k", greet, [1, 2], cron="@daily"), schedules.ScheduleError,
     "too many positional arguments"),
    ("put-name-of-no-module", lambda: schedules.put("k", "no_such_module.report", [], cron="@daily"),
     schedules.ScheduleError, "no module defines no_such_module.report"),
    ("put-name-of-a-step", lambda: schedules.put("k", "tests.apps.cli_workflows.shout", ["x"], cron="@daily"),
     schedules.ScheduleError, "is a @step, not a @workflow"),
    ("put-name-with-args-that-do-not-fit",
     lambda: schedules.put("k", "tests.apps.cli_workflows.greet", [], cron="@daily"), schedules.ScheduleError,
     "missing a required argument"),
    ("put-a-step-function", lambda: schedules.put("k", shout, ["x"], cron="@daily"), schedules.ScheduleError,
     "is not an @workflow function"),
    ("put-bad-cron", lambda: schedules.put("k", greet, ["x"], cron="every day"), schedules.ScheduleError,
     "schedules.k.cron: must have 5 fields"),
    ("put-bad-key", lambda: schedules.put("-k", greet, ["x"], cron="@daily"), schedules.ScheduleError,
     "the key '-k' must be"),
    ("put-bad-timezone", lambda: schedules.put("k", greet, ["x"], cron="@daily", timezone="Mars/Olympus"),
     schedules.ScheduleError, "must be an IANA time zone"),
    ("put-bad-source", lambda: schedules.put("k", greet, ["x"], cron="@daily", source="no way"),
     schedules.ScheduleError, "source: must be 1 to 100"),
    ("put-bad-catchup", lambda: schedules.put("k", greet, ["x"], cron="@daily", catchup="sometimes"),
     schedules.ScheduleError, "catchup: must be one of"),
    ("put-max-catchup-without-fire-all", lambda: schedules.put("k", greet, ["x"], cron="@daily", max_catchup=2),
     schedules.ScheduleError, "only applies to catchup: fire_all"),
    ("put-of-another-source", lambda: schedules.put("nightly", greet, ["x"], cron="@hourly"),
     schedules.ScheduleError, "belongs to source 'deployment', not 'api'"),
    ("pause-unknown", lambda: schedules.pause("nobody"), schedules.ScheduleError, "no schedule 'nobody'"),
    ("retire-of-another-source", lambda: schedules.retire("nightly"), schedules.ScheduleError,
     "belongs to source 'deployment'"),
]


def test_a_malformed_plan_digest_is_not_a_changed_plan(world, clean_env, unchanged):
    path = clean_env / "everystep.yaml"
    path.write_text(f"imports: [tests.apps.cli_workflows]\nschedules: {{a: {GOOD_SCHEDULE}}}\n")
    code, out, err = cli("--database-url", world.db.url, "schedules", "apply", "-c", str(path),
                         "--plan-digest", "nonsense")
    assert (code, out) == (2, ""), err
    one_line(err, "argument --plan-digest: 'nonsense' is not a plan digest (sha256: and 64 hex digits, as "
                  "`everystep schedules plan` prints it)")
    assert "changed" not in err


@pytest.mark.parametrize(("call", "error", "needle"), [case[1:] for case in API_CASES],
                         ids=[case[0] for case in API_CASES])
def test_a_bad_api_call_raises_one_line_and_writes_nothing(world, unchanged, call, error, needle):
    with world.db.connect() as conn:
        with pytest.raises(error) as raised, everystep.transaction(conn):
            call()
            conn.commit()  # what the call wrote, were it to write anything
    one_line(str(raised.value), needle)


# ---------------------------------------------------------------- the UI

@pytest.fixture(scope="module")
def ui_url(world, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ui")
    config = folder / "everystep.yaml"
    config.write_text(yaml.safe_dump({"ui": {"port": 0, "users": {
        "alice": {"token": ALICE, "role": "operator"}, "bob": {"token": BOB, "role": "viewer"},
        "dave": {"role": "operator"}}, "trusted_user_header": "X-Forwarded-User",
        "trusted_proxies": ["10.9.9.9"]}}))
    process = UiProcess(world.db.url, folder, args=("-c", str(config)),
                        env={"EVERYSTEP_UI_VIEWER_TOKEN": "", "EVERYSTEP_UI_OPERATOR_TOKEN": ""})
    try:
        yield process.url
    finally:
        process.close()


# (method, path, body, token, status, what the error names); bodies as text are sent raw.
UI_CASES = [
    ("cancel-a-completed-run", "POST", "/api/actions/cancel", {"runs": ["{C}"]}, ALICE, 409,
     "nothing done: {C}: already completed"),
    ("cancel-a-cancelled-run", "POST", "/api/actions/cancel", {"runs": ["{X}"]}, ALICE, 409,
     "nothing done: {X}: already cancelled"),
    ("cancel-finished-runs", "POST", "/api/actions/cancel", {"runs": ["{C}", "{X}"]}, ALICE, 409,
     "(and 1 more refused)"),
    ("cancel-unknown", "POST", "/api/actions/cancel", {"runs": [UNKNOWN]}, ALICE, 404, f"no run {UNKNOWN}"),
    ("cancel-filter-of-finished-runs", "POST", "/api/actions/cancel", {"filter": {"status": "completed"}}, ALICE,
     409, "already completed"),
    ("reschedule-unknown", "POST", "/api/actions/reschedule", {"runs": [UNKNOWN]}, ALICE, 404,
     f"nothing done: no run {UNKNOWN}"),
    ("requeue-a-scheduled-run", "POST", "/api/actions/requeue", {"runs": ["{S}"]}, ALICE, 409,
     "is scheduled: it needs nothing"),
    ("requeue-unknown", "POST", "/api/actions/requeue", {"runs": [UNKNOWN]}, ALICE, 404, f"no run {UNKNOWN}"),
    ("cancel-no-runs", "POST", "/api/actions/cancel", {"runs": []}, ALICE, 400, "runs must be a list of 1 to"),
    ("cancel-runs-not-a-list", "POST", "/api/actions/cancel", {"runs": "{S}"}, ALICE, 400, "runs must be a list"),
    ("cancel-not-an-id", "POST", "/api/actions/cancel", {"runs": ["12"]}, ALICE, 400, "'12' is not a run id"),
    ("cancel-filter-not-an-object", "POST", "/api/actions/cancel", {"filter": "all"}, ALICE, 400,
     "filter must be an object"),
    ("cancel-filter-bad-status", "POST", "/api/actions/cancel", {"filter": {"status": "bogus"}}, ALICE, 400,
     "status must be one of"),
    ("cancel-filter-until-before-since", "POST", "/api/actions/cancel",
     {"filter": {"since": "2026-02-01", "until": "2026-01-01"}}, ALICE, 400, "until"),
    ("cancel-reason-not-text", "POST", "/api/actions/cancel", {"runs": ["{S}"], "reason": 5}, ALICE, 400,
     "reason must be a string"),
    ("body-not-json", "POST", "/api/actions/cancel", "{nope", ALICE, 400, "the request body must be JSON"),
    ("body-a-list", "POST", "/api/actions/cancel", ["{S}"], ALICE, 400, "must be a JSON object"),
    ("unknown-action", "POST", "/api/actions/drop", {}, ALICE, 404, "no action 'drop'"),
    ("a-viewer-acts", "POST", "/api/actions/cancel", {"runs": ["{S}"]}, BOB, 403, "viewers cannot act"),
    ("no-credential", "POST", "/api/actions/cancel", {"runs": ["{S}"]}, None, 401, "token is needed"),
    ("wrong-token", "POST", "/api/actions/cancel", {"runs": ["{S}"]}, "guess-0123456789", 401, "token is needed"),
    ("header-from-an-untrusted-address", "POST", "/api/actions/cancel", {"runs": ["{S}"]}, "header:dave", 401,
     "token is needed"),
    ("send-empty-topic", "POST", "/api/actions/send", {"run": "{S}", "topic": " "}, ALICE, 400,
     "topic is empty: name the topic the run waits for"),
    ("resolve-outcome-bogus", "POST", "/api/actions/resolve", {"run": "{B}", "step": "1", "outcome": "maybe"},
     ALICE, 400, "outcome must be result, error or discard"),
    ("resolve-no-step", "POST", "/api/actions/resolve", {"run": "{B}", "outcome": "discard"}, ALICE, 400,
     "step must be a step id"),
    ("resolve-result-not-json", "POST", "/api/actions/resolve",
     {"run": "{B}", "step": "1", "outcome": "result", "value": "{x"}, ALICE, 400, "result is not a valid"),
    ("resolve-result-not-text", "POST", "/api/actions/resolve",
     {"run": "{B}", "step": "1", "outcome": "result", "value": 5}, ALICE, 400, "result must be JSON text"),
    ("resolve-empty-error", "POST", "/api/actions/resolve",
     {"run": "{B}", "step": "1", "outcome": "error", "value": ""}, ALICE, 400, "error must be a message"),
    ("resolve-a-completed-run", "POST", "/api/actions/resolve", {"run": "{C}", "step": "1", "outcome": "discard"},
     ALICE, 409, "not blocked"),
    ("resolve-unknown-step", "POST", "/api/actions/resolve", {"run": "{B}", "step": "9", "outcome": "discard"},
     ALICE, 409, "has no step '9'"),
    ("resolve-unknown-run", "POST", "/api/actions/resolve", {"run": UNKNOWN, "step": "1", "outcome": "discard"},
     ALICE, 409, f"no run {UNKNOWN}"),
    ("resolve-not-an-id", "POST", "/api/actions/resolve", {"run": "x", "step": "1", "outcome": "discard"},
     ALICE, 400, "'x' is not a run id"),
    ("schedule-verb-bogus", "POST", "/api/actions/schedule", {"key": "nightly", "verb": "delete"}, ALICE, 400,
     "verb one of pause, resume, fire"),
    ("schedule-fire-unknown", "POST", "/api/actions/schedule", {"key": "nope", "verb": "fire"}, ALICE, 409,
     "nope"),
    ("schedule-pause-unknown", "POST", "/api/actions/schedule", {"key": "nope", "verb": "pause"}, ALICE, 409,
     "no live schedule 'nope'"),
    ("runs-until-before-since", "GET", "/api/runs?since=2026-02-01&until=2026-01-01", None, BOB, 400,
     "until (2026-01-01T00:00:00Z) must be after since (2026-02-01T00:00:00Z)"),
    ("runs-until-equals-since", "GET", "/api/runs?since=2026-02-01&until=2026-02-01", None, BOB, 400,
     "must be after since"),
    ("runs-since-not-a-time", "GET", "/api/runs?since=yesterday", None, BOB, 400,
     "since: 'yesterday' is not an ISO time"),
    ("runs-status-bogus", "GET", "/api/runs?status=bogus", None, BOB, 400, "status must be one of"),
    ("runs-limit-zero", "GET", "/api/runs?limit=0", None, BOB, 400, "limit must be a whole number from 1 to 500"),
    ("runs-limit-huge", "GET", "/api/runs?limit=501", None, BOB, 400, "limit must be a whole number"),
    ("runs-args-not-json", "GET", "/api/runs?q=%7Bnope", None, BOB, 400, "args search must be JSON"),
    ("runs-before-not-an-id", "GET", "/api/runs?before=2026-01-01T00:00:00Z%7Cnope", None, BOB, 400,
     "is not a run id"),
    ("run-not-an-id", "GET", "/api/runs/nope", None, BOB, 400, "'nope' is not a run id"),
    ("run-unknown", "GET", f"/api/runs/{UNKNOWN}", None, BOB, 404, f"no run {UNKNOWN}"),
    ("failures-window-bogus", "GET", "/api/failures?window=year", None, BOB, 400, "window must be one of"),
    ("audit-run-not-an-id", "GET", "/api/audit?run=nope", None, BOB, 400, "'nope' is not a run id"),
    ("audit-before-not-an-id", "GET", "/api/audit?before=x", None, BOB, 400, "before must be an audit record id"),
    ("audit-action-bogus", "GET", "/api/audit?action=drop%20table", None, BOB, 400, "action must be"),
    ("read-without-credential", "GET", "/api/runs", None, None, 401, "token is needed"),
]


@pytest.mark.parametrize(("method", "path", "body", "token", "status", "needle"), [case[1:] for case in UI_CASES],
                         ids=[case[0] for case in UI_CASES])
def test_a_bad_ui_request_is_one_line_and_writes_nothing(world, ui_url, unchanged, method, path, body, token,
                                                         status, needle):
    headers = {}
    if token and token.startswith("header:"):
        headers["X-Forwarded-User"] = token.removeprefix("header:")  # from 127.0.0.1: not a trusted proxy
        token = None
    client = Client(ui_url, token)
    if isinstance(body, str):
        import urllib.request  # noqa: PLC0415

        request = urllib.request.Request(ui_url + path, data=world.fill(body).encode(), method=method,
                                         headers={**client.headers, "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=20)
            got, answer = 200, {}
        except urllib.error.HTTPError as error:
            got, answer = error.code, json.loads(error.read())
    else:
        got, answer = client.request(method, path, world.fill(body), headers=headers)
    assert got == status, answer
    one_line(answer["error"], world.fill(needle))


def test_a_browser_session_without_the_csrf_token_is_refused(world, ui_url, unchanged):
    browser = Client(ui_url)
    assert browser.request("POST", "/login", form={"token": ALICE})[0] == 200
    status, answer = browser.request("POST", "/api/actions/cancel", {"runs": [str(world.S)]})
    assert status == 403
    one_line(answer["error"], "CSRF token missing or wrong")


TOUR_SCRIPT = """
import sys

import psycopg

import everystep


@everystep.workflow
def provision_vm(name):
    return name


with psycopg.connect(sys.argv[1]) as conn, everystep.transaction(conn):
    try:
        everystep.schedule(provision_vm, "vm-1")
    except everystep.EverystepError as exc:
        sys.exit(str(exc))
"""


def test_scheduling_a_workflow_of_the_script_being_run_is_refused(world, unchanged, tmp_path):
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    script = tmp_path / "tour.py"
    script.write_text(TOUR_SCRIPT)
    done = subprocess.run([sys.executable, str(script), world.db.url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr == (
        "schedule(): provision_vm is defined in the script being run (__main__), a name no worker can import: "
        "define the workflow in a module (myapp/flows.py, say), import it from the script, and give the worker "
        "that module (imports:, --import)\n")


def test_the_corpus_is_large(world):
    assert len(CONFIG_CASES) + len(CLI_CASES) + len(API_CASES) + len(UI_CASES) >= 100
    assert textwrap and cli_workflows  # the modules the cases name are imported here
