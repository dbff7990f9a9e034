"""Backends: how a loaded model's forwards are computed (backends/base.py: the interface).

    from mlxstack.backends import select
    backend = select(settings, loaded, device); backend.install(loaded, settings)

``mlx.py``: MLX's own forward (the default); ``cascade.py``: attention over a prefix held once
plus each row's tail (every backend installs it); ``cpu/``: the CPU backend (fast exp, native
kernels, the host path for decode-sized forwards) -- reached only through ``select`` here.
"""
from __future__ import annotations

from typing import Any

from .base import Backend, BackendReport

__all__ = ["Backend", "BackendReport", "select"]


def select(settings: Any, loaded: Any, device: Any = None) -> Backend:
    """The backend for ``loaded`` under ``settings`` (``device``: MLX's default device if None).

    ``CPU_BACKEND=off``: MLX's own (backends/mlx.py). ``auto``: the CPU backend
    (backends/cpu/backend.py) where MLX computes on the CPU -- and, as before there was a backend,
    wherever ``CPU_KERNELS=on`` asks for its kernels, and on every rank of a ``DISTRIBUTED`` model
    (its kernels are agreed by a collective every rank must join, whatever its device) -- else
    MLX's own. An engine built again on the same loaded model with the same settings gets the
    backend already installed on it (``loaded.extra["backend"]``), not a second install."""
    from .mlx import MlxBackend

    if device is None:
        import mlx.core as mx

        device = mx.default_device()
    if settings.cpu_backend == "off":
        chosen: Backend = MlxBackend(cpu="off: CPU_BACKEND=off")
    else:
        from .cpu.backend import CpuBackend

        cpu = CpuBackend()
        ok, why = cpu.applies(loaded.model, device)
        if ok or settings.cpu_kernels == "on" or "group" in loaded.extra:
            chosen = cpu
        else:
            chosen = MlxBackend(cpu=f"off: {why}")
    prior = loaded.extra.get("backend")
    key = chosen.settings_key(settings)
    if key is not None and type(prior) is type(chosen) and prior.installed_key == key:
        return prior
    return chosen
