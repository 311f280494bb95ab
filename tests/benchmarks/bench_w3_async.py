"""w3_async: w3 with an async workflow and steps: 2,000 three-step runs drained
by 2 worker processes x 8 async slots; steps/s against the raw commit
ceiling, to read beside w3's of the same run.

python -m tests.benchmarks.bench_w3_async [--runs N] [--repeat N] [--quick]
Prints one JSON line."""

from tests.benchmarks import async_workflows, harness, throughput

if __name__ == "__main__":
    throughput.main("w3_async", async_workflows.three_steps, steps_per_run=3, runs=2000, target=0.60,
                    imports=["tests.benchmarks.async_workflows"], workers={"async_slots": harness.THREADS})
