"""What the benchmarks share: a schema of their own on the test server, a real
supervisor draining it, the raw commit ceiling of the server, and figures.

Every benchmark prints one JSON line; `python -m tests.benchmarks` runs them all."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
from psycopg import conninfo

import everystep
import everystep.db
from tests.conftest import Database, find_server
from tests.support.processes import ROOT
from tests.support.supervisor_process import SupervisorProcess, config

# EVERYSTEP_BENCH_TRACING=1: the supervisor's workers trace every run and step.
TRACING = os.environ.get("EVERYSTEP_BENCH_TRACING") == "1"
PROCESSES, THREADS = 2, 8  # the fleet under test: 2 worker processes x 8 threads
CLIENTS = PROCESSES * THREADS  # the ceiling's concurrency: one connection per run slot
PGBENCH = shutil.which("pgbench") or next(
    (str(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"), reverse=True)), None
)
# One step row as the benchmarks' `noop` step records it (same sizes), for the ceiling.
STEP_ROW = ("tests.benchmarks.workflows.noop", "[1]", "{}", "done", "1")
_INSERT_STEP = (
    "INSERT INTO everystep_step (workflow_id, step_id, name, args, kwargs, status, result, error)"
    " VALUES (md5({client}::text)::uuid, {step}, '{}', '{}'::jsonb, '{}'::jsonb, '{}', '{}'::jsonb, NULL)"
)


# ---------------------------------------------------------------- database


@contextlib.contextmanager
def schema() -> Iterator[Database]:
    """A migrated schema of its own on the test server, dropped afterwards."""
    server_url = find_server()
    os.environ["EVERYSTEP_TEST_DATABASE_URL"] = server_url
    name = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    database = Database(server_url, name)
    try:
        with database.connect() as conn:
            everystep.db.migrate(conn)
        yield database
    finally:
        database.close()
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {name} CASCADE")


def schedule_all(db: Database, workflow: Callable, args_list: list[tuple]) -> float:
    """Schedule one run per args in a single transaction; returns the time
    (time.time()) its commit returned."""
    with db.connect(autocommit=False) as conn, everystep.transaction(conn):
        for args in args_list:
            everystep.schedule(workflow, *args)
    return time.time()


def schedule_in_with(db: Database, workflow: Callable, *args, **options) -> uuid.UUID:
    """Schedule one run (schedule()'s options, e.g. priority=) in a
    transaction of its own; returns its id."""
    with db.connect(autocommit=False) as conn, everystep.transaction(conn):
        return everystep.schedule(workflow, *args, **options).id


def schedule_in(conn: psycopg.Connection, workflow: Callable, *args) -> uuid.UUID:
    """Schedule one run in a transaction of its own on `conn`; returns its id
    once the commit returned."""
    with everystep.transaction(conn):
        run = everystep.schedule(workflow, *args)
    return run.id


def unfinished(db: Database) -> int:
    return db.value("SELECT count(*) FROM everystep_workflow WHERE status IN ('scheduled', 'running')")


# Whether a run is ready, held, or blocked by its workflow's room: a look at
# the head of three narrow queue tables, where the count of unfinished runs
# reads every row of everystep_workflow (its status is not indexed). Polled
# every 50 ms during a drain, on the machine the figures are taken on: the
# count of 30,000 runs took ~6 ms a poll, ~10% of a core beside the engine.
# (The timers hold runs that are not unfinished: asleep, parked in a wait.)
QUEUED = """
SELECT EXISTS (SELECT FROM everystep_ready) OR EXISTS (SELECT FROM everystep_claimed)
    OR EXISTS (SELECT FROM everystep_blocked)
"""


def wait_drained(db: Database, timeout: float = 600.0) -> None:
    """Until no run is scheduled or running: the queue tables looked at while
    they hold runs, the record counted once they hold none (a run due later,
    or waiting for a graph's dependencies, is found then), and every second
    (a queue row that outlived its run's wait, which a version before 0032
    draining across the migration can leave, does not keep it waiting)."""
    deadline = time.monotonic() + timeout
    counted = time.monotonic()
    while True:
        if not db.value(QUEUED) or time.monotonic() - counted >= 1.0:
            if not unfinished(db):
                return
            counted = time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"runs still unfinished after {timeout} s")
        time.sleep(0.05)


def last_completion(db: Database) -> float:
    """When the last run completed (the server's clock, on this host), as time.time()."""
    moment: dt.datetime = db.value("SELECT max(completed_at) FROM everystep_workflow_all")
    return moment.timestamp()


def failures(db: Database) -> int:
    return db.value("SELECT count(*) FROM everystep_workflow_all WHERE status <> 'completed'")


# ---------------------------------------------------------------- CPU per run

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


class CpuMeter:
    """The CPU the engine takes over a span: the PostgreSQL backends of its
    sessions (application_name `everystep ...`) and the supervisor's worker
    processes, read from /proc, so what other tenants of the machine take is
    not counted. Both sides live for the whole span (pools and control
    sessions stay open while the supervisor runs)."""

    def __init__(self, db: Database, supervisor_pid: int):
        self.db, self.supervisor_pid = db, supervisor_pid

    def _sample(self) -> tuple[dict[int, float], dict[int, float]]:
        backends = [row[0] for row in self.db.query(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'everystep %%'")]
        workers = _children(self.supervisor_pid)
        return ({pid: _cpu_seconds(pid) for pid in backends}, {pid: _cpu_seconds(pid) for pid in workers})

    def start(self) -> None:
        self._before = self._sample()

    def stop(self) -> tuple[float, float]:
        """(database CPU seconds, worker CPU seconds) since `start`."""
        after = self._sample()
        return tuple(sum(t - self._before[i].get(pid, 0.0) for pid, t in after[i].items()) for i in (0, 1))


# ---------------------------------------------------------------- the fleet


@contextlib.contextmanager
def supervisor(db: Database, name: str, folder: Path, ready: bool = True, code: Path = ROOT,
               **sections) -> Iterator[SupervisorProcess]:
    """A real supervisor (2 workers x 8 threads) on the schema, its workers
    holding their locks (unless not `ready`: started, for the caller to wait
    for with wait_ready, as a fleet that starts together does); drained and
    stopped afterwards. `code`: the checkout it runs (another version's, say)."""
    receiver = None
    if TRACING:
        # Spans of every run and step, exported with OTLP/HTTP to a receiver
        # in this process that acknowledges them.
        from tests.support.otlp_receiver import Receiver  # noqa: PLC0415  (needs the otel extra)

        receiver = Receiver(decode=False)
        os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_SERVICE_NAME="everystep-bench")
        sections = {**sections, "tracing": {"enabled": True}}
    workers = {"processes": PROCESSES, "threads": THREADS, "poll": 1.0, "drain": 10, **sections.pop("workers", {})}
    imports = sections.pop("imports", ["tests.benchmarks.workflows"])
    document = config(db.url, name, imports=imports, workers=workers, **sections)
    process = SupervisorProcess(document, folder, cwd=code)
    try:
        if ready:
            wait_ready(process)
        yield process
    finally:
        if process.proc.poll() is None:
            process.signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        process.close()
        if receiver is not None:
            receiver.close()


def wait_ready(process: SupervisorProcess) -> None:
    """Until the supervisor's workers hold their locks."""
    process.wait_logged("holding the lock of", count=PROCESSES)


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="everystep-bench-") as folder:
        yield Path(folder)


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc/<pid>/status, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


# ---------------------------------------------------------------- the ceiling


def commit_ceiling(seconds: float, driver: str | None = None) -> float:
    """Commits/s of CLIENTS connections each committing one INSERT of a step
    row (the real table: unique constraint, FK to its run) as fast as they
    can, in a schema of its own. Driven by pgbench (a C client: the server's
    own ceiling) when it is installed, else by Python clients shaped like the
    workers (2 processes x 8 threads); `driver` forces one."""
    with schema() as db:
        db.query(
            "INSERT INTO everystep_workflow (id, name, args, status) SELECT md5(n::text)::uuid, 'ceiling', '[]',"
            " 'running' FROM generate_series(0, %s) AS n RETURNING id",
            (CLIENTS - 1,),
        )
        if (driver or ceiling_driver()) == "pgbench":
            return _pgbench_ceiling(db, seconds)
        return _python_ceiling(db, seconds)


def ceiling_driver() -> str:
    return "pgbench" if PGBENCH else "python"


def _pgbench_ceiling(db: Database, seconds: float) -> float:
    script = _INSERT_STEP.format(*STEP_ROW, client=":client_id", step=":step") + ";\n"
    with tempfile.NamedTemporaryFile("w", suffix=".sql") as f:
        f.write("\\set step random(1, 1000000000000000)\n" + script)
        f.flush()
        info = conninfo.conninfo_to_dict(db.url)
        env = {**os.environ, "PGOPTIONS": f"-c search_path={db.schema}"}
        command = [PGBENCH, "-n", "-M", "prepared", "-c", str(CLIENTS), "-j", "2", "-T", str(max(1, round(seconds))),
                   "-f", f.name, "-h", info.get("host", "127.0.0.1"), "-p", str(info.get("port", 5432)),
                   "-U", info.get("user", "postgres"), info.get("dbname", "test")]
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return float(re.search(r"tps = ([\d.]+)", out).group(1))


def _python_ceiling(db: Database, seconds: float) -> float:
    """PROCESSES processes of THREADS threads, one connection each (the
    workers' shape), for when pgbench is not installed."""
    statement = _INSERT_STEP.format(*STEP_ROW, client="%s", step="%s")

    def insert(client: int, conn: psycopg.Connection) -> None:
        conn.execute(statement, (client, str(uuid.uuid4().int)), prepare=True)

    return clients_rate(db.url, seconds, insert)


def clients_rate(url: str, seconds: float, commit: Callable[[int, psycopg.Connection], None]) -> float:
    """Commits/s of PROCESSES forked processes x THREADS threads, each on a
    connection of its own calling `commit(client, conn)` (one transaction)
    in a loop for `seconds`; `client` numbers the threads of all processes."""
    context = multiprocessing.get_context("fork")
    start, counts = context.Event(), context.Queue()
    processes = [context.Process(target=_clients_for, args=(url, i, seconds, commit, start, counts))
                 for i in range(PROCESSES)]
    for process in processes:
        process.start()
    start.set()
    total = sum(counts.get(timeout=seconds + 60) for _ in processes)
    for process in processes:
        process.join()
    return total / seconds


def _clients_for(url: str, process_index: int, seconds: float, commit: Callable, start, counts) -> None:
    done = [0] * THREADS

    def loop(thread: int, conn: psycopg.Connection, until: float) -> None:
        client = process_index * THREADS + thread
        while time.monotonic() < until:
            commit(client, conn)
            done[thread] += 1

    connections = [psycopg.connect(url, autocommit=True) for _ in range(THREADS)]
    start.wait()
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=loop, args=(i, conn, until)) for i, conn in enumerate(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for conn in connections:
        conn.close()
    counts.put(sum(done))


# ---------------------------------------------------------------- figures


def quick_mode() -> bool:
    """Whether the benchmark runs with --quick (its figures prove only that it works)."""
    return "--quick" in sys.argv[1:]


def arguments(parser: argparse.ArgumentParser, quick: dict) -> argparse.Namespace:
    """Parse the command line; --quick replaces the sizes by `quick` (CI)."""
    parser.add_argument("--quick", action="store_true", help=f"small sizes, to prove it works in seconds: {quick}")
    args = parser.parse_args()
    if args.quick:
        vars(args).update(quick)
    return args


def emit(figures: dict) -> None:
    """The benchmark's one line of output."""
    print(json.dumps(figures), flush=True)


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98]}


def median(values: list[float]) -> float:
    return statistics.median(values)
