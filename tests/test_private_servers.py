"""The tests' own PostgreSQL servers do not depend on pytest's temporary
folders: another pytest session of the same user, started while one runs,
takes the access of others away from pytest's shared folder (as root the
server runs as another system user), and a server kept there could then no
longer be restarted or stopped."""

from __future__ import annotations

import getpass
import subprocess
import sys
from pathlib import Path

import psycopg


def test_a_private_server_outlives_another_pytest_session(private_server, tmp_path, tmp_path_factory):
    data = Path(private_server.server.pgdata).resolve()
    shared = Path(f"/tmp/pytest-of-{getpass.getuser()}").resolve()
    for pytest_folder in (tmp_path_factory.getbasetemp().resolve(), shared):
        assert not data.is_relative_to(pytest_folder), f"{data} is under {pytest_folder}"
    other = tmp_path / "other"
    other.mkdir()
    (other / "test_other.py").write_text("def test_other(tmp_path):\n    assert tmp_path.is_dir()\n")
    session = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              "test_other.py"], cwd=other, capture_output=True, text=True, timeout=120)
    assert session.returncode == 0, session.stdout
    private_server.restart()  # pg_ctl, as the server's user, reaches its data
    with psycopg.connect(private_server.url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
