"""exp for MLX's CPU backend on x86: the softmax of attention and the SiLU of MLPs, ~4-5x faster.

MLX's CPU ``exp`` evaluates a Cephes polynomial with ``fma`` one element at a time; a wheel built
for generic x86-64 has no FMA instruction, so each ``fma`` is a libm call and ``mx.exp`` costs
~25 ns per element on this machine (a multiply: ~1 ns). Attention on CPU is bound by it: 8 rows x
9 heads x 2,000 keys is 144k exps per layer per decode step, ~4 ms, x 30 layers.

``fast_exp`` is the same polynomial (the same Cephes coefficients) written as whole-array
multiplies and adds, with round-to-nearest done by the 1.5 * 2**23 trick instead of ``floor``
(a libm call too) and 2**n put in the exponent bits: ~5-6 ns per element, within 1.2e-7
relative of ``mx.exp`` (measured: tests/test_fast_math.py). Arguments below ~-88 give exactly 0
(a masked score); above 88 is not handled (a softmax's arguments are <= 0; ``fast_silu`` clips).
``fast_silu`` / ``fast_swiglu`` are built on it.

``wanted()``: only where it pays -- MLX's default device is the CPU; on Metal / CUDA
``mx.exp`` is a vector instruction and the fused ``mx.fast`` kernels win.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx

# Cephes' 2**f polynomial for f in [-0.5, 0.5] (the coefficients MLX's own CPU exp uses)
_COEFFS = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
           2.402264791363012e-1, 6.931472028550421e-1, 1.0)
_ROUND = 12582912.0                 # 1.5 * 2**23: t + _ROUND rounds t to an integer in the low bits
_BIAS = 0x4B400000 - 127            # bits of _ROUND, less the exponent bias: (bits - _BIAS) << 23 = 2**n
_LOG2E = 1.4426950408889634
_HIGH = 88.0                        # exp(88) < float32 max


def _parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """(t + _ROUND as float, 2**f) for t = x * log2(e) >= -127: the exponent n rides in the first
    one's low mantissa bits; at n = -127 the exponent bits are all 0, so exp is exactly 0 below
    ~-88 (a masked score). Only ``maximum`` and multiply-adds: a ``clip`` or a ``where`` here made
    the compiled loop 3-5x slower over a multi-MB array (measured)."""
    t = mx.maximum(x * _LOG2E, -127.0)
    u = t + _ROUND
    f = t - (u - _ROUND)
    p = _COEFFS[0]
    for c in _COEFFS[1:]:
        p = p * f + c
    return u, p


_kernel: Any = None


def _parts_fn() -> Any:
    """``_parts`` compiled into one loop (shapeless: a new length, every decode step, compiles
    nothing), built on first use -- not at import, where a GPU machine would pay for a CPU kernel
    it never runs. Without a compiler at hand: the same arithmetic op by op (~1.5x slower)."""
    global _kernel
    if _kernel is None:
        try:
            compiled = mx.compile(_parts, shapeless=True)
            mx.eval(compiled(mx.zeros((2,))))
            _kernel = compiled
        except Exception:  # noqa: BLE001
            _kernel = _parts
    return _kernel


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) for float32 ``x`` <= 88 (other float dtypes are computed in float32 and cast back);
    0 below ~-88."""
    dtype = x.dtype
    u, p = _parts_fn()(x if dtype == mx.float32 else x.astype(mx.float32))
    out = mx.view((mx.view(u, mx.int32) - _BIAS) << 23, mx.float32) * p
    return out if dtype == mx.float32 else out.astype(dtype)


def fast_silu(x: mx.array) -> mx.array:
    """x * sigmoid(x) = x / (1 + exp(-x))."""
    return x / (1.0 + fast_exp(mx.minimum(-x, _HIGH)))


def fast_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's ``swiglu``: silu(gate) * x."""
    return fast_silu(gate) * x


_WANTED: bool | None = None


def wanted() -> bool:
    """Whether ``fast_exp`` pays here: MLX computes on the CPU and, measured once (the best of 3
    runs over 64k elements each), ``fast_exp`` takes under 0.7x ``mx.exp``'s time -- true on x86
    wheels without FMA; an ARM CPU's vectorised ``exp`` or a GPU keeps MLX's own."""
    global _WANTED
    if _WANTED is None:
        _WANTED = mx.default_device() == mx.cpu and _measured_ratio() < 0.7
    return _WANTED


def _measured_ratio() -> float:
    import time

    x = mx.random.uniform(-20.0, 0.0, (65536,), key=mx.random.key(0))
    mx.eval(x)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            mx.eval(fn(x))
            times.append(time.perf_counter() - t0)
        return min(times)

    best(fast_exp), best(mx.exp)                      # warm both (the compiled loop builds once)
    return best(fast_exp) / max(best(mx.exp), 1e-9)
