"""What the HTTP child serves: /metrics, /healthz and /readyz.

/metrics aggregates every child's files in the multiprocess folder and adds
the queue gauges, read from the database at scrape time. /healthz (liveness)
looks only at processes, never at the database, so a database outage cannot
get pods killed. /readyz (readiness) needs every expected worker to have said
it holds its lock, and the database to show that lock held.

The database is reached through one connection used by one thread, and every
request waits for it a bounded time: a database that is down, unreachable or
stuck turns into `everystep_database_up 0` or a 503, never into a hung request.
"""

from __future__ import annotations

import collections
import glob
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import psycopg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from everystep import db, liveness
from everystep.dags import STATUSES as DAG_STATUSES
from everystep.db import dags as dag_store
from supervisor import metrics_dir, state_file

log = logging.getLogger("everystep.supervisor")

APPLICATION_NAME = "everystep-observer"
CONNECT_TIMEOUT_SECONDS = 2  # libpq's minimum
STATEMENT_TIMEOUT_MS = 2000
# How long a request waits for the database: a connect plus a statement, with
# room to spare. Past it the request answers without the database.
DATABASE_DEADLINE_SECONDS = 3.0
# How long a dead child may stay listed by the supervisor before /healthz fails.
UNREAPED_GRACE_SECONDS = 3.0

T = TypeVar("T")


class DatabaseUnavailable(Exception):
    """The database did not answer (the message says why, in one line)."""


class Database:
    """The HTTP child's one connection, kept between requests and re-opened
    after a failure. Queries run on a thread of their own; callers wait at most
    DATABASE_DEADLINE_SECONDS for their answer."""

    def __init__(self, url: str, application_name: str = APPLICATION_NAME):
        self._url = url
        self._application_name = application_name
        self._conn: psycopg.Connection | None = None
        self._queries: queue.Queue[tuple[Callable[[psycopg.Connection], object], Future]] = queue.Queue()
        threading.Thread(target=self._answer_queries, name="everystep-database", daemon=True).start()

    def call(self, query: Callable[[psycopg.Connection], T]) -> T:
        """query(connection) on the database thread; DatabaseUnavailable when
        the database fails or does not answer in time."""
        answer: Future = Future()
        self._queries.put((query, answer))
        try:
            return answer.result(timeout=DATABASE_DEADLINE_SECONDS)
        except FutureTimeout:
            answer.cancel()  # still queued behind a stuck query: never run it
            raise DatabaseUnavailable(f"no answer within {DATABASE_DEADLINE_SECONDS:g}s") from None

    def _answer_queries(self) -> None:
        while True:
            query, answer = self._queries.get()
            if not answer.set_running_or_notify_cancel():
                continue
            try:
                answer.set_result(self._run(query))
            except BaseException as exc:  # handed to the waiting request
                answer.set_exception(exc)

    def _run(self, query: Callable[[psycopg.Connection], T]) -> T:
        while True:
            kept = self._conn is not None
            try:
                return query(self._connection())
            except psycopg.Error as exc:
                broken = self._conn is None or self._conn.broken
                if broken:
                    self._close()
                if not (kept and broken):
                    raise DatabaseUnavailable(_one_line(exc)) from exc
                # The kept connection broke (the server restarted since the
                # last request, say): once more on a new one.

    def _connection(self) -> psycopg.Connection:
        if self._conn is None:
            self._conn = psycopg.connect(self._url, **{
                **liveness.connection_kwargs(self._application_name), "connect_timeout": CONNECT_TIMEOUT_SECONDS,
            })
            db.set_statement_timeout(self._conn, STATEMENT_TIMEOUT_MS)
        return self._conn

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


class FolderCollector:
    """Every child's metrics, aggregated from the multiprocess folder. Read
    under the folder's shared lock, so a child being archived by the arbiter is
    counted exactly once."""

    def __init__(self, folder: Path):
        self._folder = folder

    def collect(self) -> list[Metric]:
        with metrics_dir.locked(self._folder, exclusive=False) as held:
            try:
                return self._read()
            except FileNotFoundError:
                if held:
                    raise
        # Read without the lock, a dead child's file was archived between the
        # listing and the read: list the folder again.
        return self._read()

    def _read(self) -> list[Metric]:
        files = []
        for name in glob.glob(str(self._folder / "*.db")):
            try:
                # A child creating its file leaves it empty for an instant (and
                # for good if it dies then), which prometheus_client cannot read
                # (client_python issue 1199): nothing is recorded in it yet.
                if os.path.getsize(name) > 0:
                    files.append(name)
            except FileNotFoundError:
                pass  # a dead child's live gauges, just deleted
        return list(MultiProcessCollector.merge(files, accumulate=True))


class QueueCollector:
    """The queue gauges, computed by the database at scrape time, and whether
    the database answered at all."""

    def __init__(self, database: Database):
        self._database = database
        self._was_up: bool | None = None

    def collect(self) -> Iterator[Metric]:
        try:
            stats, unserved = self._database.call(lambda conn: (db.queue_stats(conn), db.unserved_runs(conn)))
        except DatabaseUnavailable as exc:
            self._report(False, str(exc))
            yield GaugeMetricFamily("everystep_database_up", _DATABASE_UP_HELP, value=0)
            return
        self._report(True, "")
        yield GaugeMetricFamily("everystep_database_up", _DATABASE_UP_HELP, value=1)
        yield GaugeMetricFamily(
            "everystep_workflows_pending", "Runs claimable now (scheduled, or waiting and due) and not claimed yet.",
            value=stats.pending
        )
        yield GaugeMetricFamily(
            "everystep_workflows_running", "Runs claimed by a worker.", value=stats.running
        )
        yield GaugeMetricFamily(
            "everystep_workflows_waiting", "Runs waiting for their time: delayed starts, durable sleeps, "
            "retry back-offs (not due yet).", value=stats.waiting
        )
        yield GaugeMetricFamily(
            "everystep_workflows_blocked", "Runs waiting for an operator to resolve an unsafe step.",
            value=stats.blocked,
        )
        yield GaugeMetricFamily(
            "everystep_workflows_oldest_pending_age_seconds",
            "Age of the oldest scheduled run by the database's clock (0 when none is pending).",
            value=stats.oldest_pending_age_seconds,
        )
        family = GaugeMetricFamily(
            "everystep_workflows_unserved",
            "Scheduled runs that no live worker claims: their workflow matches none of the workers' "
            "`workers.workflows` patterns.",
            labels=["workflow"],
        )
        for name, count in unserved.items():
            family.add_metric([name], count)
        yield family
        yield from self._vacuum()
        yield from self._dags()
        try:
            auto_paused = self._database.call(db.auto_paused_schedules)
        except (DatabaseUnavailable, psycopg.Error) as exc:  # e.g. a schema older than auto-pause
            log.debug("metrics: no schedule gauge: %s", exc)
            return
        yield GaugeMetricFamily(
            "everystep_schedules_auto_paused",
            "Live schedules that paused themselves because their runs kept failing (resume them when fixed).",
            value=auto_paused,
        )

    def _dags(self) -> Iterator[Metric]:
        """The graphs of runs (everystep.dags) by status."""
        try:
            graphs = self._database.call(lambda conn: dag_store.list_dags(conn, None, None))
        except (DatabaseUnavailable, psycopg.Error) as exc:  # e.g. a schema older than 0031
            log.debug("metrics: no graph gauge: %s", exc)
            return
        family = GaugeMetricFamily("everystep_dags", "Graphs of runs (everystep.dags) by status.", labels=["status"])
        counts = collections.Counter(g["status"] for g in graphs)
        for status in DAG_STATUSES:
            family.add_metric([status], counts[status])
        yield family

    def _vacuum(self) -> Iterator[Metric]:
        """The known killers of a PostgreSQL queue: dead tuples piling up in
        the hot tables, autovacuum falling behind, and a transaction holding
        back vacuum (docs/observability.md)."""
        try:
            tables, horizon = self._database.call(lambda conn: (db.table_health(conn), db.vacuum_horizon(conn)))
        except (DatabaseUnavailable, psycopg.Error) as exc:
            log.debug("metrics: no vacuum gauges: %s", exc)
            return
        families = {
            "live": GaugeMetricFamily("everystep_table_live_tuples", "Live tuples of a hot table (the statistics "
                                      "collector's estimate).", labels=["table"]),
            "dead": GaugeMetricFamily("everystep_table_dead_tuples", "Dead tuples of a hot table, not yet removed "
                                      "by vacuum: what every claim's index scan walks past.", labels=["table"]),
            "auto": GaugeMetricFamily("everystep_table_last_autovacuum_timestamp_seconds",
                                      "Unix time of a hot table's last autovacuum (0: never since the statistics "
                                      "were reset).", labels=["table"]),
            "any": GaugeMetricFamily("everystep_table_last_vacuum_timestamp_seconds",
                                     "Unix time of a hot table's last vacuum, manual or auto (0: never).",
                                     labels=["table"]),
        }
        for row in tables:
            families["live"].add_metric([row.table], row.live_tuples)
            families["dead"].add_metric([row.table], row.dead_tuples)
            families["auto"].add_metric([row.table], row.last_autovacuum or 0)
            families["any"].add_metric([row.table], row.last_vacuum or 0)
        yield from families.values()
        yield GaugeMetricFamily(
            "everystep_oldest_xmin_age_seconds",
            "Age of the oldest transaction or snapshot of another session (backend_xmin) or prepared transaction "
            "in this database: vacuum removes no dead tuple younger than it (0: none).",
            value=horizon.oldest_xmin_age_seconds,
        )
        yield GaugeMetricFamily(
            "everystep_oldest_xmin_age_transactions",
            "Age in transaction ids of the oldest xmin holding back vacuum (sessions, prepared transactions, "
            "replication slots).", value=horizon.oldest_xmin_age_xids,
        )
        yield GaugeMetricFamily(
            "everystep_idle_in_transaction_max_seconds",
            "The longest a session of this database has been idle in a transaction (0: none).",
            value=horizon.idle_in_transaction_seconds,
        )

    def _report(self, up: bool, reason: str) -> None:
        """Log when the database goes away or comes back, not on every scrape."""
        if up != self._was_up:
            if up:
                log.info("metrics: the database answers")
            else:
                log.warning("metrics: the database does not answer: %s", reason)
        self._was_up = up


_DATABASE_UP_HELP = "1 when the database answered this scrape's queue query within the deadline, else 0."


# ---------------------------------------------------------------- probes

def _state(runtime_dir: Path) -> state_file.SupervisorState | str:
    """The state the supervisor wrote, or why there is none to read."""
    try:
        state = state_file.read_state(runtime_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"the supervisor's state file is unreadable: {_one_line(exc)}"
    return "the supervisor has not written its state yet" if state is None else state


class Liveness:
    """/healthz: None when the supervisor and every child it lists are alive,
    else why not. Looks at processes only, never at the database.

    A listed child found dead is given UNREAPED_GRACE_SECONDS from the first
    probe that sees it so: a healthy supervisor reaps a dead child and starts
    its replacement within milliseconds (or leaves it unlisted while it backs
    off), so a probe that lands in that instant is no reason to restart the
    pod; a dead child still listed after the grace means the supervisor is not
    doing its job."""

    def __init__(self, runtime_dir: Path):
        self._runtime_dir = runtime_dir
        self._lock = threading.Lock()
        self._dead_since: dict[state_file.Child, float] = {}  # listed children seen dead, and since when

    def unhealthy_because(self) -> str | None:
        state = _state(self._runtime_dir)
        if isinstance(state, str):
            return state
        supervisor = state.supervisor_pid
        if not _alive(supervisor):
            return f"the supervisor (pid {supervisor}) is not running"
        if os.getppid() != supervisor:  # it died and its pid was reused, or the file is from another run
            return f"the supervisor (pid {supervisor}) is not this process's parent"
        dead = [child for child in state.children if not _alive(child.pid, parent=supervisor)]
        now = time.monotonic()
        with self._lock:
            self._dead_since = {child: self._dead_since.get(child, now) for child in dead}
            late = [child for child in dead if now - self._dead_since[child] >= UNREAPED_GRACE_SECONDS]
        if late:
            child = late[0]
            return (f"{child.role} {child.name} (pid {child.pid}) is not running, and the supervisor has not "
                    f"replaced it in {UNREAPED_GRACE_SECONDS:g} s")
        return None


def unready_because(runtime_dir: Path, database: Database) -> str | None:
    """Readiness: None when the database answers and every expected worker
    holds its lock (its child says so and the database agrees), else why not."""
    state = _state(runtime_dir)
    if isinstance(state, str):
        return state
    try:
        free, unknown = database.call(lambda conn: (db.runners_without_lock(conn, state.expected_workers),
                                                    db.unknown_workflows(conn, state.expected_workers)))
    except DatabaseUnavailable as exc:
        return f"the database does not answer: {exc}"
    # A worker that waits for its lock (another live process holds it: the
    # database shows it held) is not ready either.
    missing = [name for name in state.expected_workers if name in free or name not in state.locked_workers]
    if missing:
        return "workers not holding their lock: " + ", ".join(missing)
    # Nor is one that cannot import a workflow it was given runs of (its
    # `imports:` miss a module, or the code is older than the runs).
    if unknown:
        return "workers cannot import workflows (their runs wait for a worker that can): " + "; ".join(
            f"{runner}: {', '.join(names)}" for runner, names in unknown.items())
    return None


def _alive(pid: int, parent: int | None = None) -> bool:
    """Whether pid is a running process (a zombie is not), and a child of
    `parent` when given (a recycled pid is not the child that had it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence is all that can be told
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    # "pid (command) state ppid ...": the command may hold spaces and parentheses.
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
    if state in ("Z", "X"):
        return False
    return parent is None or int(ppid) == parent


# ---------------------------------------------------------------- the server

class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], runtime_dir: Path, database: Database, registry: CollectorRegistry):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.runtime_dir = runtime_dir
        self.liveness = Liveness(runtime_dir)
        self.database = database
        self.registry = registry


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._probe(self.server.liveness.unhealthy_because())
        elif path == "/readyz":
            self._probe(unready_because(self.server.runtime_dir, self.server.database))
        else:
            self._answer(404, b"not found: try /metrics, /healthz or /readyz\n")

    def _probe(self, failure: str | None) -> None:
        if failure is None:
            self._answer(200, b"ok\n")
        else:
            self._answer(503, failure.encode() + b"\n")

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("http: %s " + format, self.address_string(), *args)


def serve(bind: str, port: int, database_url: str, runtime_dir: Path, multiproc_dir: Path,
          on_ready: Callable[[int], None] | None = None, application_name: str = APPLICATION_NAME) -> None:
    """Serve /metrics, /healthz and /readyz on bind:port until SIGTERM or
    SIGINT, then return. Runs in the HTTP child; `on_ready(port)` is called
    once the port is bound, with the port bound (port 0 takes any free one)."""
    # The signals are received by sigwait() below; blocked before any thread
    # starts, so that every thread inherits the mask and none takes them.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        database = Database(database_url, application_name)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(FolderCollector(multiproc_dir))
        registry.register(QueueCollector(database))
        server = _Server((bind, port), runtime_dir, database, registry)
        port = server.server_address[1]
        if on_ready is not None:
            on_ready(port)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="everystep-http",
                         daemon=True).start()
        log.info("http: serving /metrics, /healthz, /readyz on %s port %d", bind, port)
        received = signal.sigwait(stop_signals)
        log.info("http: %s received, stopping", signal.Signals(received).name)
        server.shutdown()
        server.server_close()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
