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
sequence's own cache.

Layers of other kinds are batched with mlx-lm's own forms: sliding windows as one
``BatchRotatingKVCache``, recurrent / conv state as one batched ``ArraysCache`` -- rebuilt from
every member's state (``extract`` then ``merge``) whenever a member joins or leaves; a window or a
recurrent state is small and bounded, so the copy is too. Gemma 3, GPT-OSS, Mamba, LFM2 and
Qwen3-Next batch this way (their global-attention layers are slab rows). Without ``batching``
(chunked attention, CacheList, KV_BITS: no batched form), each member is stepped on its own
cache in turn: streams interleave, the arithmetic is the sequential one.

Each member keeps everything that is per request: its sampler and PRNG key (a seeded request
keeps its own stream), stop strings, detokenizer, watchdog and hang-up checks.
"""
from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from ..runtime.mlx_stream import generation_stream
from .batch_cache import SlabKVCache, is_row_layer, merge_layer, place_batch_rows, place_own_layers, stack_layers
from .chat import ChatEngine, Sequence

log = logging.getLogger("mlxstack.batch")

COMPACT_SLACK = 256   # drop unused leading columns once every active row has this much padding
BATCHABLE_KINDS = ("kv", "rotating", "arrays")   # cache kinds (cache/layer_kinds.py) with a batched form


class DecodeGroup:
    def __init__(self, engine: ChatEngine, batching: bool) -> None:
        self.engine = engine
        self.batching = batching
        # plain-KV models: several short prefills in one forward, turns closed together
        self.dense = batching and all(k == "kv" for k in engine.state.layout.kinds)
        self.seqs: list[Sequence] = []
        self.slab: list[Any] | None = None    # per layer, while len(seqs) > 1: a SlabKVCache (KV
        #                                       layers) or mlx-lm's batched form (other kinds)
        self.rows = 0                          # rows of the batch (members + free rows)
        self.row: dict[int, int] = {}          # id(seq) -> its row
        self.kv_idx: list[int] = []            # layers held as slab rows
        self.other_idx: list[int] = []         # layers merged / extracted by mlx-lm

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
            self._split(seq.live.layers)
            states = self._other_states()
            self._make_room(1, seq.live.layers)
            row = self._free_rows()[0]
            self._place_own(row, seq.live.layers)
            self.row[id(seq)] = row
            states[id(seq)] = [seq.live.layers[i] for i in self.other_idx]
            self.seqs.append(seq)
            self._merge_other(states)
            return
        self.seqs.append(seq)

    def adopt(self, seqs: list[Sequence], layers: list[Any], members: list[int]) -> None:
        """Add sequences prefilled together (engine/batch_prefill.py, plain-KV models): row
        ``members[i]`` of ``layers`` (mlx-lm BatchKVCache, one per layer) is ``seqs[i]``'s KV up to
        its last prompt token, which rides in the next decode step."""
        for seq in seqs:
            seq.pending, seq.tail = mx.array(seq.prep.model_tokens[-1], dtype=mx.int32), True
        self._split(seqs[0].live.layers)
        self._make_room(len(seqs), seqs[0].live.layers)
        rows = self._free_rows()[:len(seqs)]
        place_batch_rows(self.slab, rows, layers, members)
        for seq, row in zip(seqs, rows):
            self.row[id(seq)] = row
        self.seqs.extend(seqs)

    def _free_rows(self) -> list[int]:
        taken = set(self.row.values())
        return [r for r in range(self.rows) if r not in taken] if self.slab else []

    def _place_own(self, row: int, layers: list[Any]) -> None:
        place_own_layers([self.slab[i] for i in self.kv_idx], row, [layers[i] for i in self.kv_idx])

    def _make_room(self, joining: int, layers: list[Any]) -> None:
        """A batch with at least ``joining`` free rows (built from a group of one on its own
        cache). Non-KV layers are re-merged by the caller (_merge_other)."""
        need = len(self.seqs) + joining
        if self.slab is None:
            self.rows = _pow2(need)
            self.slab = [SlabKVCache.empty(self.rows) if i in self.kv_idx else None for i in range(len(layers))]
            if self.seqs:                                   # the one member so far: row 0
                only = self.seqs[0]
                self._place_own(0, only.live.layers)
                self.row[id(only)] = 0
        elif need > self.rows:
            self._rebuild(_pow2(need), self.seqs)

    def _rebuild(self, rows: int, members: list[Sequence]) -> None:
        """Move ``members``' KV rows to a slab of ``rows`` rows (rows 0..n-1, in that order);
        non-KV layers are re-merged by the caller."""
        keep = [self.row[id(s)] for s in members]
        with mx.stream(generation_stream()):
            for i in self.kv_idx:
                self.slab[i] = self.slab[i].rebuilt(rows, keep)
            mx.eval([x for i in self.kv_idx for x in (self.slab[i].keys, self.slab[i].values)])
        self.rows = rows
        self.row = {id(s): i for i, s in enumerate(members)}

    def _other_states(self) -> dict[int, list[Any]]:
        """Each member's non-KV layers: its own caches while the group has no batch, else copies
        extracted from the batched layers."""
        if self.slab is None:
            return {id(s): [s.live.layers[i] for i in self.other_idx] for s in self.seqs}
        return {id(s): [self.slab[i].extract(self.row[id(s)]) for i in self.other_idx] for s in self.seqs}

    def _split(self, layers: list[Any]) -> None:
        """Which layers are slab rows and which mlx-lm merges (once: the model's layout)."""
        if not self.kv_idx and not self.other_idx:
            self.kv_idx = [i for i, layer in enumerate(layers) if is_row_layer(layer)]
            self.other_idx = [i for i, layer in enumerate(layers) if not is_row_layer(layer)]

    def _merge_other(self, states: dict[int, list[Any]]) -> None:
        """Rebuild every non-KV layer's batch from the members' states, in row order. A free row
        repeats a member's state: an empty row would be fully masked, compute NaN, and carry it
        into the KV rows of the same row."""
        if not self.other_idx or self.slab is None:
            return
        by_row = {self.row[key]: st for key, st in states.items() if key in self.row}
        filler = next(iter(by_row.values()))
        with mx.stream(generation_stream()):
            for j, i in enumerate(self.other_idx):
                self.slab[i] = merge_layer([by_row.get(r, filler)[j] for r in range(self.rows)])
            mx.eval([a for i in self.other_idx for a in _arrays(self.slab[i])])

    def _leave(self, gone: list[Sequence]) -> None:
        """Give leaving members their own caches back (a copy of their row); free the rows."""
        if self.slab is None:
            return
        states = self._other_states()
        gone_ids = {id(s) for s in gone}
        rest = [s for s in self.seqs if id(s) not in gone_ids]
        back = gone + (rest if len(rest) <= 1 else [])
        for seq in back:
            row = self.row.pop(id(seq))
            layers: list[Any] = [None] * len(self.slab)
            for i in self.kv_idx:
                layers[i] = self.slab[i].take(row)
            for j, i in enumerate(self.other_idx):
                layers[i] = states[id(seq)][j]
            seq.live.layers = layers
        if len(rest) <= 1:                                 # back to a group of one: its own cache
            self.slab, self.row, self.rows = None, {}, 0
            return
        if len(rest) <= self.rows // 4:                    # mostly free rows: compute on fewer
            self._rebuild(_pow2(len(rest)), rest)
        else:                                              # columns only the leavers used
            active = [self.row[id(s)] for s in rest]
            for i in self.kv_idx:
                self.slab[i].compact(active, COMPACT_SLACK)
        self._merge_other({id(s): states[id(s)] for s in rest})

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
                tokens = mx.stack([by_row.get(r, dummy) for r in range(self.rows)])[:, None]
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


def _arrays(layer: Any) -> list[mx.array]:
    """The arrays a batched layer holds (to evaluate them once built)."""
    if hasattr(layer, "cache"):                            # ArraysCache
        return [a for a in layer.cache if a is not None]
    return [a for a in (layer.keys, layer.values) if a is not None]


def _pow2(n: int) -> int:
    return 1 << max(1, (max(1, n) - 1).bit_length())


def batching_support(engine: ChatEngine) -> tuple[bool, str]:
    """Whether this model decodes correctly in one batched forward: plain KV layers (slab rows),
    sliding windows and recurrent / conv state (mlx-lm's BatchRotatingKVCache and batched
    ArraysCache); not chunked attention or CacheList (no batched form in mlx-lm), no KV
    quantisation, not a VLM -- and a real check: two sequences of different lengths stepped
    together give the logits each gives alone."""
    layout = engine.state.layout
    if engine.loaded.is_vlm:
        return False, "vision-language models prefill through mlx-vlm's own path"
    if not layout.supported or any(k not in BATCHABLE_KINDS for k in layout.kinds):
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
        batch = stack_layers([live.layers for live in lives2])
        together = model(nxt, cache=batch)[:, -1, :]
        ok = all(mx.allclose(together[i], alone[i][0], atol=1e-3, rtol=1e-3).item() for i in range(2))
    except Exception as exc:  # noqa: BLE001 - any failure: this model decodes one sequence at a time
        return False, f"batched forward failed ({type(exc).__name__}: {exc})"
    return (True, "") if ok else (False, "batched logits differ from single-sequence logits")
