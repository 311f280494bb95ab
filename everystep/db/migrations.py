"""The migration applier: the numbered files of everystep/migrations/, each
applied once, in order, and recorded in `everystep_migration`."""

from __future__ import annotations

from importlib import resources

import psycopg

from everystep.db import queries
from everystep.errors import NewerSchema


def migrate(conn: psycopg.Connection, allow_newer: bool = False) -> list[str]:
    """Apply the shipped migrations not yet applied, in one transaction, under
    an advisory lock so concurrent migrators queue up. Returns what it applied.
    Raises NewerSchema, having written nothing, when a newer everystep
    migrated the schema, unless `allow_newer`."""
    files = _shipped()
    applied = []
    with conn.transaction():
        conn.execute(queries.get("migration_lock"), {})
        conn.execute(queries.get("create_migration_ledger"), {})
        done = {row[0] for row in conn.execute(queries.get("applied_migrations"), {})}
        _refuse_newer(done, allow_newer)
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


def check_schema(conn: psycopg.Connection, allow_newer: bool = False) -> None:
    """Raise NewerSchema when a newer everystep migrated this connection's
    schema (it has migrations this code does not ship), unless `allow_newer`.
    Reads only; nothing to check without a ledger this role may read."""
    if conn.execute(queries.get("migration_ledger_readable"), {}).fetchone()[0]:
        _refuse_newer({row[0] for row in conn.execute(queries.get("applied_migrations"), {}).fetchall()},
                      allow_newer)


def _refuse_newer(applied: set[str], allow_newer: bool) -> None:
    shipped = [f.name.removesuffix(".sql") for f in _shipped()]
    unknown = sorted(applied - set(shipped))
    if unknown and not allow_newer:
        raise NewerSchema(
            f"the database's schema is at {unknown[-1]}, newer than this everystep's {shipped[-1]} (a newer "
            f"everystep applied {', '.join(unknown)}): upgrade everystep, or, if that schema is compatible with "
            "this version, pass --allow-newer-schema (config: database.allow_newer_schema: true)")


def _shipped() -> list:
    return sorted(
        (f for f in resources.files("everystep.migrations").iterdir() if f.name.endswith(".sql")),
        key=lambda f: f.name,
    )
