"""The migration applier: the numbered files of everystep/migrations/, each
applied once, in order, and recorded in `everystep_migration`."""

from __future__ import annotations

from importlib import resources

import psycopg

from everystep.db import queries


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply the shipped migrations not yet applied, in one transaction, under
    an advisory lock so concurrent migrators queue up. Returns what it applied."""
    files = _shipped()
    applied = []
    with conn.transaction():
        conn.execute(queries.get("migration_lock"), {})
        conn.execute(queries.get("create_migration_ledger"), {})
        done = {row[0] for row in conn.execute(queries.get("applied_migrations"), {})}
        for f in files:
            name = f.name.removesuffix(".sql")
            if name in done:
                continue
            conn.execute(f.read_text())  # a script of its own, run as it is (no parameters: % is %)
            conn.execute(queries.get("record_migration"), {"name": name})
            applied.append(name)
    return applied


def missing_migrations(conn: psycopg.Connection) -> list[str]:
    """The shipped migrations this connection's schema lacks (every one where
    there is no ledger). Reads only: `conn` may be Django's adapter."""
    names = [f.name.removesuffix(".sql") for f in _shipped()]
    if not conn.execute(queries.get("migration_ledger_exists"), {}).fetchone()[0]:
        return names
    done = {row[0] for row in conn.execute(queries.get("applied_migrations"), {}).fetchall()}
    return [name for name in names if name not in done]


def _shipped() -> list:
    return sorted(
        (f for f in resources.files("everystep.migrations").iterdir() if f.name.endswith(".sql")),
        key=lambda f: f.name,
    )
