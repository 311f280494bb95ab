"""Test database: EVERYSTEP_TEST_DATABASE_URL, else 127.0.0.1:5432 if it
answers, else an embedded PostgreSQL (as everystep.testing finds it). Each
test gets its own schema."""

from __future__ import annotations

import compileall
import os
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

import everystep
import everystep.db
from everystep.runner import Runner
from everystep.testing import server
from tests.apps import engine_flows, testing_flows

pytest_plugins = ["pytester"]  # tests/test_testing_plugin.py runs test projects that use everystep.testing

LOCAL_SERVER = "host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=3"
ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config) -> None:
    # Hundreds of processes the tests start (commands, workers, supervisors)
    # import the project; where PYTHONDONTWRITEBYTECODE is set, none of them
    # writes its bytecode and each compiles the sources again: a quarter of a
    # command's start-up. Compiled once here (the controller, before xdist's
    # workers start), they read it. Files already compiled are skipped.
    if not hasattr(config, "workerinput"):
        for package in ("everystep", "supervisor", "tests"):
            compileall.compile_dir(ROOT / package, quiet=2)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The long fault-injection tests first (the same order in every xdist
    # process): collected last (test_unsafe_chaos.py), one would start when
    # the other process has nothing left, and run alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("chaos") is None)


def find_server() -> str:
    """The tests' server (the benchmarks' too): everystep.testing's, with this local default."""
    return server.find_server(LOCAL_SERVER)


@pytest.fixture(scope="session")
def server_url() -> str:
    url = find_server()
    os.environ[server.URL_VARIABLE] = url  # child processes find the same server
    return url


@pytest.fixture
def everystep_settings(server_url) -> server.Settings:
    """everystep.testing's fixtures (everystep_db, ...) on the same server as the others."""
    return server.Settings(database_url=server_url)


class Database(server.Database):
    """One test's schema on the test server, with the helpers the tests use."""

    def __init__(self, server_url: str, schema: str):
        super().__init__(conninfo.make_conninfo(server_url, options=f"-c search_path={schema}"), schema)
        self._sessions: list[psycopg.Connection] = []  # idle, for query()

    def query(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        """One statement, autocommit, on a connection kept for the next: the
        tests' wait loops poll through here many times a second, and a new
        connection each time (a server process forked and authenticated) took
        longer than the statement, more so on a busy machine. Never prepared
        (a table a test migrates changes under it); not kept after an error."""
        for attempt in (1, 2):
            conn, reused = self._session()
            try:
                rows = conn.execute(sql, params).fetchall()
            except psycopg.OperationalError:
                lost = conn.broken
                conn.close()
                if reused and lost and attempt == 1:
                    continue  # lost while idle (its server restarted): once more, on a new connection
                raise
            except BaseException:
                conn.close()
                raise
            self._sessions.append(conn)
            return rows
        raise AssertionError("unreachable")

    def _session(self) -> tuple[psycopg.Connection, bool]:
        while self._sessions:
            try:
                conn = self._sessions.pop()
            except IndexError:  # taken by another thread meanwhile
                break
            if not conn.closed and not conn.broken:
                return conn, True
        return psycopg.connect(self.url, autocommit=True, prepare_threshold=None), False

    def close(self) -> None:
        super().close()
        sessions = getattr(self, "_sessions", [])  # none on a Database made without __init__
        while sessions:
            sessions.pop().close()

    def value(self, sql: str, params: tuple | dict = ()):
        rows = self.query(sql, params)
        return rows[0][0] if rows else None

    def run_pending(self, runner: str = "test-runner", limit: int = 100) -> dict:
        """Claim and execute scheduled runs in this process until none is left;
        returns {run id: how its execution ended}."""
        engine = Runner(self.pool, runner)
        ended = {}
        try:
            with self.connect() as conn:
                while runs := everystep.db.claim(conn, runner, limit):
                    for run in runs:
                        ended[run.id] = engine.execute(run).outcome
        finally:
            engine.close()
        return ended

    def resume_held(self, runner: str = "test-runner") -> dict:
        """Claim the runs held by `runner` again and execute them, as its catchup would."""
        engine = Runner(self.pool, runner)
        try:
            with self.connect() as conn:
                runs = everystep.db.reclaim_held(conn, runner)
            return {run.id: engine.execute(run).outcome for run in runs}
        finally:
            engine.close()

    def schedule_many(self, fn, args_list) -> list:
        """Schedule a run of `fn(*args)` for each args, in one transaction."""
        with self.connect() as conn, everystep.transaction(conn):
            return [everystep.schedule(fn, *args) for args in args_list]

    def run(self, run_id) -> dict:
        with self.connect() as conn:
            return everystep.db.load_run(conn, run_id)

    def steps(self, run_id) -> list[dict]:
        with self.connect() as conn:
            return everystep.db.load_steps(conn, run_id)


@pytest.fixture(autouse=True)
def _reset_engine_flows():
    """The counters of tests/apps/engine_flows.py and testing_flows.py start empty in every test."""
    engine_flows.calls.clear()
    engine_flows.seen.clear()
    testing_flows.calls.clear()


@pytest.fixture
def marks(tmp_path) -> str:
    """A folder where the steps of tests/apps/workflows.py mark their executions."""
    path = tmp_path / "marks"
    path.mkdir()
    return str(path)


@pytest.fixture
def start_worker(db, tmp_path):
    """start_worker(name, **options) starts an `everystep worker` process on the
    test's schema (see tests/support/processes.py); all are killed at the end of the test."""
    from tests.support.processes import WorkerProcess  # noqa: PLC0415

    started = []

    def start(name: str, **options) -> WorkerProcess:
        worker = WorkerProcess(db.url, name, tmp_path / "logs", **options)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


@pytest.fixture
def supervisors(tmp_path):
    """supervisors(document) starts an `everystep-supervisor` (see
    tests/support/supervisor_process.py); all are stopped at the end of the test."""
    from tests.support.supervisor_process import SupervisorProcess  # noqa: PLC0415

    started = []

    def start(document: dict, **options) -> SupervisorProcess:
        sup = SupervisorProcess(document, tmp_path / "supervisors", **options)
        started.append(sup)
        return sup

    yield start
    for sup in started:
        sup.close()


@pytest.fixture
def private_server():
    """A PostgreSQL server of the test's own, to stop, restart or cut off."""
    from tests.support.private_postgres import PrivatePostgres  # noqa: PLC0415  (needs the embedded server's binaries)

    server = PrivatePostgres()
    yield server
    server.close()


@pytest.fixture
def db(server_url):
    database = Database(server_url, server.supply(server_url, prefix="t_").take())
    yield database
    server.give_back(database, server_url, prefix="t_")
