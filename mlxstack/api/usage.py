"""Token usage of one reply, in each front's words (pure).

    usage = outcome_usage(outcome)          # the engine's counts, read in one place
    chat_usage(usage)                       # chat.completion: prompt / completion / total, cached_tokens
    responses_usage(usage, reasoning_tokens=n)   # Responses: input / output / total, cached, reasoning
    messages_usage(usage)                   # Anthropic: input (prefilled now) + cache_read, output

Token counts are model tokens; ``cached_tokens`` are prompt tokens reused from the KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Usage:
    """What every front reports from an outcome (token counts are model tokens)."""
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def outcome_usage(outcome: Any) -> Usage:
    return Usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens)


def chat_usage(usage: Usage) -> dict:
    """``usage`` of a chat.completion (and of its last stream chunk)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def responses_usage(usage: Usage, reasoning_tokens: int) -> dict:
    """``usage`` of a Responses response; ``reasoning_tokens`` (the reasoning text re-encoded) is
    capped at the output tokens."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def messages_usage(usage: Usage) -> dict:
    """``usage`` of an Anthropic message: ``input_tokens`` = prompt tokens prefilled now,
    ``cache_read_input_tokens`` = tokens reused from the KV cache, ``cache_creation_input_tokens`` = 0
    (every prompt is cached automatically; nothing is billed as a write)."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


__all__ = ["Usage", "chat_usage", "messages_usage", "outcome_usage", "responses_usage"]
