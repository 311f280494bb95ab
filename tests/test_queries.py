"""The data layer's statements (everystep/db/sql/): each is used, each is
valid SQL against the schema the migrations make, and the loader reads the
files as they say."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from psycopg import pq

from everystep.db import queries
from everystep.schema import TERMINAL

DB = Path(__file__).resolve().parent.parent / "everystep" / "db"
# The functions that take a statement's name as their first argument (a
# plan's `Query`, everystep.db.queries, is called by its own name).
TAKES_A_NAME = {("queries", "get"), ("queries", "numbered"), ("libpq", "hot"), (None, "Query")}


def names_used() -> dict[str, set[str]]:
    """The statement names each module of everystep/db passes to TAKES_A_NAME
    (every string constant in the argument: `get("a" if x else "b")` uses both)."""
    used: dict[str, set[str]] = {}
    for path in DB.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            called = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called = (None, node.func.id)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)):
                called = (node.func.value.id, node.func.attr)
            if called in TAKES_A_NAME and node.args:
                for constant in ast.walk(node.args[0]):
                    if isinstance(constant, ast.Constant) and isinstance(constant.value, str):
                        used.setdefault(constant.value, set()).add(path.name)
    return used


def test_every_statement_is_used_and_every_name_used_exists():
    used = names_used()
    assert sorted(set(queries.statements()) - set(used)) == []
    assert sorted(set(used) - set(queries.statements())) == []


def test_every_statement_is_valid_sql_against_the_migrated_schema(db):
    # Parsed and analysed by the server as libpq prepares it, parameters
    # untyped: a misspelt column or table fails here, however rarely the
    # statement runs.
    with db.connect() as conn:
        failed = {}
        for name in queries.statements():
            result = conn.pgconn.prepare(f"check_{name}".encode(), queries.numbered(name).text.encode())
            if result.status != pq.ExecStatus.COMMAND_OK:
                failed[name] = result.error_message.decode()
    assert failed == {}


def test_the_ended_statuses_written_in_statements_are_the_terminal_ones():
    # send_message, take_child and archive_batch list them.
    terminal = "(" + ", ".join(f"'{status}'" for status in TERMINAL) + ")"
    listed = {name: re.findall(r"\('completed'[^)]*\)", s.text) for name, s in queries.statements().items()}
    listed = {name: lists for name, lists in listed.items() if lists}
    assert set(listed) >= {"send_message", "take_child", "archive_batch"}
    assert {name: lists for name, lists in listed.items() if set(lists) != {terminal}} == {}


def test_a_file_is_read_into_named_statements():
    source = (
        "-- what the file holds\n\n"
        "-- name: first\n-- why it is there\n-- on two lines\nSELECT 1\nFROM t;\n\n"
        "-- name: second\nSELECT %(a)s, '50%%', %(b)s,\n  -- a comment in the text stays\n  %(a)s;\n"
    )
    first, second = queries.parse(source, "x.sql")
    assert first == queries.Statement("first", "x.sql", "why it is there\non two lines", "SELECT 1\nFROM t")
    assert second.name == "second" and second.doc == ""
    assert second.text == "SELECT %(a)s, '50%%', %(b)s,\n  -- a comment in the text stays\n  %(a)s"


@pytest.mark.parametrize("body, error", [
    ("SELECT 1", "must end with `;`"),
    ("SELECT 1;\n-- a trailing comment", "must end with `;`"),
    ("SELECT 1; SELECT 2;", "one statement per name"),
    ("SELECT '50%';", "neither a parameter"),
    ("SELECT %s;", "neither a parameter"),
    (";", "no text"),
])
def test_a_malformed_statement_is_refused(body, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        queries.parse(f"-- name: bad\n{body}\n", "x.sql")


def test_a_malformed_name_is_refused():
    with pytest.raises(ValueError, match="lower case letters"):
        queries.parse("-- name: Bad-Name\nSELECT 1;\n", "x.sql")


def test_numbered_parameters_are_in_the_order_they_first_appear():
    numbered = queries.numbered("why_not_written_step")
    assert numbered.params == ("run", "runner", "token", "status", "step_id")
    assert "%(" not in numbered.text and "$1" in numbered.text and "$6" not in numbered.text
    assert queries.numbered("ui_workers").text.count("LIKE 'everystep % control'") == 1


def test_statements_are_loaded_once():
    assert queries.statements() is queries.statements()
    assert queries.get("claim") is queries.statements()["claim"].text
