"""Run pytest with the optimised BLAS preloaded: ``python -m mlxstack.launcher.test_runner [args]``.

LD_PRELOAD only takes effect when a process starts, so the test process is re-executed with the
same environment the launcher gives the MLX server (tests build and run real models in-process).
"""
from __future__ import annotations

import os
import sys

MARK = "MLXSTACK_TEST_BLAS_APPLIED"


def main(argv: list[str]) -> None:
    env = dict(os.environ)
    if not env.get(MARK):
        env[MARK] = "1"
        try:
            from ..config.settings import load_settings
            from ..engine.blas import blas_preload_env

            env.update(blas_preload_env(load_settings(env=env), environ=env))
        except Exception as exc:  # noqa: BLE001 - tests still run, only slower
            print(f"[tests] optimised BLAS not applied: {exc}", file=sys.stderr)
    args = argv or ["tests", "-q"]
    os.execve(sys.executable, [sys.executable, "-m", "pytest", *args], env)


if __name__ == "__main__":
    main(sys.argv[1:])
