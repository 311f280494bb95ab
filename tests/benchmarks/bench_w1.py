"""w1: 5,000 one-step workflows scheduled up front, drained by 2 worker
processes x 8 threads; runs/s against the raw commit ceiling (target >= 0.45).

python -m tests.benchmarks.bench_w1 [--runs N] [--repeat N] [--quick]
Prints one JSON line."""

from tests.benchmarks import throughput, workflows

if __name__ == "__main__":
    throughput.main("w1", workflows.one_step, steps_per_run=1, runs=5000, target=0.45)
