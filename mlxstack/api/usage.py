"""Token usage of one reply, in each front's words (pure).

    usage = outcome_usage(outcome)          # the engine's counts, read in one place
    chat_usage(usage)                       # chat.completion: prompt / completion / total, cached_tokens
    responses_usage(usage, reasoning_tokens=n)   # Responses: input / output / total, cached, reasoning
    messages_usage(usage)                   # Anthropic: input (prefilled now) + cache_read, output

Token counts are model tokens; ``cached_tokens`` are prompt tokens reused from the KV cache,
``written_tokens`` the prompt tokens this request handed to the cache (its turn's entry holds the
whole prompt, so what was not reused is written; 0 with the cache off or for an aborted reply; a
store that fails afterwards is counted as ``store_failures``), ``written_long`` those of them kept
past the default lifetime (a 1h ``cache_control`` / 12h / 24h breakpoint).
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
    written_tokens: int = 0
    written_long: int = 0


def outcome_usage(outcome: Any) -> Usage:
    report = getattr(outcome, "cache", None)
    written = report.written if report is not None else 0
    long = min(written, getattr(report, "written_long", 0)) if report is not None else 0
    return Usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens, written, long)


def chat_usage(usage: Usage) -> dict:
    """``usage`` of a chat.completion (and of its last stream chunk)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.written_tokens},
    }


def responses_usage(usage: Usage, reasoning_tokens: int) -> dict:
    """``usage`` of a Responses response; ``reasoning_tokens`` (the reasoning text re-encoded) is
    capped at the output tokens."""
    details = {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.written_tokens,
               "cache_write_tokens_details": {"ttl_30m_tokens": usage.written_tokens - usage.written_long,
                                              "ttl_12h_tokens": usage.written_long}}
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": details,
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def messages_usage(usage: Usage) -> dict:
    """``usage`` of an Anthropic message, whose three input counts add up to the prompt:
    ``cache_read_input_tokens`` = tokens reused from the KV cache, ``cache_creation_input_tokens`` =
    tokens this request stored (``cache_creation`` splits them by lifetime: 1h breakpoints, else
    5m), ``input_tokens`` = the rest (prefilled and not stored: the cache off)."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens - usage.written_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": usage.written_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": usage.written_tokens - usage.written_long,
                               "ephemeral_1h_input_tokens": usage.written_long}}


__all__ = ["Usage", "chat_usage", "messages_usage", "outcome_usage", "responses_usage"]
