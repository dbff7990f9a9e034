"""Decode several sequences together: one forward pass, one token each, per step.

    group = DecodeGroup(engine, batching=True)
    group.add(seq, first_logits)          # after its prefill; samples its first token (lazy)
    finished = group.step()               # feeds every pending token, samples the next ones,
                                          # then reads the previous ones (pipelined like decode())

With ``batching`` the members' KV layers live in one ``SlabKVCache`` per layer (engine/
batch_cache.py: mlx-lm's ``BatchKVCache`` layout -- rows right-aligned with per-row left padding,
RoPE offsets and masks -- that sequences join and leave in place, one row each): built when a
second sequence joins; a sequence that leaves gets its own ``KVCache`` layers back (a copy of its
row) so the engine closes its turn and stores it like any other, and its row is free for the next
one. Rows double when full and halve when most are free. A group of one always decodes on the
sequence's own cache. Without ``batching`` (cache kinds mlx-lm has no
batched form for), each member is stepped on its own cache in turn: streams interleave, the
arithmetic is the sequential one.

Each member keeps everything that is per request: its sampler and PRNG key (a seeded request
keeps its own stream), stop strings, detokenizer, watchdog and hang-up checks.
"""
from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from ..runtime.mlx_stream import generation_stream
from .batch_cache import SlabKVCache, place_batch_rows, place_own_layers
from .chat import ChatEngine, Sequence

log = logging.getLogger("mlxstack.batch")

COMPACT_SLACK = 256   # drop unused leading columns once every active row has this much padding


class DecodeGroup:
    def __init__(self, engine: ChatEngine, batching: bool) -> None:
        self.engine = engine
        self.batching = batching
        self.seqs: list[Sequence] = []
        self.slab: list[SlabKVCache] | None = None   # one per layer while len(seqs) > 1
        self.row: dict[int, int] = {}                 # id(seq) -> its row in the slab

    def __len__(self) -> int:
        return len(self.seqs)

    # ------------------------------------------------------------------ membership
    def add(self, seq: Sequence, logits: mx.array | None) -> None:
        """Add a sequence after its prefill: with ``logits`` its first token is sampled now; without,
        its last prompt token is still to be fed and rides in the next decode step."""
        if logits is None:
            seq.pending, seq.tail = mx.array(seq.prep.model_tokens[-1], dtype=mx.int32), True
        else:
            with mx.stream(generation_stream()):
                seq.pending = seq.sampler.sample(logits)
            mx.async_eval(seq.pending)
        if self.batching and self.seqs:
            self._make_room(1, len(seq.live.layers))
            row = self._free_rows()[0]
            place_own_layers(self.slab, row, seq.live.layers)
            self.row[id(seq)] = row
        self.seqs.append(seq)

    def adopt(self, seqs: list[Sequence], layers: list[Any], members: list[int]) -> None:
        """Add sequences prefilled together (engine/batch_prefill.py): row ``members[i]`` of
        ``layers`` (mlx-lm BatchKVCache, one per layer) is ``seqs[i]``'s KV up to its last prompt
        token, which rides in the next decode step."""
        for seq in seqs:
            seq.pending, seq.tail = mx.array(seq.prep.model_tokens[-1], dtype=mx.int32), True
        self._make_room(len(seqs), len(layers))
        rows = self._free_rows()[:len(seqs)]
        place_batch_rows(self.slab, rows, layers, members)
        for seq, row in zip(seqs, rows):
            self.row[id(seq)] = row
        self.seqs.extend(seqs)

    def _free_rows(self) -> list[int]:
        taken = set(self.row.values())
        return [r for r in range(self.slab[0].rows) if r not in taken] if self.slab else []

    def _make_room(self, joining: int, n_layers: int) -> None:
        """A slab with at least ``joining`` free rows (built from a group of one on its own cache)."""
        need = len(self.seqs) + joining
        if self.slab is None:
            self.slab = [SlabKVCache.empty(_pow2(need)) for _ in range(n_layers)]
            if self.seqs:                                   # the one member so far: row 0
                only = self.seqs[0]
                place_own_layers(self.slab, 0, only.live.layers)
                self.row[id(only)] = 0
        elif need > self.slab[0].rows:
            self._rebuild(_pow2(need), self.seqs)

    def _rebuild(self, rows: int, members: list[Sequence]) -> None:
        """Move ``members`` to a slab of ``rows`` rows (rows 0..n-1, in that order)."""
        keep = [self.row[id(s)] for s in members]
        with mx.stream(generation_stream()):
            self.slab = [layer.rebuilt(rows, keep) for layer in self.slab]
            mx.eval([x for layer in self.slab for x in (layer.keys, layer.values)])
        self.row = {id(s): i for i, s in enumerate(members)}

    def _leave(self, gone: list[Sequence]) -> None:
        """Give leaving members their own caches back (a copy of their row); free the rows."""
        if self.slab is None:
            return
        for seq in gone:
            row = self.row.pop(id(seq))
            seq.live.layers = [layer.take(row) for layer in self.slab]
        gone_ids = {id(s) for s in gone}
        rest = [s for s in self.seqs if id(s) not in gone_ids]
        if len(rest) <= 1:                                 # back to a group of one: its own cache
            for seq in rest:
                row = self.row.pop(id(seq))
                seq.live.layers = [layer.take(row) for layer in self.slab]
            self.slab, self.row = None, {}
        elif len(rest) <= self.slab[0].rows // 4:          # mostly free rows: compute on fewer
            self._rebuild(_pow2(len(rest)), rest)
        else:                                              # columns only the leavers used
            active = [self.row[id(s)] for s in rest]
            for layer in self.slab:
                layer.compact(active, COMPACT_SLACK)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Sequence]:
        """Advance every member by one token; return the members that finished (removed)."""
        if not self.seqs:
            return []
        stream = generation_stream()
        model = self.engine.decode_model
        current = [s.pending for s in self.seqs]
        with mx.stream(stream):
            for s in self.seqs:
                if not s.tail:                       # a prompt token is already in the history
                    s.sampler.accept(s.pending)
            if self.slab is not None:
                by_row = {self.row[id(s)]: t.reshape(()) for s, t in zip(self.seqs, current)}
                dummy = mx.array(0, dtype=mx.int32)
                tokens = mx.stack([by_row.get(r, dummy) for r in range(self.slab[0].rows)])[:, None]
                logits = model(tokens, cache=self.slab)[:, -1, :]
                nxt = [s.sampler.sample(logits[self.row[id(s)]]) for s in self.seqs]
                for s in self.seqs:
                    s.live.advance(1)
            else:
                nxt = []
                for s, t in zip(self.seqs, current):
                    s.live.maybe_quantize()
                    logits = model(t.reshape(1, 1), cache=s.live.layers)[:, -1, :]
                    s.live.advance(1)
                    nxt.append(s.sampler.sample(logits))
        mx.async_eval(nxt)
        size = len(self.seqs) if self.slab is not None else 1
        done: list[Sequence] = []
        for s, t, n in zip(self.seqs, current, nxt):
            s.batch_sizes.append(size)
            if s.tail:                               # fed the last prompt token: nothing to read yet
                s.tail = False
                if self.engine._should_stop(s)():
                    done.append(s)
                else:
                    s.pending = n
            elif self.engine.consume(s, int(t.item())) or self.engine._should_stop(s)():
                done.append(s)
            else:
                s.pending = n
        if not done:
            return []
        self._leave(done)
        done_ids = {id(s) for s in done}
        self.seqs = [s for s in self.seqs if id(s) not in done_ids]
        return done

    def drop(self, seq: Sequence) -> None:
        """Remove a member after a failure (its cache is given back like any leaver's)."""
        if any(s is seq for s in self.seqs):
            self._leave([seq])
            self.seqs = [s for s in self.seqs if s is not seq]


def _pow2(n: int) -> int:
    return 1 << max(1, (max(1, n) - 1).bit_length())


def batching_support(engine: ChatEngine) -> tuple[bool, str]:
    """Whether this model decodes correctly in one batched forward: only plain KV layers (mlx-lm
    has no batched form for the other kinds here), no KV quantisation, not a VLM -- and a real
    check: two sequences of different lengths stepped together give the logits each gives alone."""
    layout = engine.state.layout
    if engine.loaded.is_vlm:
        return False, "vision-language models prefill through mlx-vlm's own path"
    if not layout.supported or any(k != "kv" for k in layout.kinds):
        return False, f"cache layout {layout.describe()} has no batched form"
    if engine.state.kv_quant is not None:
        return False, "KV_BITS: quantised KV layers have no batched form"
    from ..runtime.generate import feed

    model = engine.loaded.model
    try:
        lives = []
        for n in (5, 9):
            live = engine.new_cache()
            feed(model, live, list(range(100, 100 + n)), 16)
            lives.append(live)
        nxt = mx.array([[7], [11]], dtype=mx.int32)
        alone = [model(nxt[i:i + 1], cache=lv.layers)[:, -1, :] for i, lv in enumerate(lives)]
        lives2 = []
        for n in (5, 9):
            live = engine.new_cache()
            feed(model, live, list(range(100, 100 + n)), 16)
            lives2.append(live)
        batch = [SlabKVCache.empty(2) for _ in lives2[0].layers]
        for row, live in enumerate(lives2):
            place_own_layers(batch, row, live.layers)
        together = model(nxt, cache=batch)[:, -1, :]
        ok = all(mx.allclose(together[i], alone[i][0], atol=1e-3, rtol=1e-3).item() for i in range(2))
    except Exception as exc:  # noqa: BLE001 - any failure: this model decodes one sequence at a time
        return False, f"batched forward failed ({type(exc).__name__}: {exc})"
    return (True, "") if ok else (False, "batched logits differ from single-sequence logits")
