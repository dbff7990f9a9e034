"""TurboQuant codes for the rows of a batched KV layer (KV_QUANT_SCHEME=turboquant, batched decode).

A decoding batch holds every row's K / V as floats in one slab (cache/slab.py): attention
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
        # per row: its positions from the head on, as chunks ((key codes, value codes, key f,
        # value f), r, n) -- the first n positions of row r of those arrays (a forward's, shared)
        self.log: list[list[tuple]] = [[] for _ in range(rows)]

    # ------------------------------------------------------------------ membership
    def placed(self, row: int, depth: int, own: Any = None) -> None:
        """A sequence of ``depth`` tokens now holds ``row``; ``own``: its own layer (its codes)."""
        self.depth[row] = depth
        if isinstance(own, TurboQuantKVCache):
            self.head[row] = own.fp_head
            m = own.offset - own.fp_head
            if m > 0:
                book = scheme(self.bits, own.keys.shape[-1], self.seed)
                ck, cv, fk, fv = own.coded(own.offset)
                self.log[row] = [((book.unpack(ck), book.unpack(cv), fk, fv), 0, m)]
            else:
                self.log[row] = []
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
        (ck, fk, k), (cv, fv, v) = book.code_pair(keys, values)
        step = (ck, cv, fk, fv)            # every row's codes (unpacked): sliced out and packed when it leaves
        for r, on in enumerate(coded):
            if on:
                self._append(r, (step, r, n))
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
        """One chunk of the four arrays holding ``chunks``' positions in order (a chunk is (arrays,
        row, n): the first n positions of row ``row`` of those arrays)."""
        if len(chunks) == 1 and chunks[0][1] == 0 and chunks[0][0][0].shape[0] == 1 \
                and chunks[0][0][0].shape[2] == chunks[0][2]:
            return chunks[0]
        parts = [mx.concatenate([arrays[i][r:r + 1, :, :n] for arrays, r, n in chunks], axis=2) for i in range(4)]
        return (tuple(parts), 0, sum(n for _, _, n in chunks))

    def rewind(self, row: int, n: int) -> None:
        """The row's last ``n`` positions are taken back (rejected drafts)."""
        self.depth[row] -= n
        head = self.head[row]
        if head is None:
            return
        keep = self.depth[row] - head
        if keep < 0:
            raise ValueError(f"cannot rewind row {row} below its TurboQuant head {head}")
        out, total = [], 0
        for arrays, r, n in self.log[row]:
            if total >= keep:
                break
            out.append((arrays, r, min(n, keep - total)))
            total += out[-1][2]
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
            (ck, cv, fk, fv), _, total = self._joined(self.log[row])
            if total != m:
                raise RuntimeError(f"bug: row {row} logged {total} coded positions, holds {m}")
            book = scheme(self.bits, kv.keys.shape[-1], self.seed)
            ck, cv = book.pack(ck), book.pack(cv)
            layer.codes.keys, layer.codes.values, layer.codes.offset = ck, cv, m
            layer.scales.keys, layer.scales.values, layer.scales.offset = fk, fv, m
        return layer
