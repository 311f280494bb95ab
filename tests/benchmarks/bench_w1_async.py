"""w1_async: w1 with an async workflow and step: 5,000 one-step runs drained by
2 worker processes x 8 async slots (on each one's event loop); runs/s against
the raw commit ceiling, to read beside w1's of the same run.

python -m tests.benchmarks.bench_w1_async [--runs N] [--repeat N] [--quick]
Prints one JSON line."""

from tests.benchmarks import async_workflows, harness, throughput

if __name__ == "__main__":
    throughput.main("w1_async", async_workflows.one_step, steps_per_run=1, runs=5000, target=0.40,
                    imports=["tests.benchmarks.async_workflows"], workers={"async_slots": harness.THREADS})
