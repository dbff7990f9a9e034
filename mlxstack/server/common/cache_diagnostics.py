"""Cache diagnoses in each front's words, and the request fields that ask for them (pure).

    anthropic_diagnostics(d)   # Message.diagnostics: None, or {"cache_miss_reason": {...}}
    openai_diagnostics(d)      # Response.prompt_cache_diagnostics: {"type": "cache_hit" | "cache_miss" | ...}
    cache_header(report)       # x-mlxstack-cache: "tier=ram; reused=812/830; match=prefix; vs=session; hit"

A diagnosis (cache/diagnosis.py) names the first differing part; the SDKs' types name fewer:
Anthropic has model / system / tools / messages (a setting such as thinking or tool_choice that
differs while those match is ``unavailable``, as Anthropic documents it); OpenAI has model,
prompt_cache_key, tools, text format, reasoning effort, and ``input_changed`` for the rest.
"""
from __future__ import annotations

from typing import Any

from ...cache.diagnosis import HIT, MISS, NONE, NOT_FOUND, Diagnosis, describe
from ..http.errors import bad_request

DIAGNOSIS_BETA = "cache-diagnosis-2026-04-07"

_ANTHROPIC = {"model": "model_changed", "system": "system_changed", "tools": "tools_changed",
              "messages": "messages_changed", "reply": "messages_changed"}
_OPENAI = {"model": "model_changed", "prompt_cache_key": "prompt_cache_key_changed", "tools": "tools_changed",
           "settings.text_format": "text_format_changed", "settings.reasoning": "reasoning_effort_changed"}


def anthropic_diagnostics(d: Diagnosis | None) -> dict | None:
    """``diagnostics`` of an Anthropic message: null when nothing diverged (or nothing was asked)."""
    if d is None or d.status in (HIT, NONE):
        return None
    if d.status == NOT_FOUND:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    reason = _ANTHROPIC.get(d.where or "") if d.status == MISS else None
    if reason is None:
        return {"cache_miss_reason": {"type": "unavailable"}}
    return {"cache_miss_reason": {"type": reason, "cache_missed_input_tokens": d.missed}}


def openai_diagnostics(d: Diagnosis | None) -> dict | None:
    """``prompt_cache_diagnostics`` of a Responses response (None when not asked for)."""
    if d is None or d.status == NONE:
        return None
    if d.status == HIT:
        return {"type": "cache_hit"}
    if d.status == NOT_FOUND:
        return {"type": "comparison_response_not_found"}
    if d.status != MISS:
        return {"type": "unavailable"}
    return {"type": "cache_miss", "reason": _OPENAI.get(d.where or "", "input_changed"),
            "cache_missed_tokens": d.missed, "comparison_reusable_tokens": d.previous}


def anthropic_request(body: dict, headers: dict[str, str]) -> tuple[bool, str | None]:
    """(diagnosis wanted, previous message id) from ``diagnostics: {previous_message_id}``; the
    field alone asks for it (the beta header is accepted, not required)."""
    diag = body.get("diagnostics")
    if diag is None:
        return False, None
    if not isinstance(diag, dict):
        raise bad_request("'diagnostics' must be an object like {\"previous_message_id\": \"msg_...\"}",
                          param="diagnostics")
    prev = diag.get("previous_message_id")
    if prev is not None and not isinstance(prev, str):
        raise bad_request("'diagnostics.previous_message_id' must be a string or null",
                          param="diagnostics.previous_message_id")
    return True, prev


def cache_header(report: Any) -> str:
    """``x-mlxstack-cache``: the tier that served the prefix, tokens reused / prompt, the match, and
    the comparison with the session's previous request (no text, hashes or ids)."""
    if report is None:
        return "off"
    return (f"tier={report.tier}; reused={report.cached}/{report.prompt}; match={report.match}; "
            f"{describe(report.session)}")


__all__ = ["DIAGNOSIS_BETA", "anthropic_diagnostics", "anthropic_request", "cache_header", "openai_diagnostics"]
