"""w3: 2,000 three-step workflows scheduled up front, drained by 2 worker
processes x 8 threads; steps/s against the raw commit ceiling (target >= 0.60).

python -m tests.benchmarks.bench_w3 [--runs N] [--repeat N] [--quick]
Prints one JSON line."""

from tests.benchmarks import throughput, workflows

if __name__ == "__main__":
    throughput.main("w3", workflows.three_steps, steps_per_run=3, runs=2000, target=0.60)
