"""TurboQuant KV quantisation (KV_QUANT_SCHEME=turboquant; Zandieh et al., arXiv 2504.19874).

    book = scheme(bits, head_dim, seed)          # one per (bits, head_dim, seed), cached
    packed, f = book.encode(x)                   # x [..., head_dim] float32 -> codes + one factor per vector
    x_hat = book.decode(packed, f)               # what attention reads (and what a hit restores)
    cache = TurboQuantKVCache(bits, seed, fp_head=n)   # the live layer past QUANTIZED_KV_START

Each K / V vector is rotated by a fixed orthogonal transform -- a random sign per coordinate, then
a Walsh-Hadamard transform per block of ``block`` coordinates (the largest power of two dividing
the head dimension, at most 256: per-block rotation, not one global one) -- after which every
coordinate of a vector follows one known distribution whatever the model (that of a coordinate of
a random unit vector, scaled by sqrt(head_dim)). One Lloyd-Max scalar codebook per bit width,
computed from that distribution at load (``codebook``), codes every coordinate; one float per
vector (``f``) restores its norm exactly (the norm correction: the decoded vector has the
original's length, not the codebook's). No calibration, nothing model-specific.

Exact by construction (the parity rule: a hit is what a cold run holds, bit for bit): the
codebook's centroids are snapped to multiples of 2^-12, so decoding is a product of small integers
and +-1 -- every partial sum an integer below 2^24, exact in float32 in any order, on any backend
and for any number of vectors at once -- followed by two elementwise products. So the vectors a
live cache decoded one token at a time are the vectors a stored entry's codes decode to in one
call. Encoding need not be exact (its output is the codes). The rotation's seed is recorded in every
stored state and in the disk tier's namespace: another seed never reads these codes.

Bytes per vector of d coordinates: d * bits / 8 for the codes (2, 3, 4 or 8 bits; packed, 3 bits
as 8 codes in 3 bytes) + 4 for ``f``. The live cache also keeps the decoded float vectors for
attention (speed: attention reads plain float K / V); stored entries keep only the codes.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

__all__ = ["BITS", "SEED", "GRID", "TurboQuantKVCache", "Scheme", "scheme", "codebook", "rotation_block",
           "bytes_per_vector", "SchemeError", "use_coder"]

BITS = (2, 3, 4, 8)
SEED = 0x7B5EED            # the rotation's signs (recorded in states and the disk namespace)
GRID = 2.0 ** -12           # centroids are multiples of this: decoding sums small integers, exactly
MAX_BLOCK = 256
LUT_BINS = 1 << 16           # encode's table of fine bins (see Scheme._nearest)


# a backend's coder for ``Scheme.code_pair`` (backends/cpu/turboquant_host.py), or None: MLX's graph
_coder: Callable[["Scheme", mx.array, mx.array], tuple | None] | None = None


def use_coder(coder: Callable[["Scheme", mx.array, mx.array], tuple | None] | None) -> None:
    """Install a backend's ``code_pair`` (None: MLX's). Its contract: ``code``'s rule -- codes
    may differ only where a coordinate lies within rounding of a boundary -- packed as ``pack``
    does, and decoded vectors that are exactly ``decode(packed, f)`` (what a stored entry gives
    back); it answers None for a call it does not take. Its choice may depend on the number of positions
    only, so a row is coded alike batched and alone."""
    global _coder
    _coder = coder


class SchemeError(ValueError):
    """A bit width or head dimension TurboQuant cannot serve (said in one line at start)."""


def rotation_block(dim: int) -> int:
    """The Walsh-Hadamard block: the largest power of two dividing ``dim``, at most 256; at least
    8 coordinates (a smaller block spreads no outliers), else SchemeError."""
    block = dim & -dim
    block = min(block, MAX_BLOCK)
    if block < 8:
        raise SchemeError(f"head dimension {dim} has no power-of-two block of 8 or more to rotate")
    return block


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) packed together: 8 // gcd(bits, 8) codes in bits * codes / 8 bytes."""
    codes = 8 // math.gcd(bits, 8)
    return codes, codes * bits // 8


def bytes_per_vector(bits: int, dim: int) -> int:
    codes, nbytes = _group(bits)
    return dim // codes * nbytes + 4


@lru_cache(maxsize=None)
def codebook(bits: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(centroids, boundaries) of the Lloyd-Max quantiser with 2**bits levels for one coordinate of
    a uniformly random unit vector in ``dim`` dimensions, scaled by sqrt(dim) (density proportional
    to (1 - t^2 / dim) ** ((dim - 3) / 2) on |t| < sqrt(dim); the standard normal as dim grows).
    Lloyd's iteration on a fine grid until the centroids stop moving; then the centroids are snapped
    to multiples of ``GRID`` and the boundaries are their midpoints (nearest centroid)."""
    if bits not in BITS:
        raise SchemeError(f"KV_BITS={bits} is not a TurboQuant width ({', '.join(map(str, BITS))})")
    levels = 1 << bits
    edge = math.sqrt(dim)
    t = np.linspace(-edge, edge, 400_001)[1:-1]
    w = np.exp((dim - 3) / 2.0 * np.log1p(-(t * t) / dim))
    # start where high-resolution theory puts the optimum (centroid density ~ f^(1/3), Panter-Dite):
    # Lloyd's iteration then needs a few dozen steps, not thousands, at 256 levels
    cdf = np.cumsum(np.cbrt(w))
    cdf /= cdf[-1]
    c = np.interp((np.arange(levels) + 0.5) / levels, cdf, t)
    wt = w * t
    for _ in range(2000):
        b = (c[1:] + c[:-1]) / 2
        cell = np.searchsorted(b, t)
        sums = np.bincount(cell, weights=wt, minlength=levels)
        mass = np.bincount(cell, weights=w, minlength=levels)
        new = np.where(mass > 0, sums / np.maximum(mass, 1e-300), c)
        moved = np.max(np.abs(new - c))
        c = new
        if moved < GRID / 64:             # far below the grid the centroids are snapped to
            break
    c = (c - c[::-1]) / 2                   # the density is symmetric: so is the codebook, exactly
    c = np.round(c / GRID) * GRID
    return c, (c[1:] + c[:-1]) / 2


def _hadamard(block: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return h


class Scheme:
    """One (bits, head_dim, seed): the rotation, the codebook, encode / decode."""

    def __init__(self, bits: int, dim: int, seed: int) -> None:
        centroids, bounds = codebook(bits, dim)
        self.bits, self.dim, self.seed = bits, dim, seed
        self.block = rotation_block(dim)
        self.group, self.group_bytes = _group(bits)
        if dim % self.group:
            raise SchemeError(f"head dimension {dim} does not pack {bits}-bit codes ({self.group} a group)")
        rng = np.random.default_rng(seed)
        self.signs = mx.array(np.where(rng.random(dim) < 0.5, -1.0, 1.0).astype(np.float32))
        self.h = mx.array(_hadamard(self.block))
        self.ints = mx.array((centroids / GRID).astype(np.float32))           # exact small integers
        scaled = (bounds * math.sqrt(self.block) / math.sqrt(dim)).astype(np.float32)
        self.bounds = mx.array(scaled)
        # nearest centroid in O(1) a coordinate: a table over fine bins (each bin narrower than any
        # cell, so it meets at most two) gives the cell of the bin's left edge, one comparison with
        # that cell's upper boundary settles it -- the same codes as counting boundaries below t
        self.edge = float(abs(scaled[0]) * 2 + abs(scaled[-1]) * 2)
        self.bins = LUT_BINS
        left = -self.edge + np.arange(LUT_BINS, dtype=np.float64) * (2 * self.edge / LUT_BINS)
        self.lut = mx.array(np.searchsorted(scaled.astype(np.float64), left, side="right").astype(np.uint32))
        self.upper = mx.array(np.append(scaled, np.float32(np.inf)).astype(np.float32))
        self.shifts = mx.array([bits * i for i in range(self.group)], dtype=mx.uint32)
        # K and V of a forward coded in one fused graph: a decode step codes every layer's new
        # vectors, and on an op-bound backend two dozen small ops a call are most of that cost
        self._pair = mx.compile(lambda k, v: self.code(mx.stack([k, v])))

    def _blocks(self, x: mx.array) -> mx.array:
        """x [..., dim] @ H per block ([..., dim]): one product of all blocks as rows (a batch of
        one-row products costs a call each)."""
        shape = x.shape
        return (x.reshape(-1, self.block) @ self.h).reshape(shape)

    def encode(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(packed codes [..., dim * bits / 8] uint8, f [..., 1] float32) of float vectors ``x``."""
        packed, f, _ = self.code(x)
        return packed, f

    def code(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``encode``'s (packed, f) and the vectors they decode to (``decode``'s result, from the
        centroids in hand instead of unpacking the codes again: the same arithmetic)."""
        codes, f, out = self.code_unpacked(x)
        return self.pack(codes), f, out

    def code_unpacked(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``code`` with the codes one uint8 a coordinate (``pack`` them to store them)."""
        x = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
        u = self._blocks(x * self.signs)                        # sqrt(block) * the rotated vector
        # t * sqrt(block) / sqrt(dim) compared with boundaries scaled alike: t = sqrt(dim) u / |x|
        scaled = u / mx.maximum(norm, mx.array(1e-30, dtype=mx.float32))
        codes = self._nearest(scaled)
        c = mx.take(self.ints, codes)
        f = (norm / (math.sqrt(self.block) * mx.sqrt(mx.sum(c * c, axis=-1, keepdims=True)))).astype(mx.float32)
        return codes.astype(mx.uint8), f, self._restore(c, f)

    def code_pair(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        """``code`` of keys and of values (same shape), as ((packed codes, f, decoded) for keys,
        the same for values): one compiled graph (or the installed coder); the same as two calls."""
        if keys.shape != values.shape:
            return self.code(keys), self.code(values)
        if _coder is not None:
            done = _coder(self, keys, values)
            if done is not None:
                return done
        codes, f, out = self._pair(keys, values)
        return (codes[0], f[0], out[0]), (codes[1], f[1], out[1])

    def _nearest(self, t: mx.array) -> mx.array:
        """The code of each coordinate: how many boundaries lie below it -- counted outright up to
        4 bits (15 comparisons a coordinate), through the table at 8."""
        if self.bits <= 4:
            return mx.sum(t[..., None] > self.bounds, axis=-1).astype(mx.uint32)
        b = mx.clip((t + self.edge) * (self.bins / (2 * self.edge)), 0, self.bins - 1).astype(mx.int32)
        code = mx.take(self.lut, b)
        code = code + (t > mx.take(self.upper, code)).astype(mx.uint32)       # the next cell
        return code - (t <= mx.take(self.upper, mx.maximum(code, 1) - 1)).astype(mx.uint32) * (code > 0)

    def decode(self, packed: mx.array, f: mx.array) -> mx.array:
        """The float vectors ``packed`` / ``f`` stand for: exact (see the module's docstring)."""
        return self._restore(mx.take(self.ints, self._unpack(packed)), f)

    def pack(self, codes: mx.array) -> mx.array:
        """Codes one a uint8 (``code_unpacked``) as stored: ``bits`` each, packed."""
        return self._pack(codes.astype(mx.uint32))

    def unpack(self, packed: mx.array) -> mx.array:
        """Stored codes back to one a uint8."""
        return self._unpack(packed).astype(mx.uint8)

    def _restore(self, c: mx.array, f: mx.array) -> mx.array:
        """Centroid integers ``c`` back to vectors: H per block (exact), then f and the signs."""
        return (self._blocks(c) * f) * self.signs

    def _pack(self, codes: mx.array) -> mx.array:
        shape = codes.shape
        groups = codes.reshape(*shape[:-1], shape[-1] // self.group, self.group)
        word = mx.sum(groups << self.shifts, axis=-1)            # disjoint bits: the sum is an OR
        parts = [((word >> (8 * i)) & 0xFF).astype(mx.uint8) for i in range(self.group_bytes)]
        return mx.stack(parts, axis=-1).reshape(*shape[:-1], shape[-1] // self.group * self.group_bytes)

    def _unpack(self, packed: mx.array) -> mx.array:
        shape = packed.shape
        n = shape[-1] // self.group_bytes
        b = packed.reshape(*shape[:-1], n, self.group_bytes).astype(mx.uint32)
        word = b[..., 0]
        for i in range(1, self.group_bytes):
            word = word | (b[..., i] << (8 * i))
        codes = (word[..., None] >> self.shifts) & ((1 << self.bits) - 1)
        return codes.reshape(*shape[:-1], n * self.group)


@lru_cache(maxsize=None)
def scheme(bits: int, dim: int, seed: int = SEED) -> Scheme:
    return Scheme(bits, dim, seed)


class TurboQuantKVCache(KVCache):
    """A plain-KV layer whose tokens from ``fp_head`` on are TurboQuant-coded: each appended K / V
    vector is encoded, and its decoded form is what the buffer holds and attention reads; the codes
    (``codes``: keys = key codes, values = value codes; ``scales``: their ``f``) are what a stored
    entry keeps. Tokens below ``fp_head`` (before QUANTIZED_KV_START) stay full precision."""

    plain_kv = True      # float K / V with KVCache's semantics: the host path takes it

    def __init__(self, bits: int, seed: int = SEED, fp_head: int = 0) -> None:
        super().__init__()
        # not ``bits``: mlx-lm's attention takes any cache with a ``bits`` attribute for its own
        # quantised layout (models/base.py); this one's K / V are plain floats
        self.code_bits, self.seed, self.fp_head = int(bits), int(seed), int(fp_head)
        self.codes = KVCache()
        self.scales = KVCache()

    @classmethod
    def from_kv(cls, layer: KVCache, bits: int, seed: int, depth: int) -> "TurboQuantKVCache":
        """``layer``'s tokens (full precision, kept as they are) with what follows coded."""
        c = cls(bits, seed, fp_head=depth)
        c.keys, c.values, c.offset = layer.keys, layer.values, depth
        return c

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        book = scheme(self.code_bits, keys.shape[-1], self.seed)
        (ck, fk, k), (cv, fv, v) = book.code_pair(keys, values)
        self.codes.update_and_fetch(ck, cv)
        self.scales.update_and_fetch(fk, fv)
        return super().update_and_fetch(k.astype(keys.dtype), v.astype(values.dtype))

    def cut(self, target: int) -> None:
        if target < self.fp_head:
            raise ValueError(f"cannot cut a TurboQuant layer to {target}, below its full-precision head {self.fp_head}")
        self.offset = target
        self.codes.offset = self.scales.offset = target - self.fp_head

    def trim(self, n: int) -> int:
        n = min(self.offset - self.fp_head, n)
        self.cut(self.offset - n)
        return n

    def coded(self, depth: int) -> tuple[Any, Any, Any, Any]:
        """(key codes, value codes, key f, value f) of tokens [fp_head, depth)."""
        m = depth - self.fp_head
        return (self.codes.keys[..., :m, :], self.codes.values[..., :m, :],
                self.scales.keys[..., :m, :], self.scales.values[..., :m, :])

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.codes.nbytes + self.scales.nbytes
