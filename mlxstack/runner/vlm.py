"""The forwards of a vision-language model (mlx-vlm): vision features, the prompt's embeddings
fed to the language model with explicit positions, and decode steps that continue them.

    embeds = embeddings(model, lm, per_image_vision, ids, extras, start)
    positions, delta = rope_positions(lm, mrope, ids, extras)
    logits = prefill_embedded(lm, ids, embeds, positions, live, start, step, bounds, checkpoint, stop)
    decoder = DecodeLM(lm, mrope, delta)          # decoder(tokens, cache) -> logits
    logits, decoder = WholePrefill(model, lm, mrope, per_image_vision, step)(live, prep, start, checkpoint, at, stop)

Why explicit positions and one image at a time: engine/vlm_chat.py (a cached prefix was written
with the same positions; cold and warm runs compute identical features).
"""
from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from ..cache.kv_ops import LiveCache, kv_offset
from .generate import Aborted, cache_arrays
from .mlx_stream import generation_stream


class DecodeLM:
    """``model(tokens[None], cache=cache) -> logits`` over the VLM's language model, with
    positions ``offset + rope_delta`` (mrope) so decode continues the prompt's position stream."""

    def __init__(self, lm: Any, mrope: bool, rope_delta: int) -> None:
        self.lm = lm
        self.mrope = mrope
        self.rope_delta = rope_delta

    def __call__(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        if not self.mrope:
            return self.lm(tokens, cache=cache).logits
        off = kv_offset(cache) + self.rope_delta
        n = tokens.shape[1]
        pos = mx.broadcast_to(mx.arange(off, off + n, dtype=mx.int32)[None, None], (3, 1, n))
        return self.lm(tokens, cache=cache, position_ids=pos).logits


def rope_positions(lm: Any, mrope: bool, ids: mx.array, extras: dict) -> tuple[mx.array | None, int]:
    """Multimodal rope positions over the whole prompt and its image grids, and the delta decode
    continues from (None, 0 for a model without mrope)."""
    if not mrope:
        return None, 0
    n = ids.shape[1]
    if not extras["spans"]:
        return mx.broadcast_to(mx.arange(n, dtype=mx.int32)[None, None], (3, 1, n)), 0
    grid = mx.array(extras["grids"], dtype=mx.int32)
    positions, deltas = lm.get_rope_index(ids, grid, None, None)
    return positions.astype(mx.int32), int(deltas.reshape(-1)[0].item())


def embeddings(model: Any, lm: Any, per_image_vision: bool, ids: mx.array, extras: dict, start: int) -> mx.array:
    """Embeddings of ``ids[start:]``: text embeddings with each image's pad rows replaced by its
    vision-tower features (the tower runs only for images at or after ``start``)."""
    spans = extras["spans"]
    if not spans:
        return lm.model.embed_tokens(ids[:, start:])
    if not per_image_vision:
        # Generic VLM: mlx-vlm's own merge over the whole prompt, then the tail.
        pv = mx.concatenate(extras["pixel_values"], axis=0)
        feats = model.get_input_embeddings(ids, pv, image_grid_thw=mx.array(extras["grids"]))
        return feats.inputs_embeds[:, start:]
    embeds = lm.model.embed_tokens(ids[:, start:])
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    pieces, cursor = [], start
    for k, (s, e) in enumerate(spans):
        if s < start:
            if e > start:
                raise RuntimeError(f"bug: prefill from {start} cuts image {k} [{s}, {e})")
            continue
        grid = mx.array([extras["grids"][k]], dtype=mx.int32)
        feats = model.vision_tower(extras["pixel_values"][k].astype(dtype), grid, output_hidden_states=False)
        if feats.shape[0] != e - s:
            raise RuntimeError(f"bug: image {k} gave {feats.shape[0]} features for {e - s} pad tokens")
        pieces += [embeds[:, cursor - start:s - start], feats.astype(embeds.dtype)[None]]
        cursor = e
    pieces.append(embeds[:, cursor - start:])
    return mx.concatenate(pieces, axis=1)


def prefill_embedded(lm: Any, ids: mx.array, embeds: mx.array, positions: mx.array | None, work: LiveCache,
                     start: int, step: int, bounds: list[int], checkpoint: Callable[[LiveCache], None],
                     should_stop: Callable[[], bool] | None) -> mx.array | None:
    """Feed ``embeds`` (the prompt from ``start``) to the language model in chunks of ``step``,
    stopping at each of ``bounds`` for a ``checkpoint``; the last token's logits (float32)."""
    n = ids.shape[1]
    logits = None
    done = start
    for stop in bounds + [n]:
        for a in range(done, stop, step):
            b = min(a + step, stop)
            if should_stop is not None and a > start and should_stop():
                raise Aborted("prefill abandoned")
            with mx.stream(generation_stream()):
                kwargs = {} if positions is None else {"position_ids": positions[..., a:b]}
                out = lm(ids[:, a:b], inputs_embeds=embeds[:, a - start:b - start], cache=work.layers, **kwargs)
                work.advance(b - a)
                if b == n:
                    logits = out.logits[:, -1, :].astype(mx.float32).squeeze(0)
                    mx.eval(logits)
                else:
                    mx.eval(cache_arrays(work))
        done = stop
        if stop < n:
            checkpoint(work)
    mx.clear_cache()
    return logits


class WholePrefill:
    """A VLM's prefill seam (RunnerContext ``whole_prefill``): the rest of a prompt from ``start``
    in one call -- its embeddings (the images at or after ``start`` through the vision tower), its
    positions, fed in chunks of ``step`` with a checkpoint at each of ``at`` (offsets from
    ``start``) -- returning the last token's logits and the module the row decodes through."""

    def __init__(self, model: Any, lm: Any, mrope: bool, per_image_vision: bool, step: int) -> None:
        self.model, self.lm, self.mrope, self.per_image_vision = model, lm, mrope, per_image_vision
        self.step = max(1, int(step))

    def __call__(self, live: LiveCache, prep: Any, start: int, checkpoint: Callable[[LiveCache], None],
                 at: list[int], stop: Callable[[], bool] | None = None) -> tuple[mx.array, DecodeLM]:
        tokens = prep.model_tokens
        n = len(tokens)
        if start >= n:
            raise ValueError("prefill needs at least one token")
        ids = mx.array(tokens, dtype=mx.int32)[None]
        with mx.stream(generation_stream()):
            embeds = embeddings(self.model, self.lm, self.per_image_vision, ids, prep.extras, start)
            positions, delta = rope_positions(self.lm, self.mrope, ids, prep.extras)
        bounds = sorted({start + k for k in at if 0 < k < n - start})
        logits = prefill_embedded(self.lm, ids, embeds, positions, live, start, self.step, bounds, checkpoint, stop)
        return logits, DecodeLM(self.lm, self.mrope, delta)
