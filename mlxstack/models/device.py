"""Where MLX runs, and what CPU-only MLX needs from the weights (float32 for BLAS)."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def is_cpu_only() -> bool:
    try:
        return not mx.metal.is_available() and mx.default_device() == mx.cpu
    except Exception:  # pragma: no cover - older mlx
        return mx.default_device() == mx.cpu


def upcast_for_cpu(model: nn.Module) -> bool:
    """Dequantize quantized layers and cast floating weights to float32. Returns True if changed."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    params = tree_flatten(model.parameters())
    quantized = any(name.endswith(".scales") for name, _ in params)
    if quantized:
        dequantize_model(model)
    changed = quantized
    if any(v.dtype in (mx.float16, mx.bfloat16) for _, v in tree_flatten(model.parameters())):
        model.set_dtype(mx.float32)
        changed = True
    if changed:
        mx.eval(model.parameters())
    return changed
