"""The environment a process that runs MLX starts with: an optimised BLAS (system/blas.py) and
huge pages for malloc (system/hugepages.py). Both are read by the dynamic loader / glibc at exec
time only, so the launcher sets them for the server, the test runner and the benchmark scripts
re-execute themselves once with them (``reexec_with``), and the benchmarks give mlx_lm.server
the same environment (a fair comparison)."""
from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Optional

from .blas import blas_preload_env
from .hugepages import hugepage_env

REEXEC_MARK = "MLXSTACK_BLAS_APPLIED"


def server_env(settings: Any, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Additions to ``environ`` (default os.environ) for a process that runs MLX."""
    env = os.environ if environ is None else environ
    return {**blas_preload_env(settings, environ=env), **hugepage_env(settings, environ=env)}


def reexec_with(settings: Any, argv: list[str]) -> None:
    """Re-execute this interpreter with ``server_env`` applied, once; returns normally when it
    is applied already or adds nothing."""
    if os.environ.get(REEXEC_MARK):
        return
    env = dict(os.environ)
    env[REEXEC_MARK] = "1"
    extra = server_env(settings, environ=env)
    if all(os.environ.get(k) == v for k, v in extra.items()):
        os.environ[REEXEC_MARK] = "1"
        return
    env.update(extra)
    os.execve(sys.executable, [sys.executable, *argv], env)
