"""A schema as an earlier version of everystep left it: the shipped
migrations numbered below a given one, applied as that version applied them."""

from __future__ import annotations

from importlib import resources

import psycopg


def migrated_before(server_url: str, schema: str, number: str) -> None:
    """Create `schema` with the migrations whose number is below `number`
    (e.g. "0011": the layout of 0010)."""
    files = sorted((f for f in resources.files("everystep.migrations").iterdir()
                    if f.name.endswith(".sql") and f.name < number), key=lambda f: f.name)
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    with psycopg.connect(server_url, options=f"-c search_path={schema}") as conn, conn.transaction():
        conn.execute("CREATE TABLE everystep_migration (name text PRIMARY KEY,"
                     " applied_at timestamptz NOT NULL DEFAULT now())")
        for f in files:
            conn.execute(f.read_text())
            conn.execute("INSERT INTO everystep_migration (name) VALUES (%s)", (f.name.removesuffix(".sql"),))
