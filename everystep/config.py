"""The config file (everystep.yaml): YAML -> frozen dataclasses. The
supervisor runs from it; the `everystep` CLI reads it with `-c FILE`.

Environment variables are expanded in every string value (never in keys):

    ${VAR}           the variable's value; an error if it is not set (set but empty is fine)
    ${VAR:-default}  the value, or `default` when the variable is unset or empty
    $$               one literal `$`, so `$${VAR}` is the text `${VAR}`
    any other `$`    kept as it is: `pa$word` stays `pa$word`

Defaults are taken literally (they are not expanded again). Where a number or
a boolean is expected, a substituted value is read as a YAML scalar, so
`processes: ${WORKERS:-2}` works; elsewhere (strings, schedule args) it stays
a string.

Every problem — a missing file, a YAML syntax error, an unset variable, an
unknown key, a wrong type, a value out of range — raises `ConfigError`, whose
message is one line: `<file>: <dotted.key>: <problem>`.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import importlib.util
import keyword
import math
import os
import re
import socket
import zoneinfo
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml
from psycopg import conninfo

from everystep import serde
from everystep.errors import EverystepError
from everystep.logs import first_line
from everystep.scheduler import CATCHUP_POLICIES, DEFAULT_SOURCE, OVERLAP_POLICIES, Manifest, Schedule, next_fire_time


class ConfigError(Exception):
    """A problem with the config file. The message is one line naming the file,
    the key and the problem; the supervisor prints it and exits with status 2."""

    def __init__(self, message: str):
        super().__init__(message.replace("\n", " "))


# ---------------------------------------------------------------- the configuration

@dataclass(frozen=True)
class DatabaseConfig:
    url: str = ""  # empty: the supervisor starts an embedded PostgreSQL
    # Set when `url` goes through PgBouncer in transaction mode: straight to
    # PostgreSQL, for what needs a session (workers' control sessions,
    # maintenance, migrations, the HTTP child); the workers' pools use `url`.
    direct_url: str = ""
    # The environment the database must record (`everystep migrate
    # --environment NAME`); empty: any. The CLI with -c and the supervisor
    # refuse another one before they write anything.
    expected_environment: str = ""
    # True: a schema migrated by a newer everystep (migrations this version
    # does not know) is declared compatible; false: migrate, the supervisor
    # and the workers refuse it.
    allow_newer_schema: bool = False


@dataclass(frozen=True)
class WorkersConfig:
    processes: int = 2
    threads: int = 8  # slots for runs of sync workflows: a thread each
    async_slots: int = 100  # slots for runs of async workflows, on one event loop
    poll: float = 1.0
    drain: float = 30.0  # 0: wait for ever
    workflows: tuple[str, ...] | None = None  # name patterns of the workflows these workers run; None: all


@dataclass(frozen=True)
class RecoveryConfig:
    interval: float = 5.0
    grace: float = 10.0
    max_crashes: int = 3


@dataclass(frozen=True)
class HttpConfig:
    bind: str = "0.0.0.0"
    port: int = 9117  # 0: any free port (for tests)


@dataclass(frozen=True)
class LoggingConfig:
    format: str = "text"  # text: one line per record; json: one JSON object per line


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = False  # OpenTelemetry spans, exported with OTLP/HTTP as OTEL_* says (extra `otel`)


@dataclass(frozen=True)
class SentryConfig:
    enabled: bool = False  # report failed and blocked runs to SENTRY_DSN (extra `sentry`)


LOG_FORMATS = ("text", "json")

@dataclass(frozen=True)
class UiConfig:
    """The operators' web UI (`ui:`), served on its own port, never /metrics'."""

    bind: str = "127.0.0.1"
    port: int = 9118  # 0: any free port (for tests)
    viewer_token: str = ""  # e.g. ${EVERYSTEP_UI_VIEWER_TOKEN}: may read (the audit trail says "viewer")
    operator_token: str = ""  # e.g. ${EVERYSTEP_UI_OPERATOR_TOKEN}: may act (the audit trail says "operator")
    users: dict[str, UiUser] = field(default_factory=dict)  # per-person credentials, by the person's name
    # Behind an authenticating proxy (oauth2-proxy, ...): the request header
    # naming the user, honoured only from the addresses of trusted_proxies.
    trusted_user_header: str = ""
    trusted_proxies: tuple[str, ...] = ()  # addresses or CIDRs, e.g. 10.0.0.5, 10.1.0.0/16
    trusted_user_role: str = "viewer"  # the role of a header-named user not in `users`; none: refused


UI_ROLES = ("viewer", "operator")
TRUSTED_USER_ROLES = ("viewer", "operator", "none")
UI_USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}")
HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,99}")


@dataclass(frozen=True)
class UiUser:
    """One person's credential (`ui.users.<name>`): what the audit trail names them."""

    token: str = ""  # e.g. ${EVERYSTEP_UI_TOKEN_ALICE}; empty: only through the trusted proxy's header
    role: str = "viewer"  # viewer: may read; operator: may act too


@dataclass(frozen=True)
class WorkflowConfig:
    """Settings of one workflow by name, overriding its decorator's (each
    only when its key is given; an entry with none of them: no limit)."""
    concurrency: int | None = None  # runs at once across the fleet; None (null): no limit
    priority: int | None = None  # its runs' default priority, -100..100; None (null): the decorator's
    concurrency_per_key: int | None = None  # runs at once per concurrency key; None (null): no limit
    given: frozenset[str] = field(default=frozenset({"concurrency"}),  # the keys the entry has (not a key itself)
                                  metadata={"internal": True})


@dataclass(frozen=True)
class RateLimitConfig:
    """A fleet-wide token bucket (`rate_limits: {name: ...}`) for @step(rate_limit=name)."""
    rate: float  # tokens every `per` seconds
    per: float = 1.0
    burst: int | None = None  # at most this many saved up (and taken in any `per` seconds); None: rate, rounded up


# The manifest's entries are the engine's schedule definitions.
ScheduleConfig = Schedule


@dataclass(frozen=True)
class Config:
    path: Path
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    name: str = field(default_factory=socket.gethostname)  # runners are <name>-<index>
    imports: tuple[str, ...] = ()
    migrate: bool = True
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    schedules: Manifest = field(default_factory=Manifest)  # a dict by key, with its .source
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    sentry: SentryConfig = field(default_factory=SentryConfig)
    ui: UiConfig | None = None  # None: no `ui:` section, no UI served
    workflows: dict[str, WorkflowConfig] = field(default_factory=dict)
    rate_limits: dict[str, RateLimitConfig] = field(default_factory=dict)
    # How long finished runs are kept, in seconds by end status (`retention:`);
    # a status left out is kept for ever (everystep.retention).
    retention: dict[str, float] = field(default_factory=dict)


# Room left after the base name for "-<index>" within the 255 characters of
# `claimed_by`: a dash and six digits.
MAX_NAME = 248
MAX_SCHEDULE_KEY = 200  # "schedule:<key>:<fire time>" must fit an idempotency key (255)
MAX_SOURCE = 100  # the width of everystep_schedule.source
_SCHEDULE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_A_LEAP_YEAR = datetime.datetime(2028, 1, 1, tzinfo=datetime.UTC)
CRON_MACROS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


def check_workflows(config: Config) -> list[str]:
    """What the config names that the code does not have, once its imports
    are imported: a schedule of a workflow nothing defines, of a step, or
    with args that do not fit the workflow's parameters, and a `workflows:`
    key no import defines, each raise ConfigError (they would fire failing
    runs, or limit nothing); a `workers.workflows` pattern that matches no
    imported workflow is returned as a warning line."""
    from everystep import registry  # noqa: PLC0415

    file = str(config.path)
    for i, module in enumerate(config.imports):
        try:
            registry.import_module(module)
        except Exception as exc:  # whatever the module raises while importing
            raise ConfigError(f"{file}: imports[{i}]: cannot import {module}: {type(exc).__name__}: "
                              f"{first_line(exc)}") from None
    for key, schedule in config.schedules.items():
        problem = registry.workflow_problem(schedule.workflow)
        if problem:
            raise ConfigError(f"{file}: schedules.{key}.workflow: {problem}")
        problem = registry.workflow_problem(schedule.workflow, schedule.args)
        if problem:
            raise ConfigError(f"{file}: schedules.{key}.args: {problem}")
    for name in config.workflows:
        problem = registry.workflow_problem(name)
        if problem:
            raise ConfigError(f"{file}: workflows.{name}: {problem}")
    return [f"{file}: workers.workflows: {problem}"
            for problem in unmatched_patterns(config.workers.workflows or (), config.imports)]


def unmatched_patterns(patterns: tuple[str, ...] | list[str], imports: tuple[str, ...] | list[str]) -> list[str]:
    """A line for each workflow name pattern that matches no workflow
    registered (once `imports` are imported): workers that would claim nothing."""
    import fnmatch  # noqa: PLC0415

    from everystep import registry  # noqa: PLC0415

    names = list(registry.WORKFLOWS)
    return [f"the pattern {pattern!r} matches no imported workflow (imports: {', '.join(imports) or 'none'})"
            for pattern in patterns if not fnmatch.filter(names, pattern)]


def worker_options(config: Config | None) -> dict[str, Any]:
    """The `Worker` keyword arguments a config file sets (its defaults for
    None): what the supervisor gives each of its workers, and `everystep
    worker -c FILE` its one. The workflows' limits (`workflows:`) are written
    by every worker when it starts, so a worker without them would put the
    decorators' limits back in force."""
    workers = config.workers if config is not None else WorkersConfig()
    recovery = config.recovery if config is not None else RecoveryConfig()
    workflows = config.workflows if config is not None else {}
    rate_limits = config.rate_limits if config is not None else {}
    return {"threads": workers.threads, "async_slots": workers.async_slots, "poll": workers.poll,
            "drain": workers.drain, "grace": recovery.grace,
            "max_crashes": recovery.max_crashes, "workflows": workers.workflows,
            "limits": {name: settings.concurrency for name, settings in workflows.items()
                       if "concurrency" in settings.given},
            "per_key_limits": {name: settings.concurrency_per_key for name, settings in workflows.items()
                               if "concurrency_per_key" in settings.given},
            "priorities": {name: settings.priority for name, settings in workflows.items()
                           if "priority" in settings.given},
            "rate_limits": {name: (limit.rate, limit.per, limit.burst) for name, limit in rate_limits.items()}}


def maintenance_options(config: Config | None) -> dict[str, Any]:
    """The `Maintenance` keyword arguments a config file sets (its defaults for None)."""
    recovery = config.recovery if config is not None else RecoveryConfig()
    return {"interval": recovery.interval, "grace": recovery.grace, "max_crashes": recovery.max_crashes,
            "retention": dict(config.retention) if config is not None else {}}


def load(path: str | os.PathLike) -> Config:
    """Read, expand and validate a config file."""
    file = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read the file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{file}: cannot read the file: it is not UTF-8 text") from None
    try:
        document = yaml.load(text, Loader=_Loader)  # a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        context = f" ({exc.context})" if exc.problem and exc.context else ""
        raise ConfigError(f"{file}: {where}{exc.problem or exc.context}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML: {exc}") from None
    return _read_config(file, Path(path), _expand(file, "", document))


# ---------------------------------------------------------------- sections

def _read_config(file: str, path: Path, document: Any) -> Config:
    if document is not None and not isinstance(document, dict):
        raise ConfigError(f"{file}: the file must be a mapping of sections, got {_show(document)}")
    top = _Section(file, "", document, Config)
    database = _Section(file, "database", top.raw.get("database"), DatabaseConfig)
    workers = _Section(file, "workers", top.raw.get("workers"), WorkersConfig)
    recovery = _Section(file, "recovery", top.raw.get("recovery"), RecoveryConfig)
    http = _Section(file, "http", top.raw.get("http"), HttpConfig)
    logging = _Section(file, "logging", top.raw.get("logging"), LoggingConfig)
    tracing = _Section(file, "tracing", top.raw.get("tracing"), TracingConfig)
    sentry = _Section(file, "sentry", top.raw.get("sentry"), SentryConfig)
    config = Config(
        path=path,
        database=DatabaseConfig(url=_database_url(database), direct_url=_direct_url(database),
                                expected_environment=_environment_name(database, "expected_environment"),
                                allow_newer_schema=database.boolean("allow_newer_schema")),
        name=_runner_base_name(top),
        imports=tuple(_module_names(top)),
        migrate=top.boolean("migrate"),
        workers=WorkersConfig(
            processes=workers.integer("processes", minimum=1),
            threads=workers.integer("threads", minimum=1),
            async_slots=workers.integer("async_slots", minimum=1),
            poll=workers.number("poll", above=0),
            drain=workers.number("drain", at_least=0),
            workflows=_workflow_patterns(workers),
        ),
        recovery=RecoveryConfig(
            interval=recovery.number("interval", above=0),
            grace=recovery.number("grace", at_least=0),
            max_crashes=recovery.integer("max_crashes", minimum=1),
        ),
        http=HttpConfig(bind=_bind_address(http), port=http.integer("port", minimum=0, maximum=65535)),
        schedules=_schedules(file, top.raw.get("schedules")),
        logging=LoggingConfig(format=logging.choice("format", LOG_FORMATS)),
        tracing=TracingConfig(enabled=_switch(tracing, "otel", "opentelemetry.sdk",
                                              "opentelemetry.exporter.otlp.proto.http")),
        sentry=SentryConfig(enabled=_switch(sentry, "sentry", "sentry_sdk")),
        ui=_ui(file, top.raw),
        workflows=_workflows(file, top.raw.get("workflows")),
        rate_limits=_rate_limits(file, top.raw.get("rate_limits")),
        retention=_retention(file, top.raw.get("retention")),
    )
    if config.ui is not None and config.ui.port == config.http.port != 0:
        raise ConfigError(f"{file}: ui.port: {config.ui.port} is http.port as well: the UI and /metrics each need "
                          f"a port of their own (the UI's default is {UiConfig.port})")
    return config


# A workflow name pattern: a dotted name where `*` stands for any run of
# characters and `?` for one.
WORKFLOW_PATTERN = re.compile(r"[A-Za-z0-9_.*?]+")


def _workflow_patterns(workers: _Section) -> tuple[str, ...] | None:
    if workers.raw.get("workflows") is None:
        return None
    patterns = workers.items("workflows")
    for i, pattern in enumerate(patterns):
        if not isinstance(pattern, str) or len(pattern) > 300 or not WORKFLOW_PATTERN.fullmatch(pattern):
            raise workers.error(f"workflows[{i}]", "must be a workflow name pattern like myapp.gpu.* "
                                                   f"(letters, digits, '_', '.', '*', '?'), got {_show(pattern)}")
    if not patterns:
        raise workers.error("workflows", "must list at least one pattern (leave it out to run every workflow)")
    return tuple(patterns)


def _workflows(file: str, raw: Any) -> dict[str, WorkflowConfig]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: workflows: must be a mapping of workflow names, got {_show(raw)}")
    workflows = {}
    for name, entry in raw.items():
        if not isinstance(name, str) or "." not in name or len(name) > 300 or not _is_dotted_name(name):
            raise ConfigError(f"{file}: workflows: the key {_show(name)} must be the module.qualname of an @workflow")
        section = _Section(file, f"workflows.{name}", entry, WorkflowConfig)
        concurrency = None if section.get("concurrency") is None else section.integer("concurrency", minimum=1)
        per_key = (None if section.get("concurrency_per_key") is None
                   else section.integer("concurrency_per_key", minimum=1))
        priority = None if section.get("priority") is None else section.integer("priority", -100, 100)
        given = frozenset(key for key in ("concurrency", "priority", "concurrency_per_key") if key in section.raw)
        workflows[name] = WorkflowConfig(concurrency=concurrency, priority=priority, concurrency_per_key=per_key,
                                         given=given or frozenset({"concurrency"}))
    return workflows


def _rate_limits(file: str, raw: Any) -> dict[str, RateLimitConfig]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: rate_limits: must be a mapping of rate limit names, e.g. "
                          f"{{stripe: {{rate: 20, per: 1}}}}, got {_show(raw)}")
    limits = {}
    for name, entry in raw.items():
        if not isinstance(name, str) or not name or len(name) > 255:
            raise ConfigError(f"{file}: rate_limits: the key {_show(name)} must be a name of 1 to 255 characters")
        section = _Section(file, f"rate_limits.{name}", entry, RateLimitConfig)
        if section.raw.get("rate") is None:
            raise section.error("rate", "is required: the tokens given every `per` seconds")
        rate = section.number("rate", above=0)
        per = section.number("per", above=0)
        burst = None if section.get("burst") is None else section.integer("burst", minimum=1)
        if burst is None:
            burst = max(1, math.ceil(rate))  # the rate (rounded up to a whole token)
        limits[name] = RateLimitConfig(rate=float(rate), per=float(per), burst=burst)
    return limits


def _retention(file: str, raw: Any) -> dict[str, float]:
    from everystep.retention import RETAINED, parse_duration  # noqa: PLC0415

    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: retention: must be a mapping of end statuses to durations, got {_show(raw)}")
    retention = {}
    for status, value in raw.items():
        if status == "blocked":
            raise ConfigError(f"{file}: retention.blocked: blocked runs wait for an operator and are never "
                              "removed automatically (resolve them: everystep resolve-step)")
        if status not in RETAINED:
            raise ConfigError(f"{file}: retention: the key {_show(status)} must be an end status: "
                              f"{', '.join(RETAINED)}")
        try:
            retention[status] = parse_duration(_scalar(value))
        except ValueError as exc:
            raise ConfigError(f"{file}: retention.{status}: {exc}") from None
    return retention


def _switch(section: _Section, extra: str, *modules: str) -> bool:
    """An `enabled:` switch that needs an extra: refused at load when it is not installed."""
    enabled = section.boolean("enabled")
    if enabled:
        for module in modules:
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                raise section.error("enabled", f"needs {module}, which is not installed: "
                                               f"pip install 'everystep[{extra}]'")
    return enabled


def _database_url(database: _Section, key: str = "url") -> str:
    url = database.text(key)
    if url:
        try:
            conninfo.conninfo_to_dict(url)  # what libpq would refuse when a child connects
        except psycopg.ProgrammingError as exc:
            # libpq quotes the part it trips on, which may be a password: not in the logs.
            problem = re.sub(r'"[^"]*"', lambda quoted: quoted[0] if quoted[0] == '"="' else '"..."',
                             first_line(exc))
            raise database.error(key, f"not a PostgreSQL URL or connection string: {problem}") from None
        problem = port_problem(url)
        if problem:
            raise database.error(key, problem)
    return url


def port_problem(url: str) -> str | None:
    """A port in a PostgreSQL URL that is not a port number (libpq finds out
    only when it connects, as if the server were unreachable); None if none is."""
    ports = str(conninfo.conninfo_to_dict(url).get("port") or "")
    for port in ports.split(","):
        if port and not (port.isdigit() and 1 <= int(port) <= 65535):
            return f"the port {port[:20]!r} is not a port number (1 to 65535)"
    return None


ENVIRONMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _environment_name(section: _Section, key: str) -> str:
    name = section.text(key)
    if name and not ENVIRONMENT_NAME.fullmatch(name):
        raise section.error(key, f"must be 1 to 64 letters, digits, '.', '_' or '-' (like staging or production), "
                                 f"got {_show(name)}")
    return name


def _direct_url(database: _Section) -> str:
    direct_url = _database_url(database, "direct_url")
    if direct_url and not database.text("url"):
        raise database.error("direct_url", "needs database.url (the URL through PgBouncer) as well")
    return direct_url


def _runner_base_name(top: _Section) -> str:
    name = top.text("name") or socket.gethostname()
    if len(name) > MAX_NAME:
        raise top.error("name", f"must be at most {MAX_NAME} characters (runner names are <name>-<index>), "
                                f"got {len(name)}")
    if not name.isprintable() or any(ch.isspace() for ch in name):
        raise top.error("name", f"must be printable characters without whitespace, got {_show(name)}")
    return name


def _module_names(top: _Section) -> list[str]:
    names = top.items("imports")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not _is_dotted_name(name):
            raise top.error(f"imports[{i}]", f"must be a dotted module name like myapp.workflows, got {_show(name)}")
    return [str(name) for name in names]


def _bind_address(http: _Section) -> str:  # http: or ui:
    bind = http.text("bind")
    if not bind or any(ch.isspace() for ch in bind):
        raise http.error("bind", f"must be an address or host name, got {_show(bind)}")
    return bind


def _ui(file: str, raw: dict) -> UiConfig | None:
    if "ui" not in raw:
        return None
    from everystep.ui.core import bind_problem  # noqa: PLC0415

    ui = _Section(file, "ui", raw["ui"], UiConfig)
    header = ui.text("trusted_user_header")
    if header and not HEADER_NAME.fullmatch(header):
        raise ui.error("trusted_user_header", f"must be an HTTP header name like X-Forwarded-User, got {_show(header)}")
    proxies = _trusted_proxies(ui)
    if header and not proxies:
        raise ui.error("trusted_user_header", "needs ui.trusted_proxies: the addresses of the proxies allowed to "
                                              "name the user (a header from anywhere else is ignored)")
    if proxies and not header:
        raise ui.error("trusted_proxies", "only applies with ui.trusted_user_header")
    config = UiConfig(bind=_bind_address(ui), port=ui.integer("port", minimum=0, maximum=65535),
                      viewer_token=ui.text("viewer_token"), operator_token=ui.text("operator_token"),
                      users=_ui_users(ui, bool(header)), trusted_user_header=header, trusted_proxies=proxies,
                      trusted_user_role=ui.choice("trusted_user_role", TRUSTED_USER_ROLES))
    tokens = [t for t in (config.viewer_token, config.operator_token, *(u.token for u in config.users.values())) if t]
    if len(set(tokens)) < len(tokens):
        raise ui.error("users", "two credentials have the same token: each person (and each of viewer_token, "
                                "operator_token) needs a token of their own")
    problem = bind_problem(config.bind, config.viewer_token, config.operator_token,
                           others=bool(config.users or header))
    if problem:
        raise ui.error("bind", problem)
    return config


def _ui_users(ui: _Section, by_header: bool) -> dict[str, UiUser]:
    raw = ui.get("users")
    if raw is None or raw == {}:
        return {}
    if not isinstance(raw, dict):
        raise ui.error("users", "must be a mapping of names to {token: ..., role: viewer|operator}, "
                                f"got {_show(raw)}")
    users = {}
    for name, entry in raw.items():
        if not isinstance(name, str) or not UI_USER_NAME.fullmatch(name):
            raise ui.error("users", f"the name {_show(name)} must be 1 to 100 letters, digits, '.', '_', '@', '+' "
                                    "or '-' (the name the audit trail records)")
        user = _Section(ui.file, f"ui.users.{name}", entry, UiUser)
        token = user.text("token")
        if not token and not by_header:
            raise user.error("token", "is required (a user without one can only come through "
                                      "ui.trusted_user_header)")
        if token and (len(token) < 8 or any(ch.isspace() for ch in token)):
            raise user.error("token", "must be at least 8 characters without whitespace")
        users[name] = UiUser(token=token, role=user.choice("role", UI_ROLES))
    return users


def _trusted_proxies(ui: _Section) -> tuple[str, ...]:
    import ipaddress  # noqa: PLC0415

    proxies = ui.items("trusted_proxies")
    for i, proxy in enumerate(proxies):
        try:
            ipaddress.ip_network(str(proxy), strict=False)
        except ValueError:
            raise ui.error(f"trusted_proxies[{i}]", f"must be an IP address or CIDR like 10.0.0.5 or 10.1.0.0/16, "
                                                    f"got {_show(proxy)}") from None
    return tuple(str(proxy) for proxy in proxies)


def _schedules(file: str, raw: Any) -> Manifest:
    if raw is None:
        return Manifest()
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: schedules: must be a mapping of schedule keys, got {_show(raw)}")
    # `source:` names the manifest's owner; it is not a schedule key.
    source = read_source(f"{file}: schedules.source", raw.get("source", DEFAULT_SOURCE))
    schedules = Manifest(source=source)
    for key, entry in raw.items():
        if key != "source":
            schedules[key] = read_schedule(file, key, entry)
    return schedules


def read_schedule(file: str, key: Any, entry: Any) -> ScheduleConfig:
    """One schedule of the manifest, validated: the manifest's rules, which
    everystep.schedules.put() follows too. `file` starts the error message."""
    if not isinstance(key, str) or len(key) > MAX_SCHEDULE_KEY or not _SCHEDULE_KEY.fullmatch(key):
        raise ConfigError(
            f"{file}: schedules: the key {_show(key)} must be 1 to {MAX_SCHEDULE_KEY} letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    if key == "source":
        raise ConfigError(f"{file}: schedules: the key 'source' is reserved: it names the manifest's owner")
    return _schedule(_Section(file, f"schedules.{key}", entry, ScheduleConfig))


def read_source(label: str, source: Any) -> str:
    """A schedule owner's name: like a key, at most MAX_SOURCE characters.
    `label` starts the error message."""
    if not isinstance(source, str) or len(source) > MAX_SOURCE or not _SCHEDULE_KEY.fullmatch(source):
        raise ConfigError(f"{label}: must be 1 to {MAX_SOURCE} letters, digits, '.', '_' or '-', "
                          f"starting with a letter or digit, got {_show(source)}")
    return str(source)


def _schedule(section: _Section) -> ScheduleConfig:
    workflow = section.text("workflow")
    if "." not in workflow or len(workflow) > 300 or not _is_dotted_name(workflow):
        raise section.error("workflow", f"must be the module.qualname of an @workflow, got {_show(workflow)}")
    catchup = section.choice("catchup", CATCHUP_POLICIES)
    if "max_catchup" in section.raw and catchup != "fire_all":
        raise section.error("max_catchup", f"only applies to catchup: fire_all (this schedule has {catchup})")
    return ScheduleConfig(
        workflow=workflow,
        cron=_cron(section),
        args=_schedule_args(section),
        timezone=_timezone(section),
        catchup=catchup,
        max_catchup=section.integer("max_catchup", minimum=1),
        overlap=section.choice("overlap", OVERLAP_POLICIES),
        max_lateness_seconds=section.number("max_lateness_seconds", above=0),
        paused=section.boolean("paused"),
        auto_pause_after=None if section.get("auto_pause_after") is None
        else section.integer("auto_pause_after", minimum=1),
    )


def _cron(section: _Section) -> str:
    expression = " ".join(section.text("cron").split())
    if not (len(expression.split()) == 5 or expression in CRON_MACROS):
        raise section.error(
            "cron",
            f"must have 5 fields (minute hour day-of-month month day-of-week) or be one of "
            f"{', '.join(CRON_MACROS)}, got {_show(expression)}",
        )
    try:
        next_fire_time(expression, "UTC", _A_LEAP_YEAR)  # also refuses dates that never come (Feb 30)
    except ValueError as exc:  # croniter's errors are ValueErrors
        raise section.error("cron", f"invalid cron expression {_show(expression)}: {exc}") from None
    return expression


def _timezone(section: _Section) -> str:
    name = section.text("timezone")
    try:
        zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise section.error("timezone", f"must be an IANA time zone like UTC or Europe/Paris, got {_show(name)}") \
            from None
    return name


def _schedule_args(section: _Section) -> tuple:
    args = _plain(section.items("args"))
    try:
        serde.dumps(args)
    except EverystepError as exc:
        raise section.error("args", f"cannot be stored: {exc}") from None
    return tuple(args)


def _is_dotted_name(text: str) -> bool:
    return all(part.isidentifier() and not keyword.iskeyword(part) for part in text.split("."))


class _Section:
    """One mapping of the file, read key by key against the fields of a
    dataclass: unknown keys are refused up front, absent keys take the
    field's default, and each reader checks type and range."""

    def __init__(self, file: str, path: str, raw: Any, cls: type):
        self.file = file
        self.path = path
        if raw is None:
            raw = {}  # a section whose keys are all commented out
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: {path}: must be a mapping, got {_show(raw)}")
        self.raw = raw
        self.fields = {f.name: f for f in dataclasses.fields(cls)
                       if f.name != "path" and not f.metadata.get("internal")}
        for key in raw:
            if key not in self.fields:
                raise self.error(str(key), _unknown_key_problem(str(key), list(self.fields)))

    def error(self, key: str, problem: str) -> ConfigError:
        dotted = f"{self.path}.{key}" if self.path else key
        return ConfigError(f"{self.file}: {dotted}: {problem}")

    def get(self, key: str) -> Any:
        if key in self.raw:
            return self.raw[key]
        default = self.fields[key]
        if default.default is not dataclasses.MISSING:
            return default.default
        if default.default_factory is not dataclasses.MISSING:
            return default.default_factory()
        raise self.error(key, "is required")

    def integer(self, key: str, minimum: int, maximum: int | None = None) -> int:
        value = self.get(key)
        number = _scalar(value)
        if type(number) is not int or number < minimum or (maximum is not None and number > maximum):
            wanted = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
            raise self.error(key, f"must be {wanted}, got {_show(value)}")
        return number

    def number(self, key: str, above: float | None = None, at_least: float | None = None) -> float:
        value = self.get(key)
        number = _scalar(value)
        in_range = type(number) in (int, float) and math.isfinite(number) and (
            number > above if above is not None else number >= at_least
        )
        if not in_range:
            wanted = f"> {above:g}" if above is not None else f">= {at_least:g}"
            raise self.error(key, f"must be a number {wanted}, got {_show(value)}")
        return float(number)

    def boolean(self, key: str) -> bool:
        value = self.get(key)
        flag = _scalar(value)
        if type(flag) is not bool:
            raise self.error(key, f"must be true or false, got {_show(value)}")
        return flag

    def text(self, key: str) -> str:
        value = self.get(key)
        if value is None:
            return ""  # `url:` with nothing after it is an empty URL
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {_show(value)}")
        return str(value)

    def choice(self, key: str, choices: tuple[str, ...]) -> str:
        value = self.get(key)
        if value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}, got {_show(value)}")
        return str(value)

    def items(self, key: str) -> list:
        value = self.get(key)
        if value is None or value == ():
            return []
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, got {_show(value)}")
        return value


def _unknown_key_problem(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return f"unknown key (known keys: {', '.join(known)})"


def _show(value: Any) -> str:
    """A value as the problem message shows it: YAML spellings, strings quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return repr(str(value))
    return str(value)


# ---------------------------------------------------------------- environment variables

class _Expanded(str):
    """A string that had a variable substituted: read as a YAML scalar where a
    number or boolean is expected."""


_SUBSTITUTION = re.compile(r"\$\$|\$\{(?P<body>[^}]*)(?P<close>\}?)")
_REFERENCE = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>.*))?", re.DOTALL)


def expand(file: str, key: str, node: Any) -> Any:
    """Environment variables expanded in every string of `node` (found at
    `key` of `file`), as in the config file: ConfigError for an unset one."""
    return _plain(_expand(file, key, node))


def _expand(file: str, key: str, node: Any) -> Any:
    """Expand variables in every string of the document; `key` is where `node` is."""
    if isinstance(node, str):
        return _expand_text(file, key, node)
    if isinstance(node, list):
        return [_expand(file, f"{key}[{i}]", item) for i, item in enumerate(node)]
    if isinstance(node, dict):
        return {k: _expand(file, f"{key}.{k}" if key else str(k), v) for k, v in node.items()}
    return node


def _expand_text(file: str, key: str, text: str) -> str:
    substituted = False

    def replace(match: re.Match) -> str:
        nonlocal substituted
        if match.group(0) == "$$":
            return "$"
        if not match.group("close"):
            raise ConfigError(f"{file}: {key}: unterminated '${{' in {_show(text)}")
        reference = _REFERENCE.fullmatch(match.group("body"))
        if reference is None:
            raise ConfigError(
                f"{file}: {key}: bad substitution {match.group(0)!r} (write ${{VAR}} or ${{VAR:-default}}, "
                "or $$ for a literal $)"
            )
        substituted = True
        value = os.environ.get(reference["name"])
        if reference["default"] is not None:
            return value or reference["default"]
        if value is None:
            raise ConfigError(
                f"{file}: {key}: environment variable {reference['name']} is not set "
                f"(write ${{{reference['name']}:-default}} to give it a default)"
            )
        return value

    expanded = _SUBSTITUTION.sub(replace, text)
    return _Expanded(expanded) if substituted else expanded


def _scalar(value: Any) -> Any:
    """A substituted string as the YAML scalar it spells (int, float, bool);
    anything else unchanged."""
    if not isinstance(value, _Expanded):
        return value
    try:
        parsed = yaml.safe_load(str(value))
    except yaml.YAMLError:
        return value
    return parsed if type(parsed) in (int, float, bool) else value


def _plain(node: Any) -> Any:
    """The document with substituted strings turned back into plain `str`."""
    if isinstance(node, str):
        return str(node)
    if isinstance(node, list):
        return [_plain(item) for item in node]
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    return node


# ---------------------------------------------------------------- YAML

class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain PyYAML
    silently keeps the last one, which hides a misplaced section)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *defaults` may be overridden by the keys beside it
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
