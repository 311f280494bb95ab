"""The right database, every time: `everystep --context NAME` takes the
database URL and the environment it must be from a contexts file, and every
command checks the environment the database records (`everystep migrate
--environment NAME`) before it writes anything.

The contexts file is `~/.config/everystep/contexts.yaml`, or the file
`EVERYSTEP_CONTEXTS` names:

    contexts:
      staging:
        url: postgresql://everystep@db.staging/everystep
        environment: staging
      production:
        url: ${EVERYSTEP_PRODUCTION_URL}
        environment: production

Environment variables are expanded in its values as in everystep.yaml.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psycopg

from everystep import db
from everystep.cli.errors import CliError

CONTEXT_KEYS = ("url", "environment")


@dataclass(frozen=True)
class Context:
    name: str
    url: str
    environment: str | None  # None: the context expects no environment in particular
    file: str


def contexts_file() -> Path:
    """The contexts file: $EVERYSTEP_CONTEXTS, else ~/.config/everystep/contexts.yaml."""
    named = os.environ.get("EVERYSTEP_CONTEXTS")
    if named:
        return Path(named)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "everystep" / "contexts.yaml"


def environment_name(text: str, what: str) -> str:
    """An environment's name, checked: letters, digits, '.', '_', '-' (at most 64)."""
    from everystep.config import ENVIRONMENT_NAME  # noqa: PLC0415

    if not isinstance(text, str) or not ENVIRONMENT_NAME.fullmatch(text):
        shown = repr(text) if isinstance(text, str) else type(text).__name__
        raise CliError(f"{what}: an environment is 1 to 64 letters, digits, '.', '_' or '-' "
                       f"(like staging or production), not {shown}")
    return text


def load_context(name: str) -> Context:
    """The context `name` of the contexts file, validated (a mistake is one line, exit 2)."""
    import yaml  # noqa: PLC0415

    from everystep.config import ConfigError, expand  # noqa: PLC0415

    path = contexts_file()
    file = str(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"--context {name}: no contexts file {file} (write one, or name it with "
                       "EVERYSTEP_CONTEXTS)") from None
    except OSError as exc:
        raise CliError(f"{file}: cannot read the file: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CliError(f"{file}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(document, dict) or not isinstance(document.get("contexts"), dict) or \
            set(document) != {"contexts"}:
        raise CliError(f"{file}: must be a mapping with one key, contexts: {{NAME: {{url: ..., environment: ...}}}}")
    contexts = document["contexts"]
    if name not in contexts:
        known = ", ".join(sorted(str(k) for k in contexts)) or "none"
        raise CliError(f"--context {name}: no such context in {file} (known: {known})")
    entry = contexts[name]
    if not isinstance(entry, dict):
        raise CliError(f"{file}: contexts.{name}: must be a mapping with url and environment")
    unknown = [str(key) for key in entry if key not in CONTEXT_KEYS]
    if unknown:
        raise CliError(f"{file}: contexts.{name}.{unknown[0]}: unknown key (known keys: {', '.join(CONTEXT_KEYS)})")
    try:
        entry = expand(file, f"contexts.{name}", entry)
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    url = entry.get("url")
    if not isinstance(url, str) or not url:
        raise CliError(f"{file}: contexts.{name}.url: is required (the database's PostgreSQL URL)")
    environment = entry.get("environment")
    if environment is not None:
        environment = environment_name(environment, f"{file}: contexts.{name}.environment")
    return Context(name, url, environment, file)


def refusal(recorded: str | None, expected: str, why: str) -> str | None:
    """Why a command expecting `expected` (`why`: from where) must not act on
    a database recording `recorded`; None when it may."""
    if recorded == expected:
        return None
    if recorded is None:
        return (f"{why} expects the environment {expected!r}, but this database records none: nothing done "
                f"(record it with `everystep migrate --environment {expected}`)")
    return f"{why} expects the environment {expected!r}, but this database is {recorded!r}: nothing done"


def check(conn: psycopg.Connection, expected: str | None, why: str) -> str | None:
    """The environment the database records, after refusing (CliError, exit
    2) when it is not `expected` (None: anything goes)."""
    try:
        recorded = db.recorded_environment(conn)
    except psycopg.errors.InsufficientPrivilege:
        if expected is None:
            return None  # roles granted before the table existed: nothing expected, nothing to say
        raise CliError(f"{why} expects the environment {expected!r}, but this role may not read it: nothing done "
                       "(everystep roles --apply grants it)") from None
    if expected is not None:
        problem = refusal(recorded, expected, why)
        if problem:
            raise CliError(problem)
    return recorded
