"""Benchmarks: the bench_*.py scripts (each measures one thing side by side in one run), the
benchmark guard (bench_guard.py, its pure logic in guard/) and its committed data (baseline.json,
run-cpu.json). Run each by path (``.venv/bin/python benchmarks/bench_guard.py``); shared client and
server helpers come from scripts/ (probelib, _probe_common). A package only so that tests can import
``benchmarks.guard`` ahead of any other top-level ``benchmarks`` on the path."""
