"""The benchmark guard's pure parts (scripts/bench_guard.py): figures, baseline comparison,
verdicts and their tables. No MLX, no timing, no network: unit-tested in tests/test_bench_guard.py."""
