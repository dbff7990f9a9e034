"""The model's context window: what it was trained for, or what the user caps it to.

    limit = context_window(config, tokenizer_max_length, override=settings.max_kv_size)
"""
from __future__ import annotations

from typing import Any

DEFAULT_CONTEXT = 8192
# Tokenizers without a real limit report sentinels such as 1e30; anything above this is ignored.
_PLAUSIBLE_MAX = 10_000_000
_CONFIG_KEYS = ("max_position_embeddings", "max_seq_len", "max_sequence_length", "seq_length", "n_positions",
                "n_ctx", "model_max_length")


def _from_config(config: dict) -> int | None:
    for scope in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        if not isinstance(scope, dict):
            continue
        for key in _CONFIG_KEYS:
            value = scope.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= _PLAUSIBLE_MAX:
                return int(value)
    return None


def context_window(config: dict, tokenizer_max_length: Any = None, override: int = 0) -> int:
    """``override`` (MAX_KV_SIZE) when set; else the model config's limit; else the tokenizer's
    ``model_max_length``; else 8192.

    Args:
        config: the model's config.json.
        tokenizer_max_length: ``tokenizer.model_max_length`` (may be a huge sentinel).
        override: MAX_KV_SIZE; 0 = use the model's own.
    Returns:
        Tokens the prompt plus the reply may occupy.
    """
    if override and override > 0:
        return int(override)
    found = _from_config(config)
    if found is not None:
        return found
    if isinstance(tokenizer_max_length, (int, float)) and 0 < tokenizer_max_length <= _PLAUSIBLE_MAX:
        return int(tokenizer_max_length)
    return DEFAULT_CONTEXT
