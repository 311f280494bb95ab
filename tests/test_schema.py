"""everystep/db/schema.sql is the schema the migrations make: one fresh
schema migrated, another loaded from schema.sql, and their catalogs
compared. A change to either alone fails here."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from everystep import db

SCHEMA_SQL = Path(__file__).resolve().parent.parent / "everystep" / "db" / "schema.sql"

# What a schema holds, by kind: each query takes the schema's name and gives
# rows that name no OID (so two schemas can be compared), sorted.
CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind
        FROM pg_class c
        WHERE c.relnamespace = %(schema)s::regnamespace
        ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated, a.attcollation <> 0
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = %(schema)s::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid)
        FROM pg_constraint k
        JOIN pg_class c ON c.oid = k.conrelid
        WHERE k.connamespace = %(schema)s::regnamespace
        ORDER BY 1, 2""",
    "indexes": """
        SELECT c.relname, i.relname, pg_get_indexdef(x.indexrelid)
        FROM pg_index x
        JOIN pg_class c ON c.oid = x.indrelid
        JOIN pg_class i ON i.oid = x.indexrelid
        WHERE c.relnamespace = %(schema)s::regnamespace
        ORDER BY 1, 2""",
    "sequences": """
        SELECT s.sequencename, s.data_type::text, s.start_value, s.min_value, s.max_value, s.increment_by, s.cycle,
               s.cache_size, d.refobjid::regclass::text, d.refobjsubid, d.deptype
        FROM pg_sequences s
        LEFT JOIN pg_depend d ON d.objid = format('%%I.%%I', s.schemaname, s.sequencename)::regclass
                              AND d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
        WHERE s.schemaname = %(schema)s
        ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p
        WHERE p.pronamespace = %(schema)s::regnamespace
        ORDER BY 1, 2""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
        FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = %(schema)s::regnamespace AND NOT t.tgisinternal
        ORDER BY 1, 2""",
}


def describe(conn: psycopg.Connection, schema: str) -> dict[str, list[tuple]]:
    """The catalog of `schema`, its name written <schema> wherever it shows
    (qualified names in index, constraint and function definitions)."""
    qualified = re.compile(rf"\b{re.escape(schema)}\.")

    def normal(value):
        return qualified.sub("<schema>.", value) if isinstance(value, str) else value

    return {kind: [tuple(normal(value) for value in row) for row in conn.execute(query, {"schema": schema})]
            for kind, query in CATALOG.items()}


@pytest.fixture
def fresh_schemas(server_url):
    """Two empty schemas, dropped afterwards."""
    names = [f"schema_{kind}_{uuid.uuid4().hex[:10]}" for kind in ("migrated", "loaded")]
    with psycopg.connect(server_url, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        yield conn, names
        for name in names:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def in_schema(conn: psycopg.Connection, schema: str) -> None:
    conn.execute("SELECT set_config('search_path', %s, false)", (schema,))


def migrate_and_load(conn: psycopg.Connection, migrated: str, loaded: str, change_loaded: tuple[str, ...] = ()):
    """Migrate `migrated`, load schema.sql into `loaded` (then run
    `change_loaded` there), and return both catalogs."""
    in_schema(conn, migrated)
    db.migrate(conn)
    in_schema(conn, loaded)
    conn.execute(SCHEMA_SQL.read_text())  # a script: no parameters
    for statement in change_loaded:
        conn.execute(statement)
    in_schema(conn, "public")
    return describe(conn, migrated), describe(conn, loaded)


def test_schema_sql_is_what_the_migrations_make(fresh_schemas):
    conn, (migrated, loaded) = fresh_schemas
    made, written = migrate_and_load(conn, migrated, loaded)
    assert made["relations"], "the migrations made nothing"
    for kind in CATALOG:
        assert written[kind] == made[kind], f"{kind} of schema.sql differ from the migrations'"


def test_the_comparison_sees_a_difference(fresh_schemas):
    # The test above would pass on two empty schemas; it fails on a drift.
    conn, (migrated, loaded) = fresh_schemas
    made, written = migrate_and_load(conn, migrated, loaded, (
        "ALTER TABLE everystep_route ALTER COLUMN patterns SET DEFAULT '{}'",
        "CREATE INDEX everystep_extra ON everystep_step (name)",
        "CREATE OR REPLACE FUNCTION everystep_wake() RETURNS void LANGUAGE sql AS $$ SELECT $$",
    ))
    assert {kind for kind in CATALOG if made[kind] != written[kind]} == {"columns", "indexes", "relations",
                                                                        "functions"}
