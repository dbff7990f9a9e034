"""One place that builds the request engine for a loaded model (server and tests share it).

    engine = make_engine(load_model(settings), settings)   # engine.renderer, engine.state
"""
from __future__ import annotations

from typing import Any

from ..pipeline.render import ChatRenderer
from .chat import ChatEngine
from .state import EngineState


def make_engine(loaded: Any, settings: Any) -> ChatEngine:
    """ChatEngine for text models, VLMChatEngine (engine/vlm_chat.py) when ``loaded.is_vlm``."""
    if loaded.is_vlm:
        from .vlm_chat import VLMChatEngine, VLMChatRenderer

        renderer: ChatRenderer = VLMChatRenderer(loaded.tokenizer, preserve_thinking=settings.preserve_thinking)
        engine_cls: type[ChatEngine] = VLMChatEngine
    else:
        renderer = ChatRenderer(loaded.tokenizer, preserve_thinking=settings.preserve_thinking)
        engine_cls = ChatEngine
    state = EngineState(settings, loaded.model_id, renderer.template_source)
    return engine_cls(loaded, renderer, state, settings)
