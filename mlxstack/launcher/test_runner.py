"""Run pytest with the optimised BLAS preloaded: ``python -m mlxstack.launcher.test_runner [args]``.

LD_PRELOAD only takes effect when a process starts, so the test process is re-executed with the
same environment the launcher gives the MLX server (tests build and run real models in-process).
Every argument goes to pytest; ``--fast`` stands for ``-m "not e2e and not slow"`` (the fast tier,
docs/testing.md). Without ``-m`` the whole suite runs, e2e and slow tests included.
"""
from __future__ import annotations

import os
import sys

FAST_TIER = "not e2e and not slow"


def pytest_args(argv: list[str]) -> list[str]:
    """The arguments pytest gets: ``--fast`` becomes the fast tier's marker expression."""
    args = list(argv) or ["tests", "-q"]
    if "--fast" in args:
        args = [a for a in args if a != "--fast"] + ["-m", FAST_TIER]
    return args


def main(argv: list[str]) -> None:
    args = pytest_args(argv)
    try:
        from ..config.settings import load_settings
        from ..system.process_env import reexec_with

        reexec_with(load_settings(env=dict(os.environ)), ["-m", "mlxstack.launcher.test_runner", *args])
    except Exception as exc:  # noqa: BLE001 - tests still run, only slower
        print(f"[tests] process environment (optimised BLAS, huge pages) not applied: {exc}", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-m", "pytest", *args])


if __name__ == "__main__":
    main(sys.argv[1:])
