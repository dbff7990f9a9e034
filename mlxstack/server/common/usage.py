"""Token usage of one reply, in each front's words (pure).

    usage = outcome_usage(outcome)          # the engine's counts, read in one place
    chat_usage(usage)                       # chat.completion: prompt / completion / total, cached_tokens
    responses_usage(usage, reasoning_tokens=n)   # Responses: input / output / total, cached, reasoning
    messages_usage(usage)                   # Anthropic: input (prefilled now) + cache_read, output

Token counts are model tokens; ``cached_tokens`` are prompt tokens reused from the KV cache,
``written_tokens`` the prompt tokens this request handed to the cache (its turn's entry holds the
whole prompt, so what was not reused is written; 0 with the cache off or for an aborted reply; a
store that fails afterwards is counted as ``store_failures``), ``segments`` those tokens split at
the client's breakpoints with the lifetime applied to each (cache/lifetimes.py): the long-lived
buckets (Anthropic 1h, Responses 12h) count the tokens kept at least that long.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...cache.lifetimes import Segment, long_tokens, marked_tokens


@dataclass(frozen=True)
class Usage:
    """What every front reports from an outcome (token counts are model tokens). ``marked``: the
    client set cache breakpoints (Anthropic counts cache_creation up to the last one)."""
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    written_tokens: int = 0
    segments: tuple[Segment, ...] = ()
    marked: bool = False

    def written_long(self, at_least: float) -> int:
        """Written tokens kept at least ``at_least`` seconds."""
        return min(self.written_tokens, long_tokens(self.segments, at_least))


ANTHROPIC_LONG = 3600.0     # ephemeral_1h_input_tokens
OPENAI_LONG = 12 * 3600.0   # ttl_12h_tokens


def report_usage(report: Any, completion_tokens: int = 0) -> Usage:
    """The input side of a cache report (cache/diagnosis CacheReport) as a Usage."""
    if report is None:
        return Usage(0, 0, completion_tokens)
    return Usage(report.prompt, report.cached, completion_tokens, report.written,
                 tuple(getattr(report, "segments", ())), bool(getattr(report, "breakpoints", ())))


def outcome_usage(outcome: Any) -> Usage:
    report = getattr(outcome, "cache", None)
    if report is None:
        return Usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens)
    return Usage(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens, report.written,
                 tuple(getattr(report, "segments", ())), bool(getattr(report, "breakpoints", ())))


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
               "cache_write_tokens_details": {"ttl_30m_tokens": usage.written_tokens - usage.written_long(OPENAI_LONG),
                                              "ttl_12h_tokens": usage.written_long(OPENAI_LONG)}}
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": details,
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def messages_usage(usage: Usage) -> dict:
    """``usage`` of an Anthropic message, whose three input counts add up to the prompt:
    ``cache_read_input_tokens`` = tokens reused from the KV cache; with ``cache_control``
    breakpoints (Anthropic's rule) ``cache_creation_input_tokens`` = the tokens up to the last
    breakpoint that were not read, ``input_tokens`` = the tokens after it; without breakpoints
    every stored token is creation (the server caches every turn: ``input_tokens`` 0 with the
    cache on). ``cache_creation`` splits creation by the lifetime applied (>= 1h, else 5m)."""
    if usage.marked:
        created = min(usage.written_tokens, marked_tokens(usage.segments))
        long = min(created, long_tokens([s for s in usage.segments if s.marked], ANTHROPIC_LONG))
    else:
        created, long = usage.written_tokens, usage.written_long(ANTHROPIC_LONG)
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens - created,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": created,
            "cache_creation": {"ephemeral_5m_input_tokens": created - long,
                               "ephemeral_1h_input_tokens": long}}


__all__ = ["ANTHROPIC_LONG", "OPENAI_LONG", "Usage", "chat_usage", "messages_usage", "outcome_usage", "report_usage",
           "responses_usage"]
