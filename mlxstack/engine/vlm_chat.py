"""The chat engine for vision-language models (mlx-vlm): same cache, same API, same streaming.

    engine = VLMChatEngine(loaded, VLMChatRenderer(loaded.tokenizer), state, settings)
    outcome = engine.run(job)          # ChatEngine.run with the VLM backend seams below

What differs from the text engine (engine/chat.py):
- ``_tokenize`` (the seam of ``prepare``): images are decoded per message (prompt/images.py); the model tokens come from
  the processor with each image's placeholder expanded to its patch count. The cache key is the
  text-only tokenizer's render of the canonical messages with the same expansion, plus a
  2-token identity marker after each image's pad run (CACHE_VLM_IMAGE_IDENTITY).
- ``image_spans``: the cache accepts reuse by model-token LCP, and two images of the same size
  expand to identical pad tokens. So the lookup carries each image's pad span and marker, and the
  KV manager (cache/manager.py ``Lookup``) lets a hit cover an image only where the entry's key
  holds the same marker, else cuts it back to that image's first pad token; a reuse that would
  end inside a run of the *same* image (never on clean traffic) evicts the entry, retreats to a
  fresh prefill and bumps ``vlm_retreat``.
- ``prefill`` from offset P: embeddings for ``model_tokens[P:]`` (text embeddings with the image
  rows replaced by vision-tower features; the tower runs only for images at or after P, one
  image at a time so cold and warm runs compute identical features) are fed to the language
  model with *explicit* position ids. For mrope models (Qwen2/2.5/3-VL) the positions are
  ``get_rope_index`` over the full prompt and all image grids, sliced to ``[P:]``: a token's
  position depends only on the tokens and images before it, so the slice equals what a cold
  prefill uses, and the cached prefix was written with the same positions by the earlier request.
  Decode steps use ``offset + rope_delta`` (``rope_delta = max position + 1 - prompt length``),
  mlx-vlm's own rule, without the language model's per-instance ``_rope_deltas`` state (which
  would leak between requests and be wrong after a cache hit).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

from ..cache.kv_ops import LiveCache
from ..prompt.images import (
    ImageError,
    ImageLimits,
    expand_image_pads,
    extract_images,
    image_marker_tokens,
    image_pad_runs,
    inject_image_markers,
    is_image_part,
)
from ..prompt.render import ChatRenderer, content_text, encode
from .chat import ChatEngine, PreparedPrompt
from ..runner.vlm import DecodeLM, WholePrefill

log = logging.getLogger("mlxstack.request")


class VLMChatRenderer(ChatRenderer):
    """Keeps image parts (as ``{"type": "image"}``, the form VLM templates expect) in place."""

    def render_content(self, content: list, index: int) -> Any:
        if not any(is_image_part(p) for p in content):
            return content_text(content)
        parts: list[dict] = []
        for part in content:
            if is_image_part(part):
                parts.append({"type": "image"})
            elif isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                parts.append({"type": "text", "text": str(part.get("text", ""))})
        return parts


def _count_image_parts(messages: Sequence[Any]) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for p in m["content"] if is_image_part(p))


class VLMChatEngine(ChatEngine):
    def __init__(self, loaded: Any, renderer: Any, state: Any, settings: Any) -> None:
        super().__init__(loaded, renderer, state, settings)
        model = loaded.model
        cfg = getattr(model, "config", None)
        self.lm = model.language_model
        state.kv.cache_model = self.lm    # its caches are the language model's (no KV quantisation: factory.py)
        self.image_pad_id = int(getattr(cfg, "image_token_id", None)
                                if getattr(cfg, "image_token_id", None) is not None
                                else loaded.config.get("image_token_id", loaded.config.get("image_token_index")))
        vision = getattr(cfg, "vision_config", None)
        self.merge = int(getattr(vision, "spatial_merge_size", 1) or 1)
        self.vocab_size = int(loaded.config.get("vocab_size") or loaded.config.get("text_config", {}).get("vocab_size") or 0)
        # Qwen2/2.5/3-VL family: multimodal rope computed by the language model from the grids.
        self.mrope = hasattr(self.lm, "get_rope_index")
        self.per_image_vision = (self.mrope and hasattr(model, "vision_tower")
                                 and hasattr(model, "merge_input_ids_with_image_features"))
        self.limits = ImageLimits.from_settings(settings)
        self._decoder = DecodeLM(self.lm, self.mrope, 0)

    def runner_context(self) -> Any:
        """The language model is what caches and decode steps are made of (prefill: embeddings)."""
        ctx = super().runner_context()
        model = self.loaded.model
        lm = ctx.model = ctx.decode_model = model.language_model
        mrope = hasattr(lm, "get_rope_index")
        ctx.whole_prefill = WholePrefill(model, lm, mrope, mrope and hasattr(model, "vision_tower")
                                         and hasattr(model, "merge_input_ids_with_image_features"), ctx.prefill_step)
        return ctx

    # ---------------------------------------------------------------- pipeline
    def _tokenize(self, original: list[dict], canonical: list[dict], model_text: str,
                  key_text: str) -> tuple[list[int], list[int], dict, int]:
        """Images decoded per message; model tokens from the processor (each placeholder expanded
        to its patch count); the key is the text render with the same expansion plus a 2-token
        identity marker after each image."""
        s = self.settings
        images = extract_images(original, self.limits)
        if _count_image_parts(canonical) != len(images):
            raise RuntimeError(f"bug: canonical messages hold {_count_image_parts(canonical)} images, "
                               f"original {len(images)}")
        tok = self.loaded.tokenizer
        extras: dict[str, Any] = {"images": images, "spans": [], "counts": [], "markers": [],
                                  "pixel_values": [], "grids": []}
        if not images:
            model_tokens = encode(tok, model_text)
            if image_pad_runs(model_tokens, self.image_pad_id):
                raise ImageError("the text contains image placeholder tokens but the request has no images")
        else:
            from mlx_vlm.utils import prepare_inputs

            inputs = prepare_inputs(self.loaded.processor, images=[im.image for im in images], prompts=model_text)
            model_tokens = inputs["input_ids"][0].tolist()
            grids = inputs["image_grid_thw"].tolist()
            counts = [int(t * h * w) // (self.merge ** 2) for t, h, w in grids]
            spans = image_pad_runs(model_tokens, self.image_pad_id)
            if len(spans) != len(images) or [e - b for b, e in spans] != counts:
                raise ImageError(f"the rendered prompt has {len(spans)} image placeholders for the {len(images)} "
                                 "images sent: the chat template drops images in some message roles, or the "
                                 "text contains literal image tokens")
            rows = [int(t * h * w) for t, h, w in grids]
            pixel_values = inputs["pixel_values"]
            cuts = np.cumsum([0] + rows).tolist()
            extras.update(spans=spans, counts=counts, grids=grids,
                          pixel_values=[pixel_values[a:b] for a, b in zip(cuts[:-1], cuts[1:])],
                          markers=[image_marker_tokens(im.digest, self.vocab_size) for im in images])
        if key_text == model_text:
            key_tokens = list(model_tokens)
        else:
            key_tokens = expand_image_pads(encode(tok, key_text), self.image_pad_id, extras["counts"])
        if images and s.cache_vlm_image_identity:
            key_tokens = inject_image_markers(key_tokens, self.image_pad_id, [im.digest for im in images],
                                              self.vocab_size)
        if s.vlm_cache_debug:
            log.info("vlm images=%d spans=%s first ids=%s", len(images), extras["spans"], model_tokens[:64])
        return model_tokens, key_tokens, extras, 2 * len(images) if s.cache_vlm_image_identity else 0

    def _plain_key(self, model_tokens: list[int], extras: dict) -> list[int]:
        images = extras.get("images") or []
        if images and self.settings.cache_vlm_image_identity:
            return inject_image_markers(model_tokens, self.image_pad_id, [im.digest for im in images], self.vocab_size)
        return list(model_tokens)

    def _tokens_of(self, text: str, prep: PreparedPrompt) -> list[int]:
        """Model tokens of a prefix of the prompt's text, each image's pads expanded."""
        return expand_image_pads(encode(self.loaded.tokenizer, text), self.image_pad_id, prep.extras["counts"])

    def key_prefix(self, prep: PreparedPrompt, depth: int) -> list[int]:
        """Key of ``model_tokens[:depth]``: the markers of the images that end by ``depth`` included."""
        if not self.settings.cache_vlm_image_identity:
            return prep.key_tokens[:depth]
        covered = sum(1 for _, end in prep.extras.get("spans", []) if end <= depth)
        return prep.key_tokens[: depth + 2 * covered]

    # ---------------------------------------------------------------- backend seams
    @property
    def decode_model(self) -> Any:
        return self._decoder

    def image_spans(self, prep: PreparedPrompt) -> tuple[tuple, tuple | None]:
        """Each image's pads and, under CACHE_VLM_IMAGE_IDENTITY, its marker: the KV manager never
        reuses an image an entry did not see, never cuts inside one (cache/manager.py)."""
        spans = tuple(tuple(sp) for sp in prep.extras.get("spans") or ())
        markers = prep.extras.get("markers") if self.settings.cache_vlm_image_identity else None
        return spans, (tuple(tuple(m) for m in markers) if markers is not None else None)

    def prefill(self, work: LiveCache, prep: PreparedPrompt, start: int,
                checkpoint: Callable[[LiveCache], None], at: list[int],
                should_stop: Callable[[], bool] | None = None) -> Any:
        """The runner's VLM prefill seam (runner/vlm.py ``WholePrefill``), outside a step (tests)."""
        logits, self._decoder = self.runner.whole_prefill(work, prep, start, checkpoint, at, should_stop)
        return logits
