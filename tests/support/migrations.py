"""A schema as an earlier version of everystep left it: the shipped
migrations numbered below a given one, applied as that version applied them."""

from __future__ import annotations

import subprocess
from importlib import resources
from pathlib import Path

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


def previous_release(dest: Path, before: str | None = None) -> Path:
    """The code of the version before the newest migration (or before the
    migration numbered `before`, e.g. "0032"), from git into `dest`: the
    parent of the commit that added that migration. Its worker runs on a
    schema migrated before it (`cwd=dest`: it imports that code)."""
    names = sorted(f.name for f in resources.files("everystep.migrations").iterdir() if f.name.endswith(".sql"))
    newest = names[-1] if before is None else next(name for name in names if name.startswith(before))
    root = Path(__file__).resolve().parents[2]
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "-1", "--",
                            f"everystep/migrations/{newest}"], cwd=root, capture_output=True, text=True, check=True)
    if not added.stdout.strip():
        raise AssertionError(f"git has no commit that added {newest}: commit it to run this test")
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", f"{added.stdout.strip()}^"], cwd=root, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest
