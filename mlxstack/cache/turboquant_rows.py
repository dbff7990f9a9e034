"""TurboQuant codes for the rows of a batched KV layer (KV_QUANT_SCHEME=turboquant, batched decode).

A decoding batch holds every row's K / V as floats in one slab (engine/batch_cache.py): attention
reads floats, exactly as a lone ``TurboQuantKVCache`` does. What a row adds is the rule and the
record of its coding: from its head on (``fp_head``: the depth at which the row was quantised,
QUANTIZED_KV_START for a cold run) every K / V vector written is encoded, the slab holds the
decoded vector, and the codes are kept for the row's stored entry.

    rows = RowCodes(rows=8, bits=4, seed=SEED, start=0)
    rows.placed(r, depth, own)           # a sequence joins row r (its own layer's codes, if coded)
    keys, values = rows.update(k, v)     # every row's next positions: coded rows get decoded vectors
    rows.rewind(r, n)                    # rejected drafts: the row's last n codes go
    layer = rows.take(r, kv)             # the row leaves: a TurboQuantKVCache when it was coded

The same rule as a lone layer (``LiveCache.maybe_quantize`` before each forward): a row whose depth
has reached ``start`` before a forward is coded from that depth on; a forward that crosses
``start`` is not coded (the lone path quantises only before a forward). Decoding is exact
(cache/turboquant.py), so a row's vectors are what its codes decode to, batched or alone.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .turboquant import TurboQuantKVCache, scheme

CONSOLIDATE = 256     # a row's log is joined into one chunk once it holds this many


class RowCodes:
    """Per row of a batched layer: its head (None: not coded yet), its depth, its codes."""

    def __init__(self, rows: int, bits: int, seed: int, start: int) -> None:
        self.bits, self.seed, self.start = int(bits), int(seed), int(start)
        self.head: list[int | None] = [None] * rows
        self.depth: list[int] = [0] * rows
        # per row: chunks (key codes, value codes, key f, value f, n) of its positions from the head on
        self.log: list[list[tuple]] = [[] for _ in range(rows)]

    # ------------------------------------------------------------------ membership
    def placed(self, row: int, depth: int, own: Any = None) -> None:
        """A sequence of ``depth`` tokens now holds ``row``; ``own``: its own layer (its codes)."""
        self.depth[row] = depth
        if isinstance(own, TurboQuantKVCache):
            self.head[row] = own.fp_head
            m = own.offset - own.fp_head
            self.log[row] = [(*own.coded(own.offset), m)] if m > 0 else []
        else:
            self.head[row] = None
            self.log[row] = []

    def remapped(self, rows: int, keep: list[int]) -> "RowCodes":
        """The same rows' records in a batch of ``rows`` rows (row ``keep[i]`` becomes row i)."""
        new = RowCodes(rows, self.bits, self.seed, self.start)
        for i, r in enumerate(keep):
            new.head[i], new.depth[i], new.log[i] = self.head[r], self.depth[r], list(self.log[r])
        return new

    def snapshot(self) -> tuple:
        return list(self.head), list(self.depth), [list(chunks) for chunks in self.log]

    def restore(self, snap: tuple) -> None:
        head, depth, log = snap
        self.head, self.depth, self.log = list(head), list(depth), [list(chunks) for chunks in log]

    # ------------------------------------------------------------------ a forward
    def update(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """``keys`` / ``values`` ``[rows, heads, n, dim]`` as the slab stores them: coded rows' vectors
        replaced by their decoded forms (their codes logged), the others as they are."""
        n = keys.shape[2]
        for r, h in enumerate(self.head):
            if h is None and self.depth[r] >= self.start:
                self.head[r] = self.depth[r]
        coded = [h is not None for h in self.head]
        self.depth = [d + n for d in self.depth]
        if not any(coded):
            return keys, values
        book = scheme(self.bits, keys.shape[-1], self.seed)
        ck, fk, k = book.code(keys)
        cv, fv, v = book.code(values)
        for r, on in enumerate(coded):
            if on:
                self._append(r, (ck[r:r + 1], cv[r:r + 1], fk[r:r + 1], fv[r:r + 1], n))
        k, v = k.astype(keys.dtype), v.astype(values.dtype)
        if all(coded):
            return k, v
        mask = mx.array(coded).reshape(-1, 1, 1, 1)
        return mx.where(mask, k, keys), mx.where(mask, v, values)

    def _append(self, row: int, chunk: tuple) -> None:
        log = self.log[row]
        log.append(chunk)
        if len(log) >= CONSOLIDATE:
            self.log[row] = [self._joined(log)]

    @staticmethod
    def _joined(chunks: list[tuple]) -> tuple:
        if len(chunks) == 1:
            return chunks[0]
        parts = [mx.concatenate([c[i] for c in chunks], axis=2) for i in range(4)]
        return (*parts, sum(c[4] for c in chunks))

    def rewind(self, row: int, n: int) -> None:
        """The row's last ``n`` positions are taken back (rejected drafts)."""
        self.depth[row] -= n
        head = self.head[row]
        if head is None:
            return
        keep = self.depth[row] - head
        if keep < 0:
            raise ValueError(f"cannot rewind row {row} below its TurboQuant head {head}")
        log, total = self.log[row], 0
        out = []
        for chunk in log:
            if total >= keep:
                break
            take = min(chunk[4], keep - total)
            out.append(chunk if take == chunk[4] else (*(a[..., :take, :] for a in chunk[:4]), take))
            total += take
        self.log[row] = out

    # ------------------------------------------------------------------ leaving
    def take(self, row: int, kv: Any) -> Any:
        """Row ``row``'s layer as a lone sequence holds it: ``kv`` (its floats) when not coded, else a
        ``TurboQuantKVCache`` over the same floats with the row's codes."""
        head = self.head[row]
        if head is None or not isinstance(kv, KVCache) or kv.keys is None:
            return kv
        layer = TurboQuantKVCache(self.bits, self.seed, fp_head=head)
        layer.keys, layer.values, layer.offset = kv.keys, kv.values, kv.offset
        m = kv.offset - head
        if m > 0:
            ck, cv, fk, fv, total = self._joined(self.log[row])
            if total != m:
                raise RuntimeError(f"bug: row {row} logged {total} coded positions, holds {m}")
            layer.codes.keys, layer.codes.values, layer.codes.offset = ck, cv, m
            layer.scales.keys, layer.scales.values, layer.scales.offset = fk, fv, m
        return layer
