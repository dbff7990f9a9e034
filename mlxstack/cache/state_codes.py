"""Recurrent states stored as TurboQuant codes (RECURRENT_STATE_BITS; off by default).

    codes = StateCodes.of(settings.recurrent_state_bits, layout.kinds)   # None: off, or no recurrent layer
    stored = codes.code_layers(state.layers)   # at store time: every recurrent layer's arrays coded
    arrays = restore(layer_state)               # ArraysKind.checkout: the floats a (coded) state stands for
    codings(state.layers)                       # {(bits, seed)} of the coded layers in a stored state

LOSSY, unlike everything else the cache does. A recurrent (``ArraysCache`` / ``MambaCache``: SSM,
conv, gated-delta) layer's stored state is coded array by array along its last axis with the KV
scheme's pipeline (cache/turboquant.py: a seeded random-sign Walsh-Hadamard rotation, a Lloyd-Max
codebook of the rotated coordinate, one float32 norm per vector). A restored state is what those
codes decode to -- exactly, every time, from RAM or disk -- but NOT what a cold run holds: the warm
turn's reply may differ from a cold run's. Hence off by default, and outside the parity tests.

What is coded, per array of a recurrent layer's state (the rest stays as it is, exact):
- floating arrays (float32 / float16 / bfloat16) whose last dimension the rotation serves (a
  power-of-two block of at least 8 coordinates divides it: ``rotation_block``) and that hold at
  least ``MIN_VALUES`` values. Not coded: an unset slot (None), integer arrays, a last dimension
  like 4 / 12 / 20 (no block of 8), and tiny arrays (under ``MIN_VALUES`` values: a few dozen
  bytes are not worth an approximation).
- Attention KV layers are never touched here (KV_BITS / KV_QUANT_SCHEME govern them); in a hybrid
  model only its recurrent layers (also inside a ``CacheList``) are coded.

Where: at store (cache/manager.py ``KVManager.store``), never at capture -- a snapshot taken during
a prefill, a speculative mark or a batch row stays full precision while the request that took it
runs; only what the prompt cache keeps is coded, so the running request computes exactly what a
cold run computes. A coded state records its bits, seed and each coded slot's dtype in its params
(the disk tier writes them), and the disk namespace names the setting (engine/factory.py), so a
server with another setting never reads these files; a state loaded from disk whose codes are not
this server's (``codings``) is refused besides (a miss, never a wrong hit).

Bytes per vector of d coordinates: d * bits / 8 + 4 (the norm), against 4 d (float32) or 2 d
(half precision). Quality on the tiny fixture models: benchmarks/bench_kv_quant.py --parts recurrent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import mlx.core as mx

from .kind_base import LayerState, _fresh
from .turboquant import BITS, SEED, SchemeError, rotation_block, scheme

__all__ = ["MIN_VALUES", "StateCodes", "acceptable", "checked", "codable", "code_layer", "codings",
           "restore"]

MIN_VALUES = 64              # arrays with fewer values stay exact (tiny: nothing worth saving)
CODE_BITS, CODE_SEED = "code_bits", "code_seed"     # params of a coded recurrent layer state
_DTYPES = (mx.float32, mx.float16, mx.bfloat16)     # a coded slot's dtype, by index (param "dtype<i>")


def codable(a: Any) -> bool:
    """Whether the array ``a`` is coded (see the module's docstring for what stays exact)."""
    if not isinstance(a, mx.array) or a.dtype not in _DTYPES or a.ndim < 1 or a.size < MIN_VALUES:
        return False
    try:
        rotation_block(int(a.shape[-1]))
    except SchemeError:
        return False
    return True


def code_layer(state: LayerState, bits: int, seed: int = SEED) -> LayerState:
    """``state`` with each codable array of its recurrent layers as (packed codes, f) -- a list's
    members too; any other layer (attention KV of every form) and an already coded state as they are."""
    if state.children:
        return LayerState(state.kind, state.cls, state.arrays, state.params, state.depth, state.floor,
                          tuple(code_layer(c, bits, seed) for c in state.children))
    if state.kind != "arrays" or CODE_BITS in dict(state.params):
        return state
    slots, params = [], list(state.params)
    for i, a in enumerate(state.arrays):
        if codable(a):
            slots.append(scheme(bits, int(a.shape[-1]), seed).encode(a))
            params.append((f"dtype{i}", _DTYPES.index(a.dtype)))
        else:
            slots.append(a)
    if len(params) == len(state.params):              # nothing codable: the state stays exact
        return state
    params += [(CODE_BITS, int(bits)), (CODE_SEED, int(seed))]
    return LayerState(state.kind, state.cls, tuple(slots), tuple(sorted(params)), state.depth, state.floor)


def restore(state: LayerState) -> list[Any]:
    """The arrays a recurrent layer checked out of ``state`` holds: new objects (LESSONS 2), coded
    slots decoded to their dtype -- the same floats every time (decoding is exact)."""
    p = dict(state.params)
    if CODE_BITS not in p:
        return [_fresh(a) for a in state.arrays]
    bits, seed = p[CODE_BITS], p[CODE_SEED]
    out = []
    for i, a in enumerate(state.arrays):
        if isinstance(a, (tuple, list)):
            packed, f = a
            book = scheme(bits, int(packed.shape[-1]) * 8 // bits, seed)     # bytes of codes -> dimension
            out.append(book.decode(packed, f).astype(_DTYPES[p[f"dtype{i}"]]))
        else:
            out.append(_fresh(a))
    return out


def checked(state: LayerState) -> LayerState:
    """A recurrent layer state read from disk, refused (ValueError) where its coded slots and its
    params disagree: a coded slot needs bits, seed and its dtype; a coded state a coded slot."""
    p = dict(state.params)
    coded = [i for i, a in enumerate(state.arrays) if isinstance(a, (tuple, list))]
    if coded and (not {CODE_BITS, CODE_SEED} <= set(p) or p[CODE_BITS] not in BITS
                  or any(len(state.arrays[i]) != 2 or p.get(f"dtype{i}") not in range(len(_DTYPES)) for i in coded)):
        raise ValueError("recurrent layer state with codes but without their bits, seed or dtype")
    if not coded and CODE_BITS in p:
        raise ValueError("recurrent layer state marked coded without codes")
    return state


def acceptable(codes: "StateCodes | None", layers: Iterable[LayerState]) -> bool:
    """Whether a server coding with ``codes`` (None: off) may restore a stored state of ``layers``:
    exact, or coded with its own bits and seed -- never a coded state on a server that is off."""
    return codings(layers) <= (set() if codes is None else {(codes.bits, codes.seed)})


def codings(layers: Iterable[LayerState]) -> set[tuple[int, int]]:
    """{(bits, seed)} of the coded recurrent layer states among ``layers`` (members included)."""
    out: set[tuple[int, int]] = set()
    for s in layers:
        p = dict(s.params)
        if CODE_BITS in p:
            out.add((p[CODE_BITS], p[CODE_SEED]))
        out |= codings(s.children)
    return out


@dataclass(frozen=True)
class StateCodes:
    """RECURRENT_STATE_BITS on: how this server codes the recurrent states it stores."""
    bits: int
    seed: int = SEED

    @classmethod
    def of(cls, setting: str, kinds: Sequence[str] = ("arrays",)) -> "StateCodes | None":
        """The policy for RECURRENT_STATE_BITS=``setting`` and a model whose layers are of ``kinds``
        (cache/layer_kinds.py CacheLayout.kinds): None when off, or when no layer can be recurrent
        (a CacheList may hold one)."""
        if setting == "off" or not {"arrays", "list"} & set(kinds):
            return None
        bits = int(setting)
        if bits not in BITS:
            raise ValueError(f"RECURRENT_STATE_BITS={setting} is not a TurboQuant width")
        return cls(bits)

    def code_layers(self, layers: Sequence[LayerState]) -> tuple[LayerState, ...]:
        return tuple(code_layer(s, self.bits, self.seed) for s in layers)

    def describe(self) -> dict:
        return {"scheme": "turboquant", "bits": self.bits, "seed": self.seed}
