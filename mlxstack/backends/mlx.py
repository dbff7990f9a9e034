"""MLX's own forward (the default backend: Metal, CUDA, or a CPU with ``CPU_BACKEND=off``).

Every forward is the model's own ``__call__`` (``forward_rows`` None, ``feed_rows`` False). Its
install routes mlx-lm's attention through the cascade (backends/cascade.py): a prefix held once
for several rows is attended by every backend, on Metal as on a CPU. Hooks a CPU backend put in
earlier in this process (a fast exp, the native kernel, ``swiglu``, TurboQuant's host coder) are
taken out again.
"""
from __future__ import annotations

import sys
from typing import Any

from ..cache import turboquant
from .cascade import install, installed, use_exp, use_native
from .base import Backend, BackendReport


class MlxBackend(Backend):
    name = "mlx"

    def __init__(self, cpu: str = "") -> None:
        self.cpu = cpu          # why the CPU backend is not the one (for the report)

    def install(self, loaded: Any, settings: Any) -> BackendReport:
        install()
        kernels = sys.modules.get(f"{__package__}.cpu.kernels")
        if kernels is not None:         # an earlier CPU backend in this process: mlx-lm's functions again
            kernels.restore()
        else:
            use_exp(None)
            use_native(None)
        turboquant.use_coder(None)      # TurboQuant coded by MLX's graph
        features = {"cascade_attention": f"on ({installed()} model modules)"}
        if self.cpu:
            features["cpu_backend"] = self.cpu
        self.report = BackendReport(self.name, features)
        return self.report
