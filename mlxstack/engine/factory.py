"""One place that builds the request engine for a loaded model (server and tests share it).

    engine = make_engine(load_model(settings), settings)   # engine.renderer, engine.state
"""
from __future__ import annotations

import logging
from typing import Any

from ..cache.layer_kinds import CacheLayout, probe_layout
from ..pipeline.render import ChatRenderer
from .chat import ChatEngine
from .state import EngineState

log = logging.getLogger("mlxstack.engine")


def make_engine(loaded: Any, settings: Any) -> ChatEngine:
    """ChatEngine for text models, VLMChatEngine (engine/vlm_chat.py) when ``loaded.is_vlm``."""
    if loaded.is_vlm:
        from .vlm_chat import VLMChatEngine, VLMChatRenderer

        renderer: ChatRenderer = VLMChatRenderer(loaded.tokenizer, preserve_thinking=settings.preserve_thinking)
        engine_cls: type[ChatEngine] = VLMChatEngine
    else:
        renderer = ChatRenderer(loaded.tokenizer, preserve_thinking=settings.preserve_thinking)
        engine_cls = ChatEngine
    layout = probe_cache_layout(loaded)
    if not layout.supported:
        log.warning("model %s builds cache layers of a kind this server does not know (%s): prefix caching "
                    "is OFF for this model (every request is a cold prefill); please report the class name",
                    loaded.model_id, ", ".join(layout.unknown))
    else:
        log.info("cache layout: %s", layout.describe())
    state = EngineState(settings, loaded.model_id, renderer.template_source, layout)
    return engine_cls(loaded, renderer, state, settings)


def probe_cache_layout(loaded: Any) -> CacheLayout:
    """Build one cache for the model and classify its layers (cache/layer_kinds.py)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded.model.language_model if loaded.is_vlm else loaded.model
    return probe_layout(make_prompt_cache(model))
