"""The engine's SQL statements, by name, as the files of everystep/db/sql/ hold them.

Each file holds a group of statements, each under a header line
`-- name: <name>`, then comment lines saying what it is for, then its whole
text up to a closing `;`. Names are unique across the files. The text is
what psycopg executes, comments included: parameters are named (`%(run)s`,
`%(ids)b` for a binary one) and `%%` is a literal `%`, so every statement is
executed with a mapping of parameters, empty when it has none. Nothing here
assembles a statement: `get` returns a file's text as it is, and `numbered`
only binds the same text's parameters by position, for libpq.

The files are read once, at the first use of any statement; an unknown name
is a KeyError, a malformed file a ValueError at that load.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Generator
from importlib import resources
from typing import Any, NamedTuple

from everystep.plans import DONE, Stepper

_HEADER = re.compile(r"^-- name: (.*)$", re.MULTILINE)
_NAME = re.compile(r"[a-z][a-z0-9_]*")
# A parameter (`%(name)s`, `%(name)b`) or a literal percent sign (`%%`); any
# other % is a mistake psycopg would report at the first execution.
_PERCENT = re.compile(r"%\((\w+)\)([sb])|%%|%")


class Statement(NamedTuple):
    name: str
    file: str  # the file of everystep/db/sql/ it is in
    doc: str  # the comment lines under its header
    text: str  # the whole statement, as psycopg executes it (no closing `;`)


class Numbered(NamedTuple):
    """A statement with `$1, $2, ...` for its parameters, for libpq's
    prepared statements, whose parameters are passed by position."""
    text: str
    params: tuple[str, ...]  # the parameter of each position: in the order they first appear in the text


def parse(source: str, file: str) -> list[Statement]:
    """The statements of one file's text."""
    parts = _HEADER.split(source)
    statements = []
    for name, body in zip(parts[1::2], parts[2::2]):
        where = f"{file}, statement {name!r}"
        if not _NAME.fullmatch(name):
            raise ValueError(f"{where}: a statement's name is lower case letters, digits and underscores")
        lines = body.strip("\n").split("\n")
        doc = []
        while lines and lines[0].startswith("--"):
            doc.append(lines.pop(0).removeprefix("--").removeprefix(" "))
        text = "\n".join(lines).strip()
        if not text.endswith(";"):
            raise ValueError(f"{where}: the text must end with `;` (what follows it, before the next header, "
                             "may be blank lines only)")
        text = text.removesuffix(";").rstrip()
        if not text:
            raise ValueError(f"{where}: no text")
        if ";" in text:
            raise ValueError(f"{where}: one statement per name (a `;` before its end)")
        if any(m.group(0) == "%" for m in _PERCENT.finditer(text)):
            raise ValueError(f"{where}: a % that is neither a parameter %(name)s nor %%")
        statements.append(Statement(name, file, "\n".join(doc).strip(), text))
    return statements


@functools.cache
def statements() -> dict[str, Statement]:
    """Every statement, by name."""
    found: dict[str, Statement] = {}
    folder = resources.files("everystep.db") / "sql"
    for path in sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name):
        for statement in parse(path.read_text(encoding="utf-8"), path.name):
            if statement.name in found:
                raise ValueError(f"statement {statement.name!r} is in both {found[statement.name].file} "
                                 f"and {statement.file}")
            found[statement.name] = statement
    return found


def get(name: str) -> str:
    """The text of the statement `name`, for psycopg."""
    return statements()[name].text


@functools.cache
def numbered(name: str) -> Numbered:
    """The statement `name` with its named parameters bound by position
    (`$1` for the first one to appear, ...) and `%%` read as `%`. Whether a
    parameter is sent in text or binary is up to the caller (libpq: text)."""
    params: list[str] = []

    def position(match: re.Match) -> str:
        param = match.group(1)
        if param is None:
            return "%"
        if param not in params:
            params.append(param)
        return f"${params.index(param) + 1}"

    return Numbered(_PERCENT.sub(position, get(name)), tuple(params))


# ---------------------------------------------------------------- plans

class Query(NamedTuple):
    """One statement of a plan, by name, and what of its result the plan
    wants back: "one" row (or None), "all" rows, the rows as "dicts", or
    "none" (a statement that returns no rows)."""
    name: str
    params: dict
    rows: str = "one"


# A function of the data layer written once for both kinds of connection: a
# generator that yields its Querys, gets each one's rows back, and returns
# its value. `run` executes it on a psycopg connection (or the adapter of
# Django's), `arun` on a psycopg AsyncConnection: the same statements.
Plan = Generator[Query, Any, Any]


def run(conn: Any, plan: Plan) -> Any:
    """Execute `plan` on a connection: its value."""
    stepper = Stepper(plan)
    while (query := stepper.next()) is not DONE:
        cur = conn.execute(get(query.name), query.params)
        if query.rows != "none":
            stepper.sent = _rows(query, cur, cur.fetchone() if query.rows == "one" else cur.fetchall())
    return stepper.value


async def arun(aconn: Any, plan: Plan) -> Any:
    """Execute `plan` on an AsyncConnection: its value."""
    stepper = Stepper(plan)
    while (query := stepper.next()) is not DONE:
        cur = await aconn.execute(get(query.name), query.params)
        if query.rows != "none":
            stepper.sent = _rows(query, cur, await cur.fetchone() if query.rows == "one" else await cur.fetchall())
    return stepper.value


def _rows(query: Query, cur: Any, rows: Any) -> Any:
    if query.rows == "dicts":
        names = [c.name for c in cur.description]
        return [dict(zip(names, row)) for row in rows]
    return rows
