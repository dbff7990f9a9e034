"""A batched KV layer that sequences join and leave in place.

mlx-lm's ``BatchKVCache`` joins a sequence with ``extend`` (pad + concatenate every member's
K/V) and removes one with ``filter`` (gather every remaining row): each join or leave copies the
whole batch into freshly allocated memory. Measured on this CPU machine (30 layers, 7 members):
122 ms per join at 400 tokens of context, 1.27 s at 2,000 -- with agent contexts of 10k+ tokens a
join would cost more than the decoding it enables. Here the batch is a slab of rows:

    slab = SlabKVCache.empty(rows=4)
    slab.place(row, keys, values)          # write one sequence's K/V into a free row (in place)
    kv = slab.take(row)                    # copy one row out as a plain KVCache; the row is free

Rows stay right-aligned at one shared write index (``_idx``) with per-row left padding, exactly
the layout ``BatchKVCache`` uses, so every mlx-lm model's attention, mask and RoPE offsets work
unchanged (this class only adds ``place`` / ``take`` / ``rebuilt``). Placing costs one copy of
the placed sequence, taking one copy of the taken row; nothing else moves, except when a sequence
longer than the shared index joins (every row is shifted right once) or the slab is rebuilt with
a different number of rows. A free row keeps its last (finite) contents and is fed a dummy
token: rows never mix, and its output is ignored. No row is ever fully masked (that would give
NaN, and a NaN left in a row's masked region poisons the next sequence placed there: 0 x NaN).
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .prefixed_kv import PrefixedKVCache
from .turboquant import TurboQuantKVCache
from .turboquant_rows import RowCodes


SHARED_STEP = 64   # columns a slab whose rows share a prefix grows by (its rows hold only tails)


class SlabKVCache(BatchKVCache):
    step = 256

    def __init__(self, left_padding: list[int]) -> None:
        super().__init__(left_padding)
        # per row: columns between the row's own end and the shared index (speculative decoding
        # takes rejected drafts back from one row, not from all): 0 everywhere is mlx-lm's layout
        self.gap: list[int] = [0] * len(left_padding)
        self._ends: list[int] | None = None   # rows' ends before the rewinds settle() applies
        # one prefix held once for the rows that share it (cascade attention:
        # backends/cascade.py): (keys, values, n) -- the first n positions of those arrays, the
        # very objects a stored entry or a shared prefill holds; a sharing row keeps only its tail
        self.prefix: tuple[mx.array, mx.array, int] | None = None
        self.shares: list[bool] = [False] * len(left_padding)
        self._rows_mask: mx.array | None = None
        # KV_QUANT_SCHEME=turboquant: each row's coding (cache/turboquant_rows.py); None: plain floats
        self.codes: RowCodes | None = None
        self._right: list[int] | None = None    # right padding of the forward being prepared

    @classmethod
    def empty(cls, rows: int, quant: Any = None) -> "SlabKVCache":
        """A slab of ``rows`` free rows; ``quant`` (a turboquant ``KVQuant``): its rows are coded
        from QUANTIZED_KV_START on, as a lone ``TurboQuantKVCache`` is."""
        slab = cls([0] * rows)
        if quant is not None:
            slab.codes = RowCodes(rows, quant.bits, quant.seed, quant.start)
        return slab

    # ------------------------------------------------------------------ ragged ends (speculation)
    @property
    def ragged(self) -> bool:
        return any(self.gap)

    def rewind(self, row: int, n: int) -> None:
        """Take back the last ``n`` tokens of ``row`` only (rejected drafts): its end moves left,
        and the next tokens fed to the row are written there (``update_and_fetch``). Call
        ``settle`` once every row is rewound, before the next forward."""
        if n > 0:
            if self.keys is None or n > self._idx - self.gap[row]:
                raise ValueError(f"cannot rewind row {row} by {n}")
            if self._ends is None:
                self._ends = [self._idx - g for g in self.gap]
            self.gap[row] += n
            if self.codes is not None:
                self.codes.rewind(row, n)

    def settle(self, active: list[int]) -> None:
        """After rewinds: each row's RoPE offset follows its end, free rows follow the members
        (their gap is the smallest member's), and the shared index moves back to the furthest
        member's end, so no column is attended for nothing."""
        if self.keys is None:
            return
        before = self._ends if self._ends is not None else [self._idx - g for g in self.gap]
        if active:
            low = min(self.gap[r] for r in active)
            taken = set(active)
            self.gap = [g if r in taken else low for r, g in enumerate(self.gap)]
        low = min(self.gap)
        if low:
            self._idx -= low
            self.gap = [g - low for g in self.gap]
        ends = [self._idx - g for g in self.gap]
        delta = [b - e for b, e in zip(before, ends)]
        if any(delta):
            self.offset = self.offset - mx.array(delta, dtype=self.offset.dtype)
        self._ends = None

    def prepare(self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None) -> None:
        super().prepare(left_padding=left_padding, lengths=lengths, right_padding=right_padding)
        # a right-padded forward (a batched prefill): each row's codes cover its own positions only
        self._right = [int(p) for p in right_padding] if right_padding is not None and max(right_padding) > 0 else None

    def finalize(self) -> None:
        super().finalize()
        self._right = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.codes is not None:
            n, right = keys.shape[2], self._right
            keys, values = self.codes.update(keys, values, None if right is None else [n - p for p in right])
        if not self.ragged:
            return super().update_and_fetch(keys, values)
        n = keys.shape[2]
        low = min(self.gap)
        end = self._idx - low + n
        if end > self.keys.shape[2]:
            grow = ((end - self.keys.shape[2] + self.step - 1) // self.step) * self.step
            pad = [(0, 0), (0, 0), (0, grow), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)
        rows = len(self.gap)
        at = (mx.array([self._idx - g for g in self.gap], dtype=mx.int32)[:, None]
              + mx.arange(n, dtype=mx.int32)[None]).reshape(rows, 1, n, 1)
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values, axis=2)
        self.offset = self.offset + n
        self._idx = end
        self.gap = [g - low for g in self.gap]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if not self.ragged:
            return super().make_mask(N, return_array=return_array, **kwargs)
        if kwargs.get("window_size") is not None:
            raise ValueError("ragged rows hold plain KV layers only")
        low = min(self.gap)
        ends = mx.array([self._idx - g for g in self.gap], dtype=mx.int32)
        cols = mx.arange(self._idx - low + N, dtype=mx.int32)[None, None, None, :]
        query = (ends[:, None] + mx.arange(N, dtype=mx.int32)[None])[:, None, :, None]   # [B,1,N,1]
        # a free row keeps at least its own column: a fully masked row would be NaN (module doc)
        start = mx.minimum(self.left_padding, ends)[:, None, None, None]
        return (cols <= query) & (cols >= start)

    # ------------------------------------------------------------------ a shared prefix
    def shared_prefix(self) -> tuple[mx.array, mx.array, mx.array, bool] | None:
        """For the attention hook: (prefix keys, values, which rows see it, False: the model's
        mask covers the slab's columns only), or None when no row shares a prefix."""
        if self.prefix is None or not any(self.shares):
            return None
        rk, rv, n = self.prefix
        if self._rows_mask is None:
            self._rows_mask = mx.array(self.shares)
        return rk[..., :n, :], rv[..., :n, :], self._rows_mask, False

    def _share(self, root: tuple[mx.array, mx.array, int] | None, min_shared: int | None) -> int:
        """How many leading tokens a sequence with ``root`` leaves to the slab's prefix (0: none;
        the first root of at least ``min_shared`` tokens becomes the prefix; None: never)."""
        if root is None or min_shared is None or root[2] < max(1, min_shared) or root[0].shape[0] != 1:
            return 0
        if self.prefix is None:
            self.prefix = root
            self.step = SHARED_STEP       # rows hold short tails: grow them in smaller steps
            return root[2]
        rk, rv, n = self.prefix
        return n if root[0] is rk and root[1] is rv and root[2] >= n else 0

    def place_tail(self, row: int, prefix: tuple[mx.array, mx.array, int], keys: mx.array, values: mx.array,
                   length: int, min_shared: int | None = 1) -> bool:
        """Write a sequence that is ``prefix`` (held elsewhere, by reference) followed by ``length``
        positions of K/V as a row that shares the slab's prefix -- when ``prefix`` is the slab's
        (the same objects and length; it becomes the slab's if it has none). False: it is not, and
        nothing was written (the caller places the whole sequence)."""
        planned = self._tail_planned(row, prefix, keys, values, length, min_shared)
        if planned is None:
            return False
        self._put(*planned)
        return True

    def _set_share(self, row: int, on: bool) -> None:
        if self.shares[row] != on:
            self.shares[row] = on
            self._rows_mask = None

    @property
    def rows(self) -> int:
        return int(self.offset.shape[0])

    def _alloc(self, rows: int, heads: int, length: int, k_dim: int, v_dim: int, dtype: Any) -> None:
        cap = ((length + self.step) // self.step) * self.step
        self.keys = mx.zeros((rows, heads, cap, k_dim), dtype=dtype)
        self.values = mx.zeros((rows, heads, cap, v_dim), dtype=dtype)

    def place(self, row: int, keys: mx.array | None, values: mx.array | None, length: int,
              root: tuple[mx.array, mx.array, int] | None = None, min_shared: int | None = None) -> None:
        """Write one sequence's K/V (``[1, heads, >= length, dim]``, the first ``length``
        positions valid) into ``row``, right-aligned at the shared index. With ``root`` (the
        sequence's first tokens are those arrays': ``LiveCache.roots``) that is the slab's prefix,
        only what follows the prefix is written."""
        self._put(*self._planned(row, keys, values, length, root, min_shared))

    def _planned(self, row: int, keys: mx.array | None, values: mx.array | None, length: int,
                 root: tuple[mx.array, mx.array, int] | None, min_shared: int | None, empty: bool = False) -> tuple:
        """What ``place`` writes: (row, keys, values, length, total, shares); the slab's prefix
        is chosen here (``_share``), nothing is written. ``empty``: a row may hold nothing yet (a
        batched prefill of a cold prompt; only ``fill`` builds such a slab)."""
        if length < 1 or keys is None:
            if empty:
                return row, None, None, 0, 0, False
            raise ValueError("a decoding sequence holds at least its prompt")
        skip = self._share(root, min_shared)
        if skip > length:
            raise ValueError(f"a root of {skip} tokens in front of a sequence of {length}")
        # a sharing row's tail may be empty: every forward appends its next token there, and it
        # always sees the prefix, so it is never fully masked
        return row, keys[..., skip:length, :], values[..., skip:length, :], length - skip, length, skip > 0

    def _tail_planned(self, row: int, prefix: tuple[mx.array, mx.array, int], keys: mx.array, values: mx.array,
                      length: int, min_shared: int | None) -> tuple | None:
        """What ``place_tail`` writes, or None: ``prefix`` is not (and cannot become) the slab's --
        another root, one shorter than ``min_shared``, sharing off (None), a batch of several --
        and nothing was written (the caller places the whole sequence). The same rule as ``_share``."""
        n = prefix[2]
        if self.prefix is not None and not (self.prefix[0] is prefix[0] and self.prefix[2] == n):
            return None
        if self._share(prefix, min_shared) != n:
            return None
        return row, keys, values, length, n + length, True

    def _put(self, row: int, keys: mx.array, values: mx.array, length: int, total: int, shares: bool) -> None:
        self._write(row, keys, values, length, total)
        self._set_share(row, shares)
        if self.codes is not None:
            self.codes.placed(row, total)

    def adopt_codes(self, row: int, own: Any) -> None:
        """The codes of ``own`` (the layer just placed in ``row``), when it is a coded layer."""
        if self.codes is not None:
            self.codes.placed(row, self.codes.depth[row], own)

    def fill(self, writes: list[tuple]) -> None:
        """Every row of an empty slab at once (``writes``: one ``_planned`` tuple per row, each row
        once): each K / V buffer built by one concatenation of the left-padded rows, where
        ``_write`` row by row re-allocates and shifts the buffer whenever a longer row arrives
        and updates the whole buffer once per row (a warm 8-agent turn's batched prefill: ~100-200 ms
        to evaluate, in process). ``stack_layers`` and a batch joining an empty decode slab."""
        if self.keys is not None or sorted(w[0] for w in writes) != list(range(self.rows)):
            for w in writes:
                self._put(*w)
            return
        writes = sorted(writes, key=lambda w: w[0])
        idx = max(w[3] for w in writes)
        cap = ((idx + self.step) // self.step) * self.step
        like = next((w for w in writes if w[1] is not None), None)     # a row holding something

        def padded(a: mx.array | None, length: int, template: mx.array) -> mx.array:
            if a is None:                  # a row holding nothing yet: zeros shaped as another row's
                return mx.zeros((1, template.shape[1], cap, template.shape[3]), dtype=template.dtype)
            return mx.pad(a[..., :length, :], [(0, 0), (0, 0), (idx - length, cap - idx), (0, 0)])

        if like is not None:
            self.keys = mx.concatenate([padded(w[1], w[3], like[1]) for w in writes], axis=0)
            self.values = mx.concatenate([padded(w[2], w[3], like[2]) for w in writes], axis=0)
        self._idx = idx
        self.left_padding = mx.array([idx - w[3] for w in writes], dtype=mx.int32)
        self.offset = mx.array([w[4] for w in writes], dtype=mx.int32)
        self.gap = [0] * self.rows
        for w in writes:
            self._set_share(w[0], w[5])
            if self.codes is not None:
                self.codes.placed(w[0], w[4])

    def _write(self, row: int, keys: mx.array, values: mx.array, length: int, total: int) -> None:
        """Write ``length`` positions of K/V as ``row``'s columns; the row holds ``total`` tokens
        (its RoPE offset: ``length`` plus the shared prefix it sees)."""
        if self.keys is None:
            self._alloc(self.rows, keys.shape[1], length, keys.shape[3], values.shape[3], keys.dtype)
            self._idx = length
            # rows nobody holds attend over zeros (finite): a fully masked row would turn to NaN,
            # and NaN left behind in a row poisons whoever is placed there next (0 * NaN)
            self.left_padding = mx.zeros((self.rows,), dtype=mx.int32)
            self.offset = mx.full((self.rows,), total, dtype=mx.int32)
        elif length > self._idx:                      # every row moves right once
            shift = length - self._idx
            old_k, old_v, old_idx = self.keys, self.values, self._idx
            self._alloc(self.rows, old_k.shape[1], length, old_k.shape[3], old_v.shape[3], old_k.dtype)
            self.keys[..., shift:shift + old_idx, :] = old_k[..., :old_idx, :]
            self.values[..., shift:shift + old_idx, :] = old_v[..., :old_idx, :]
            self.left_padding = self.left_padding + shift
            self._idx = length
        start = self._idx - length
        self.keys[row:row + 1, :, start:self._idx, :] = keys
        self.values[row:row + 1, :, start:self._idx, :] = values
        self.left_padding[row] = start
        self.offset[row] = total
        self.gap[row] = 0

    def take(self, row: int, whole: bool = False) -> Any:
        if self.codes is None:
            return self._take(row, whole)
        # a coded row leaves as one TurboQuant layer (its floats whole, its codes): a layer held
        # as prefix + tail would be neither coded nor codable from the start (LiveCache.maybe_quantize)
        return self.codes.take(row, self._take(row, True))

    def _take(self, row: int, whole: bool = False) -> Any:
        """Copy ``row`` out as a plain KVCache (the row's contents stay; the caller frees it). A row
        that shares the slab's prefix comes out as a ``PrefixedKVCache`` (the prefix by reference,
        its tail copied) unless ``whole`` (one buffer: a row that goes on decoding alone)."""
        cache = KVCache()
        start = int(self.left_padding[row].item())
        end = self._idx - self.gap[row]
        if self.keys is not None and (start < end or self.shares[row]):
            k, v = self.keys[row:row + 1, :, start:end, :], self.values[row:row + 1, :, start:end, :]
            pad = lambda a: mx.zeros((1, a.shape[1], KVCache.step, a.shape[3]), dtype=a.dtype)  # noqa: E731
            if self.shares[row] and not whole:
                return PrefixedKVCache(self.prefix, mx.concatenate([k, pad(k)], axis=2),
                                       mx.concatenate([v, pad(v)], axis=2), end - start)
            if self.shares[row]:                      # the prefix in front, room to append
                rk, rv, n = self.prefix
                cache.keys = mx.concatenate([rk[..., :n, :], k, pad(k)], axis=2)
                cache.values = mx.concatenate([rv[..., :n, :], v, pad(v)], axis=2)
                cache.offset = n + end - start
            else:
                cache.keys, cache.values = mx.contiguous(k), mx.contiguous(v)
                cache.offset = end - start
        return cache

    def extract(self, idx: int) -> Any:
        """mlx-lm's name for taking one row out (a batched prefill's rows): the whole sequence,
        the shared prefix included (by reference)."""
        return self.take(idx)

    def row_view(self, row: int) -> tuple[mx.array | None, mx.array | None, int]:
        """``row``'s own columns as views (for placing it into another slab without a copy)."""
        if self.keys is None:
            return None, None, 0
        start = int(self.left_padding[row].item())
        end = self._idx - self.gap[row]
        return (self.keys[row:row + 1, :, start:end, :], self.values[row:row + 1, :, start:end, :], end - start)

    def compact(self, active: list[int], slack: int = 256) -> int:
        """Drop the columns no active row uses any more (every active row's left padding is at
        least ``slack``): the shared index would otherwise grow for as long as the slab lives, and
        every row attends over all of it. Returns the number of columns dropped."""
        if self.keys is None or not active:
            return 0
        pads = self.left_padding.tolist()
        cut = min(pads[r] for r in active)
        if cut < slack:
            return 0
        self.keys = self.keys[..., cut:, :]
        self.values = self.values[..., cut:, :]
        self._idx -= cut
        self.left_padding = mx.maximum(self.left_padding - cut, 0)   # free rows: any finite window
        return cut

    def rebuilt(self, rows: int, keep: list[int]) -> "SlabKVCache":
        """A new slab of ``rows`` rows holding rows ``keep`` of this one (in that order, rows
        0..len(keep)-1): to grow when full, or to shrink when most rows are free."""
        new = SlabKVCache.empty(rows)
        views = [self.row_view(r) for r in keep]
        shared = [self.shares[r] for r in keep]
        if any(shared):
            new.prefix, new.step = self.prefix, self.step
        longest = max((n for _, _, n in views), default=0)
        if longest or any(shared):
            # the longest first: one allocation, every other row lands without a shift
            order = sorted(range(len(views)), key=lambda i: -views[i][2])
            for i in order:
                if not (shared[i] and new.place_tail(i, self.prefix, *views[i])):
                    if shared[i]:       # its tail alone is not its sequence
                        raise RuntimeError("bug: a sharing row could not keep the slab's prefix")
                    new._write(i, *views[i], views[i][2])
        if self.codes is not None:        # after the rows are written: placing resets a row's codes
            new.codes = self.codes.remapped(rows, keep)
        return new


def place_batch_rows(slab_layers: list[SlabKVCache], rows: list[int], batch_layers: list[Any], members: list[int],
                     roots: list[list[Any]] | None = None, min_shared: int | None = None) -> None:
    """Copy rows ``members`` of mlx-lm ``BatchKVCache`` layers (a batched prefill) into ``rows``
    (``roots[j]``: member j's roots, one per layer, for the slab's shared prefix)."""
    for li, (slab, batch) in enumerate(zip(slab_layers, batch_layers)):
        mx.eval(batch.left_padding)
        pads = batch.left_padding.tolist()
        writes = []
        for j, (row, i) in enumerate(zip(rows, members)):
            root = roots[j][li] if roots else None
            k, v = batch.keys[i:i + 1, :, pads[i]:batch._idx, :], batch.values[i:i + 1, :, pads[i]:batch._idx, :]
            planned = None
            if getattr(batch, "shares", None) and batch.shares[i]:
                # the batch held this row's prefix once: its tail moves as a tail when the slab
                # shares the same prefix, else the row is written whole
                planned = slab._tail_planned(row, batch.prefix, k, v, batch._idx - pads[i], min_shared)
                if planned is None:
                    whole = batch.take(i, whole=True)
                    planned = slab._planned(row, whole.keys, whole.values, whole.offset, root, min_shared)
            writes.append(planned or slab._planned(row, k, v, batch._idx - pads[i], root, min_shared))
        slab.fill(writes)          # an empty slab whose every row joins: built at once, else row by row
        if slab.codes is not None:                 # the rows were coded in the batched prefill
            if getattr(batch, "codes", None) is None:
                raise RuntimeError("bug: a TurboQuant slab joined from an uncoded batched prefill")
            for row, i in zip(rows, members):
                slab.codes.adopted(row, batch.codes, i)


def _own_planned(slab: SlabKVCache, row: int, own: Any, root: Any, min_shared: int | None,
                 empty: bool = False) -> tuple:
    """What placing one sequence's own layer ``own`` (a KVCache or PrefixedKVCache) in ``row``
    writes (``SlabKVCache._planned``): a prefixed layer whose prefix is the slab's as a tail.
    ``empty``: the layer may hold nothing yet (``stack_layers`` for a batched prefill)."""
    if isinstance(own, PrefixedKVCache):
        if own.n_prefix:
            tk, tv = own.tail()
            if tk is None:                         # nothing past the prefix yet
                tk, tv = own.prefix[0][..., :0, :], own.prefix[1][..., :0, :]
            planned = slab._tail_planned(row, own.prefix, tk, tv, own.offset - own.n_prefix, min_shared)
            if planned is not None:
                return planned
        own = own.whole()
    return slab._planned(row, own.keys, own.values, own.offset if own.keys is not None else 0, root, min_shared,
                         empty)


def place_own_layers(slab_layers: list[SlabKVCache], row: int, own_layers: list[KVCache],
                     roots: list[Any] | None = None, min_shared: int | None = None) -> None:
    """Copy a sequence's own KVCache layers into ``row`` (``roots``: theirs, one per layer)."""
    for li, (slab, own) in enumerate(zip(slab_layers, own_layers)):
        slab._put(*_own_planned(slab, row, own, roots[li] if roots else None, min_shared))
        slab.adopt_codes(row, own)


def is_row_layer(layer: Any) -> bool:
    """A plain ``KVCache`` layer (or one whose prefix is held by reference, ``PrefixedKVCache``):
    held as a row of a SlabKVCache (joins and leaves in place).
    Every other batchable kind (``RotatingKVCache``, ``ArraysCache``) is batched by mlx-lm's own
    ``merge`` / ``extract`` (BatchRotatingKVCache, a batched ArraysCache)."""
    return type(layer) in (KVCache, PrefixedKVCache, TurboQuantKVCache)


def merge_layer(caches: list[Any]) -> Any:
    """mlx-lm's batched form of one non-KV layer, a row per cache (in order)."""
    return type(caches[0]).merge(caches)


def stack_layers(rows: list[list[Any]], roots: list[list[Any]] | None = None,
                 min_shared: int | None = None, quant: Any = None) -> list[Any]:
    """Batched layers from per-sequence layers (``rows[i]`` is sequence i's list of layers;
    ``roots[i]`` its roots, for a shared prefix of at least ``min_shared`` tokens; ``quant``: a
    turboquant policy, the rows coded as their own layers are)."""
    kv = [i for i, layer in enumerate(rows[0]) if is_row_layer(layer)]
    out = [SlabKVCache.empty(len(rows), quant) if i in kv else merge_layer([layers[i] for layers in rows])
           for i in range(len(rows[0]))]
    for i in kv:
        out[i].fill([_own_planned(out[i], r, layers[i], roots[r][i] if roots else None, min_shared, True)
                     for r, layers in enumerate(rows)])
        for r, layers in enumerate(rows):
            out[i].adopt_codes(r, layers[i])
    return out

