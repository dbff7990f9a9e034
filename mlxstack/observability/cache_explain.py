"""A request's cache explanation in words, from a request-log record or a /v1/cache/stats row.

    explanation(rec["cache"])          # "miss: message 3 content changed; 412 of 640 tokens not reused ..."
    for line in session_lines(records): print(line)      # scripts/explain_cache.py

The words come from the fields the server already wrote (cache/diagnosis.py ``as_dict``): the
comparison with the session's previous request -- hit, the first part that differs (model,
prompt_cache_key, system, tools, message N and its field, a setting, the reply), the tokens the
previous request left reusable that this one did not reuse, where the two prompts part. The
dashboard (dashboard.js ``explanation``) says the same words; tests hold both to them.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

# field names as cache/diagnosis.py writes them -> words
_PARTS = {"model": "model", "prompt_cache_key": "prompt_cache_key", "system": "system prompt", "tools": "tools"}


def divergence(d: dict | None) -> str:
    """The first part that differs, in words: ``system prompt``, ``message 3 content``,
    ``message 2 content (volatile field)``, ``setting tool_choice``, ``the previous reply`` ..."""
    if not d or not d.get("where"):
        return ""
    where, message, field = d["where"], d.get("message"), d.get("field") or ""
    if where == "reply":
        return f"the previous reply (message {message})"
    if where == "messages":
        field = field.replace("(volatile)", "(volatile field)")
        return f"message {message} {field}"
    if where.startswith("settings."):
        return "setting " + where[len("settings."):]
    return _PARTS.get(where, where)


def explanation(cache: dict | None) -> str:
    """One request's explanation from its record's ``cache`` part (or a stats row)."""
    cache = cache or {}
    if cache.get("cache_explain") == "off":
        return "cache off"
    d = cache.get("cache_diagnosis")
    if not d:
        return "first request of its session"
    status = d.get("status")
    if status == "hit":
        return f"hit: continues the previous request ({d.get('common', 0)} tokens in common)"
    if status == "unavailable":
        return (f"unavailable: the prompt continues the previous request ({d.get('common', 0)} tokens in common) "
                f"but its entry is gone (evicted or expired)")
    if status == "miss":
        return (f"miss: {divergence(d)} changed; {d.get('missed', 0)} of {d.get('previous', 0)} reusable tokens "
                f"not reused, the prompts part at token {d.get('common', 0)}")
    return str(status)


def request_line(rec: dict) -> str:
    """One request: time, API, prompt / reused / written tokens, tier, explanation."""
    cache = rec.get("cache") or {}
    ts = rec.get("ts")
    when = time.strftime("%H:%M:%S", time.localtime(float(ts))) if ts is not None else "?"
    return (f"{when}  {rec.get('api') or '?':9} {_n(cache.get('prompt_tokens')):>7} {_n(cache.get('cached_tokens')):>7} "
            f"{_n(cache.get('cache_written')):>7}  {cache.get('cache_tier') or '?':5} {explanation(cache)}")


HEADER = f"{'time':8}  {'api':9} {'prompt':>7} {'reused':>7} {'written':>7}  {'tier':5} explanation"


def session_lines(records: Iterable[dict]) -> list[str]:
    """A session's requests, oldest first, under a header naming the session and its day(s)."""
    recs = sorted(records, key=lambda r: r.get("ts") or 0)
    if not recs:
        return []
    days = sorted({time.strftime("%Y-%m-%d", time.localtime(float(r["ts"]))) for r in recs if r.get("ts") is not None})
    head = f"session {recs[0].get('session') or '?'} ({len(recs)} request{'s' if len(recs) != 1 else ''}, " \
           f"{', '.join(days)})"
    return [head, HEADER, *(request_line(r) for r in recs)]


def _n(value: Any) -> str:
    return "-" if value is None else str(value)


__all__ = ["HEADER", "divergence", "explanation", "request_line", "session_lines"]
