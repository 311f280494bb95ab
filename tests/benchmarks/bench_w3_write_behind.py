"""w3_write_behind: w3 with @step(write_behind=True) steps: 2,000 three-step
runs drained by 2 worker processes x 8 threads; steps/s against the raw
commit ceiling, to read beside w3's of the same run (docs/concepts.md,
"Write-behind steps").

python -m tests.benchmarks.bench_w3_write_behind [--runs N] [--repeat N] [--quick]
Prints one JSON line."""

from tests.benchmarks import throughput, workflows

if __name__ == "__main__":
    throughput.main("w3_write_behind", workflows.three_steps_behind, steps_per_run=3, runs=2000, target=0.60)
