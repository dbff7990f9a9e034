"""Attention and SiLU on MLX's CPU backend without its scalar ``exp`` (backends/cpu/fast_math.py).

    install_cpu_kernels("auto")   # by the CPU backend's install (backends/cpu/backend.py) only

On: every mlx-lm / mlx-vlm model module's ``scaled_dot_product_attention`` goes through
backends/cascade.py for float caches (decode, prefill, speculation's verification: one
exp per score, grouped-query products without repeating the KV heads), decode-sized calls
through the native kernel where it builds here (backends/cpu/native_attention.py), and ``swiglu``
(the MLP of Llama, Qwen, Mistral... families) through ``fast_swiglu``. Quantised KV caches keep
mlx-lm's attention. Off (or on a GPU): mlx-lm's own functions, untouched. These are module hooks
(the model modules' names are replaced for the whole process), installed only by the CPU backend
when it applies and undone by ``restore`` (the MLX backend's install).
"""
from __future__ import annotations

import sys

from typing import Any

import mlx.core as mx

from ..cascade import install as install_cascade, native_in_use, use_exp, use_native
from . import native_attention
from .fast_math import fast_exp, fast_swiglu, wanted

_NOT_LOADED = object()
_native: Any = _NOT_LOADED


def native_kernel() -> Any:
    """The native decode-attention kernel (built and checked once per process), or None."""
    global _native
    if _native is _NOT_LOADED:
        _native = native_attention.load()
    return _native


def native_attention_on() -> bool:
    """Whether decode-sized attention goes through the native kernel now."""
    return native_in_use()


def agreed_modes(group: Any, mode: str, native: str = "auto") -> tuple[str, str]:
    """(mode, native) for ``install_cpu_kernels`` that every rank of ``group`` gets alike: the
    kernels on where rank 0 wants them (its setting, or its measurement under "auto"), the native
    call only where every rank built and checked it. Each rank deciding alone differed under load
    (rank 2's timed ``wanted()`` said off): its forward evaluated in another order than its peers'
    and the group hung at its first batched check (LESSONS 60). A collective: every rank calls it."""
    from ...models.sharding import agree

    local_on = mode == "on" or (mode == "auto" and wanted())
    local_native = native != "off" and mx.default_device() == mx.cpu and native_kernel() is not None
    on, native_everywhere = agree(group, local_on, local_native)
    return ("on" if on else "off"), ("auto" if on and native_everywhere else "off")


def install_cpu_kernels(mode: str, native: str = "auto") -> bool:
    """``mode``: "auto" (on where the CPU's exp is the slow one, measured), "on", "off";
    ``native`` ("auto" / "off"): the native decode-attention kernel with them, where it builds.
    Returns whether they are on. Idempotent; call again after loading another model module."""
    on = mode == "on" or (mode == "auto" and wanted())
    native_attention.THREADS = native_attention.threads_here()   # after a rank took its share of the cores
    install_cascade()
    use_exp(fast_exp if on else None)
    use_native(native_kernel() if on and native != "off" and mx.default_device() == mx.cpu else None)
    _swiglu(on)
    return on


def restore() -> None:
    """mlx-lm's own functions again (the cascade stays: it serves shared prefixes on any backend)."""
    use_exp(None)
    use_native(None)
    _swiglu(False)


def _swiglu(on: bool) -> None:
    from mlx_lm.models import activations

    for name, mod in list(sys.modules.items()):
        if not name.startswith(("mlx_lm.models.", "mlx_vlm.models.")) or mod is None or mod is activations:
            continue
        fn = getattr(mod, "swiglu", None)
        if fn is activations.swiglu and on:
            mod.swiglu = fast_swiglu
        elif fn is fast_swiglu and not on:
            mod.swiglu = activations.swiglu
