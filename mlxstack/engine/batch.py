"""Decode several sequences together: one forward pass, one token each, per step.

    group = DecodeGroup(engine, batching=True)
    group.add(seq, first_logits)          # after its prefill; samples its first token (lazy)
    finished = group.step()               # feeds every pending token, samples the next ones,
                                          # then reads the previous ones (pipelined like decode())

With ``batching`` the members' KV layers live in one mlx-lm ``BatchKVCache`` per layer
(left-padded to a common length, per-sequence RoPE offsets and masks), built when a second
sequence joins and filtered when one leaves; a sequence that leaves gets its own ``KVCache``
layers back (``extract``) so the engine closes its turn and stores it like any other. A group of
one always decodes on the sequence's own cache. Without ``batching`` (cache kinds mlx-lm has no
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
from .chat import ChatEngine, Sequence

log = logging.getLogger("mlxstack.batch")


class DecodeGroup:
    def __init__(self, engine: ChatEngine, batching: bool) -> None:
        self.engine = engine
        self.batching = batching
        self.seqs: list[Sequence] = []
        self.batch_layers: list[Any] | None = None   # one BatchKVCache per layer while len(seqs) > 1

    def __len__(self) -> int:
        return len(self.seqs)

    # ------------------------------------------------------------------ membership
    def add(self, seq: Sequence, logits: mx.array) -> None:
        with mx.stream(generation_stream()):
            seq.pending = seq.sampler.sample(logits)
        mx.async_eval(seq.pending)
        if self.batching and self.seqs:
            self._join(seq)
        self.seqs.append(seq)

    def _join(self, seq: Sequence) -> None:
        from mlx_lm.models.cache import BatchKVCache

        if self.batch_layers is None:                      # second member: build the batch
            only = self.seqs[0]
            self.batch_layers = [BatchKVCache.merge([c]) for c in only.live.layers]
        for layer, own in zip(self.batch_layers, seq.live.layers):
            layer.extend(BatchKVCache.merge([own]))

    def _leave(self, gone: list[int]) -> None:
        """Give leaving members their own caches back and shrink the batch to the rest."""
        if self.batch_layers is None:
            return
        for i in gone:
            seq = self.seqs[i]
            seq.live.layers = [layer.extract(i) for layer in self.batch_layers]
        keep = [i for i in range(len(self.seqs)) if i not in gone]
        if len(keep) == 1:                                 # back to a group of one: its own cache
            seq = self.seqs[keep[0]]
            seq.live.layers = [layer.extract(keep[0]) for layer in self.batch_layers]
            self.batch_layers = None
        elif keep:
            for layer in self.batch_layers:
                layer.filter(keep)
        else:
            self.batch_layers = None

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
                s.sampler.accept(s.pending)
            if self.batch_layers is not None:
                tokens = mx.stack([t.reshape(()) for t in current])[:, None]
                logits = model(tokens, cache=self.batch_layers)[:, -1, :]
                nxt = [s.sampler.sample(logits[i]) for i, s in enumerate(self.seqs)]
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
        size = len(self.seqs)
        done: list[int] = []
        for i, (s, t) in enumerate(zip(self.seqs, current)):
            s.batch_sizes.append(size if self.batch_layers is not None else 1)
            if self.engine.consume(s, int(t.item())) or self.engine._should_stop(s)():
                done.append(i)
            else:
                s.pending = nxt[i]
        if not done:
            return []
        finished = [self.seqs[i] for i in done]
        self._leave(done)
        self.seqs = [s for i, s in enumerate(self.seqs) if i not in done]
        return finished

    def drop(self, seq: Sequence) -> None:
        """Remove a member after a failure (its cache is given back like any leaver's)."""
        if seq in self.seqs:
            i = self.seqs.index(seq)
            self._leave([i])
            self.seqs.pop(i)


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
    from mlx_lm.models.cache import BatchKVCache

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
        batch = [BatchKVCache.merge([a, b]) for a, b in zip(lives2[0].layers, lives2[1].layers)]
        together = model(nxt, cache=batch)[:, -1, :]
        ok = all(mx.allclose(together[i], alone[i][0], atol=1e-3, rtol=1e-3).item() for i in range(2))
    except Exception as exc:  # noqa: BLE001 - any failure: this model decodes one sequence at a time
        return False, f"batched forward failed ({type(exc).__name__}: {exc})"
    return (True, "") if ok else (False, "batched logits differ from single-sequence logits")
