"""TurboQuant codes for the rows of a batched KV layer (KV_QUANT_SCHEME=turboquant, batched decode).

A decoding batch holds every row's K / V as floats in one slab (cache/slab.py): attention
reads floats, exactly as a lone ``TurboQuantKVCache`` does. What a row adds is the rule and the
record of its coding: from its head on (``fp_head``: the depth at which the row was quantised,
QUANTIZED_KV_START for a cold run) every K / V vector written is encoded, the slab holds the
decoded vector, and the codes are kept for the row's stored entry.

    rows = RowCodes(rows=8, bits=4, seed=SEED, start=0)
    rows.placed(r, depth, own)           # a sequence joins row r (its own layer's codes, if coded)
    keys, values = rows.update(k, v)     # every row's next positions: coded rows get decoded vectors
    rows.update(k, v, lengths=[5, 3])    # a right-padded forward (a batched prefill): row 1 holds 3 of 5
    rows.rewind(r, n)                    # rejected drafts: the row's last n codes go
    layer = rows.take(r, kv)             # the row leaves: a TurboQuantKVCache when it was coded

The same rule as a cold run alone: coding starts at exactly QUANTIZED_KV_START (a lone prefill cuts
its chunk there, ``runner/generate.py``; a lone or batched speculative step never drafts across it,
``runner/spec/speculation.py``). So a forward that crosses ``start`` codes the row's positions from
``start`` on and leaves those before it in full precision -- what the lone run's two chunks
compute. A row whose depth is already past ``start`` without codes (a full-precision entry checked
out past it: ``LiveCache.maybe_quantize``'s case) is coded from that depth on, as the lone layer is.
Decoding is exact (cache/turboquant.py), so a row's vectors are what its codes decode to, batched
or alone.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from .turboquant import TurboQuantKVCache, scheme

CONSOLIDATE = 128     # a row's log is joined into one chunk once it holds this many (a short log
#                       keeps the walk over it -- bytes in flight, a leave -- cheap every step)


class RowCodes:
    """Per row of a batched layer: its head (None: not coded yet), its depth, its codes."""

    def __init__(self, rows: int, bits: int, seed: int, start: int) -> None:
        self.bits, self.seed, self.start = int(bits), int(seed), int(start)
        self.head: list[int | None] = [None] * rows
        self.depth: list[int] = [0] * rows
        # per row: its positions from the head on, as chunks ((packed key codes, value codes, key f,
        # value f), r, lo, hi) -- positions lo..hi-1 of row r of those arrays (a forward's, shared)
        self.log: list[list[tuple]] = [[] for _ in range(rows)]
        # the distinct arrays the logs hold (id -> [arrays, chunks holding them]) and their bytes,
        # kept as chunks come and go: the gauge of bytes in flight reads ``nbytes`` every step
        self._refs: dict[int, list] = {}
        self.nbytes = 0
        # the same arrays as numpy views, made once when a row's log is first joined (a forward's
        # arrays are shared by every row: eight rows leaving together convert them once, not eight times)
        self._host: dict[int, tuple] = {}

    # ------------------------------------------------------------------ the logs' arrays
    def _ref(self, chunks: list[tuple]) -> None:
        for chunk in chunks:
            got = self._refs.get(id(chunk[0]))
            if got is None:
                self._refs[id(chunk[0])] = [chunk[0], 1]
                self.nbytes += sum(a.nbytes for a in chunk[0])
            else:
                got[1] += 1

    def _unref(self, chunks: list[tuple]) -> None:
        for chunk in chunks:
            got = self._refs[id(chunk[0])]
            got[1] -= 1
            if not got[1]:
                del self._refs[id(chunk[0])]
                self._host.pop(id(chunk[0]), None)
                self.nbytes -= sum(a.nbytes for a in chunk[0])

    def _set_log(self, row: int, chunks: list[tuple]) -> None:
        self._unref(self.log[row])
        self.log[row] = chunks
        self._ref(chunks)

    # ------------------------------------------------------------------ membership
    def placed(self, row: int, depth: int, own: Any = None) -> None:
        """A sequence of ``depth`` tokens now holds ``row``; ``own``: its own layer (its codes)."""
        self.depth[row] = depth
        if isinstance(own, TurboQuantKVCache):
            self.head[row] = own.fp_head
            m = own.offset - own.fp_head
            if m > 0:
                self._set_log(row, [(own.coded(own.offset), 0, 0, m)])
            else:
                self._set_log(row, [])
        else:
            self.head[row] = None
            self._set_log(row, [])

    def adopted(self, row: int, other: "RowCodes", src: int) -> None:
        """Row ``src`` of ``other`` (a batched prefill's layer) now holds ``row``, codes and all."""
        self.head[row], self.depth[row] = other.head[src], other.depth[src]
        self._set_log(row, list(other.log[src]))

    def remapped(self, rows: int, keep: list[int]) -> "RowCodes":
        """The same rows' records in a batch of ``rows`` rows (row ``keep[i]`` becomes row i)."""
        new = RowCodes(rows, self.bits, self.seed, self.start)
        for i, r in enumerate(keep):
            new.adopted(i, self, r)
        return new

    def snapshot(self) -> tuple:
        return list(self.head), list(self.depth), [list(chunks) for chunks in self.log]

    def resident_arrays(self, seen: dict[int, int]) -> None:
        """The logs' arrays as one entry of ``seen`` (id -> bytes; runner/kv_bytes.py): they are
        this object's alone (a row handed back gets its codes joined anew), each counted
        once however many rows' chunks share a forward's arrays."""
        seen[id(self)] = self.nbytes

    def restore(self, snap: tuple) -> None:
        head, depth, log = snap
        self.head, self.depth, self.log = list(head), list(depth), [list(chunks) for chunks in log]
        self._refs, self.nbytes, self._host = {}, 0, {}
        for chunks in self.log:
            self._ref(chunks)

    # ------------------------------------------------------------------ a forward
    def update(self, keys: mx.array, values: mx.array,
               lengths: list[int] | None = None) -> tuple[mx.array, mx.array]:
        """``keys`` / ``values`` ``[rows, heads, n, dim]`` as the slab stores them: coded positions
        replaced by their decoded forms (their codes logged), the others as they are. ``lengths``:
        the positions each row really holds (a right-padded forward); every row all ``n`` if None."""
        n = keys.shape[2]
        if lengths is None and None not in self.head:
            # a decode step of rows all coding already (a row's depth is never below its head
            # after a forward): every position of every row, no per-row rule to apply
            first: list[int | None] = [0] * len(self.head)
            lengths = [n] * len(self.head)
        else:
            lengths = [n] * len(self.head) if lengths is None else [int(x) for x in lengths]
            first = []                        # per row: the forward's first coded position, or None
            for r, h in enumerate(self.head):
                d = self.depth[r]
                if h is None and d >= self.start:
                    h = self.head[r] = d                   # past the start without codes: from here on
                elif h is None and d + lengths[r] > self.start:
                    h = self.head[r] = self.start          # this forward crosses the start: from it on
                first.append(None if h is None else max(h - d, 0))
        self.depth = [d + m for d, m in zip(self.depth, lengths)]
        if all(f is None for f in first):
            return keys, values
        book = scheme(self.bits, keys.shape[-1], self.seed)
        (ck, fk, k), (cv, fv, v) = book.code_pair(keys, values)
        step = (ck, cv, fk, fv)            # every row's codes (packed): a leaving row's are sliced out
        coded = [r for r, f in enumerate(first) if f is not None and f < lengths[r]]
        if coded:                          # one reference record for every row holding the forward's arrays
            self._refs[id(step)] = [step, len(coded)]
            self.nbytes += sum(a.nbytes for a in step)
        for r in coded:
            log = self.log[r]
            log.append((step, r, first[r], lengths[r]))
            if len(log) >= CONSOLIDATE:
                self._set_log(r, [self._joined(log)])
        if k.dtype != keys.dtype:
            k, v = k.astype(keys.dtype), v.astype(values.dtype)
        if all(f == 0 for f in first):
            return k, v
        lo = mx.array([n if f is None else f for f in first], dtype=mx.int32).reshape(-1, 1, 1, 1)
        mask = mx.arange(n, dtype=mx.int32).reshape(1, 1, n, 1) >= lo
        return mx.where(mask, k, keys), mx.where(mask, v, values)

    def _joined(self, chunks: list[tuple]) -> tuple:
        """One chunk of the four arrays holding ``chunks``' positions in order (a chunk is (arrays,
        row, lo, hi): positions lo..hi-1 of row ``row`` of those arrays)."""
        if len(chunks) == 1 and chunks[0][1] == 0 and chunks[0][2] == 0 and chunks[0][0][0].shape[0] == 1 \
                and chunks[0][0][0].shape[2] == chunks[0][3]:
            return chunks[0]
        # on the host: a row's log is up to CONSOLIDATE chunks of a decode step's few positions, and
        # as MLX ops that is a slice a chunk an array -- hundreds of tiny kernels a layer when a row
        # leaves; numpy views of the (evaluated) arrays and one copy each cost microseconds
        hosts = []
        for arrays, r, lo, hi in chunks:
            got = self._host.get(id(arrays))
            if got is None:
                got = self._host[id(arrays)] = tuple(np.asarray(a) for a in arrays)
            hosts.append((got, r, lo, hi))
        parts = [mx.array(np.concatenate([h[i][r:r + 1, :, lo:hi] for h, r, lo, hi in hosts], axis=2))
                 for i in range(4)]
        return (tuple(parts), 0, 0, sum(hi - lo for _, _, lo, hi in chunks))

    def rewind(self, row: int, n: int) -> None:
        """The row's last ``n`` positions are taken back (rejected drafts)."""
        self.depth[row] -= n
        head = self.head[row]
        if head is None:
            return
        keep = self.depth[row] - head
        if keep < 0:
            if self.depth[row] < self.start:      # back before the start: the row is not coded yet
                self.head[row] = None
                self._set_log(row, [])
                return
            raise ValueError(f"cannot rewind row {row} below its TurboQuant head {head}")
        out, total = [], 0
        for arrays, r, lo, hi in self.log[row]:
            if total >= keep:
                break
            out.append((arrays, r, lo, min(hi, lo + keep - total)))
            total += out[-1][3] - lo
        self._set_log(row, out)

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
            (ck, cv, fk, fv), _, _, total = self._joined(self.log[row])
            if total != m:
                raise RuntimeError(f"bug: row {row} logged {total} coded positions, holds {m}")
            layer.codes.keys, layer.codes.values, layer.codes.offset = ck, cv, m
            layer.scales.keys, layer.scales.values, layer.scales.offset = fk, fv, m
        return layer
