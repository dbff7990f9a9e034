"""Run pytest with the optimised BLAS preloaded: ``python -m mlxstack.launcher.test_runner [args]``.

LD_PRELOAD only takes effect when a process starts, so the test process is re-executed with the
same environment the launcher gives the MLX server (tests build and run real models in-process).
"""
from __future__ import annotations

import os
import sys



def main(argv: list[str]) -> None:
    args = argv or ["tests", "-q"]
    try:
        from ..config.settings import load_settings
        from ..system.process_env import reexec_with

        reexec_with(load_settings(env=dict(os.environ)), ["-m", "mlxstack.launcher.test_runner", *args])
    except Exception as exc:  # noqa: BLE001 - tests still run, only slower
        print(f"[tests] process environment (optimised BLAS, huge pages) not applied: {exc}", file=sys.stderr)
    os.execv(sys.executable, [sys.executable, "-m", "pytest", *args])


if __name__ == "__main__":
    main(sys.argv[1:])
