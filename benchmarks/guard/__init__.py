"""The benchmark guard's pure parts (benchmarks/bench_guard.py): figures, baseline comparison,
verdicts and their tables. No MLX, no timing, no network: unit-tested in tests/test_bench_guard.py."""
