"""dag: a graph of one root, N-2 members depending on it and one fan-in
depending on them all, sealed and drained by a real supervisor's 2 worker
processes x 8 threads: the seal's time, the time from the seal's commit to
the fan-in's start, and the members' throughput against the same N runs
scheduled without a graph (target: >= 0.8 of it). Then, without workers,
what a release costs in graphs of two sizes: the root's end releasing its
N-2 dependents (per release), and the end of one of them taking one off
the fan-in's count (per end): the same whatever the graph's size.

python -m tests.benchmarks.bench_dag [--members N] [--small N] [--quick]
Prints one JSON line (the release costs: _small with --small members,
_large with --members)."""

from __future__ import annotations

import argparse
import time

import everystep
from everystep import dags
from everystep.db import dags as dag_store
from tests.benchmarks import harness, workflows

NAME = workflows.one_step.__everystep_workflow__


def build(db: harness.Database, key: str, members: int) -> list:
    """The graph, open: root, members - 2 parallel, the fan-in."""
    with db.connect(autocommit=False) as conn, everystep.transaction(conn):
        graph = dags.create(key)
        root = graph.add(workflows.one_step, 0, key="root")
        middle = [graph.add(workflows.one_step, i, key=f"m{i}", depends_on=[root]) for i in range(1, members - 1)]
        fan_in = graph.add(workflows.one_step, members, key="fan-in", depends_on=middle)
    return [root, *middle, fan_in]


def seal(db: harness.Database, key: str) -> tuple[float, float]:
    """Seal the graph: (seconds the seal took to commit, time.time() of the commit)."""
    started = time.perf_counter()
    with db.connect(autocommit=False) as conn, everystep.transaction(conn):
        dags.create(key).seal(actor="bench")
    return time.perf_counter() - started, time.time()


def with_graph(members: int) -> dict:
    with harness.schema() as db, harness.scratch() as folder:
        runs = build(db, "bench", members)
        with harness.supervisor(db, "dag", folder):
            seal_s, sealed = seal(db, "bench")
            deadline = time.monotonic() + 900
            while db.value("SELECT status FROM everystep_workflow WHERE id = %s", (runs[-1].run_id,)) != "completed":
                assert time.monotonic() < deadline, "the graph did not drain"
                time.sleep(0.05)
            fan_in_start = db.value("SELECT min(started_at) FROM everystep_step WHERE workflow_id = %s",
                                    (runs[-1].run_id,)).timestamp()
            last = harness.last_completion(db)
            not_completed = harness.failures(db)
        return {"seal_s": seal_s, "seal_to_fan_in_start_s": fan_in_start - sealed,
                "runs_per_s": members / (last - sealed), "not_completed": not_completed}


def without_graph(members: int) -> float:
    with harness.schema() as db, harness.scratch() as folder:
        with harness.supervisor(db, "dag_plain", folder):
            started = harness.schedule_all(db, workflows.one_step, [(i,) for i in range(members)])
            harness.wait_drained(db)
            return members / (harness.last_completion(db) - started)


def release_costs(members: int) -> tuple[float, float]:
    """Without workers: (us per member released by the root's end, us per
    end taking one off the fan-in's count)."""
    with harness.schema() as db:
        runs = build(db, "cost", members)
        seal(db, "cost")
        with db.connect() as conn:
            started = time.perf_counter()
            released = dag_store.settle_runs(conn, [runs[0].run_id], ["completed"])
            per_release = (time.perf_counter() - started) / released * 1e6
            middle = runs[1:-1][:200]
            started = time.perf_counter()
            for member in middle:
                dag_store.settle_runs(conn, [member.run_id], ["completed"])
            per_fan_in_step = (time.perf_counter() - started) / len(middle) * 1e6
        return per_release, per_fan_in_step


def main() -> None:
    parser = argparse.ArgumentParser(description="dag: a sealed graph drained by the fleet, and release costs")
    parser.add_argument("--members", type=int, default=10_000)
    parser.add_argument("--small", type=int, default=100, help="the small graph of the release costs")
    args = harness.arguments(parser, quick={"members": 200, "small": 20})
    graph = with_graph(args.members)
    plain = without_graph(args.members)
    small_release, small_step = release_costs(args.small)
    large_release, large_step = release_costs(args.members)
    harness.emit({
        "benchmark": "dag", "members": args.members, "seal_s": round(graph["seal_s"], 3),
        "seal_to_fan_in_start_s": round(graph["seal_to_fan_in_start_s"], 3),
        "runs_per_s_graph": round(graph["runs_per_s"], 1), "runs_per_s_plain": round(plain, 1),
        "graph_over_plain": round(graph["runs_per_s"] / plain, 3), "target": 0.8,
        "small_members": args.small, "release_us_per_member_small": round(small_release, 1),
        "release_us_per_member_large": round(large_release, 1), "fan_in_end_us_small": round(small_step, 1),
        "fan_in_end_us_large": round(large_step, 1),
        "not_completed": graph["not_completed"],
    })


if __name__ == "__main__":
    main()
