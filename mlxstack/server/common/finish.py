"""Why a reply ended, in each front's words (pure).

The engine ends a reply with ``finish_reason`` "stop" (end of turn or a stop sequence), "length"
(token budget or context window), "cancelled" (the watchdog or a client that left) or
GRAMMAR_DEAD_END (its grammar could not continue it). Each front names these its own way:

    chat_finish_reason(outcome, has_tool_calls)   # stop | tool_calls | length | content_filter
    responses_status(outcome)                      # ("completed", None) | ("incomplete", reason)
    messages_stop_reason(finish, has_tool_use, stop_sequence)   # end_turn | tool_use | max_tokens | ...
"""
from __future__ import annotations

from typing import Any

from ...engine.chat import GRAMMAR_DEAD_END

CUT = ("length", "cancelled")   # the reply was cut, not finished

# A reply whose grammar could not continue it (engine GRAMMAR_DEAD_END) ends in OpenAI's own word for
# "cut by the server, not finished": LiteLLM 1.106.2 refuses any finish_reason outside its list (a 500)
# and maps the rest to "stop"; the SDKs' .parse() raises ContentFilterFinishReasonError on it.
DEAD_END_FINISH = "content_filter"

# Responses ``incomplete_details.reason`` for each way a reply did not finish (outcome_incomplete)
INCOMPLETE_REASONS = {"length": "max_output_tokens", GRAMMAR_DEAD_END: "content_filter"}


def outcome_truncated(outcome: Any) -> bool:
    """True when the reply was cut (token budget, window, watchdog) rather than finished."""
    return outcome.finish_reason in CUT


def outcome_incomplete(outcome: Any) -> str | None:
    """Why a reply did not finish on its own, in a front's words: "length" (token budget, window,
    watchdog), GRAMMAR_DEAD_END (its grammar could not continue it), else None."""
    if outcome_truncated(outcome):
        return "length"
    return GRAMMAR_DEAD_END if outcome.finish_reason == GRAMMAR_DEAD_END else None


def chat_finish_reason(outcome: Any, has_tool_calls: bool) -> str:
    """``finish_reason`` of a chat completion."""
    if has_tool_calls and outcome.finish_reason == "stop":
        return "tool_calls"
    if outcome.finish_reason == GRAMMAR_DEAD_END:
        return DEAD_END_FINISH
    return "length" if outcome.finish_reason in CUT else outcome.finish_reason


def responses_status(outcome: Any) -> tuple[str, str | None]:
    """(status, incomplete_details.reason): "completed", or "incomplete" with "max_output_tokens"
    (the token budget cut the reply) or "content_filter" (its grammar could not continue it: the
    API's own word for a reply the server cut, as finish_reason on chat completions)."""
    why = outcome_incomplete(outcome)
    return ("incomplete", INCOMPLETE_REASONS[why]) if why else ("completed", None)


def messages_stop_reason(outcome_finish: str, has_tool_use: bool, stop_sequence: str | None) -> str:
    """Anthropic ``stop_reason``."""
    if outcome_finish in CUT:
        return "max_tokens"
    if outcome_finish == GRAMMAR_DEAD_END:     # the tool / output grammar could not continue the reply:
        return "refusal"                        # the API's word for a reply the server cut
    if has_tool_use:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop_sequence(text: str, raw_text: str, stops: list[str]) -> str | None:
    """Which stop sequence ended the reply: the raw generation continues the visible text with it."""
    if not stops or not raw_text.startswith(text):
        return None
    rest = raw_text[len(text):]
    hits = [s for s in stops if s and rest.startswith(s)]
    return max(hits, key=len) if hits else None


__all__ = ["DEAD_END_FINISH", "INCOMPLETE_REASONS", "chat_finish_reason", "matched_stop_sequence",
           "messages_stop_reason", "outcome_incomplete", "outcome_truncated", "responses_status"]
