"""Message-level canonicalisation: split a request's messages into the model's input and the
cache key's input (pure: no MLX, no I/O).

Usage:
    original, canonical = canonicalize_messages(messages,
                                                enabled=settings.CACHE_CANONICALIZE_TOOL_CONTEXT,
                                                strip_billing_header=settings.STRIP_BILLING_HEADER)
    model_text = render(original)       # -> model_tokens (what the model computes on)
    key_text = render(canonical)        # -> scrub_cache_key(...) -> prompt_tokens (the cache key)

Both lists are deep copies; the caller's list is never mutated.

``original`` is the caller's messages untouched, with one deliberate exception
(STRIP_BILLING_HEADER, default on): Claude Code's per-request telemetry line
``x-anthropic-billing-header: cc_version=…; cc_entrypoint=…; cch=<hex>;`` at the top of a
system/developer text is removed — exactly that line and its newline. It carries no meaning for
the model and differs on every request at token ~10, so keeping it makes every request cold.
A text part that consisted of only that line is dropped from its content list (as if the client
had set CLAUDE_CODE_ATTRIBUTION_HEADER=0). The same applies to ``canonical``.

``canonical`` (when ``enabled``) additionally normalises volatile agent metadata at message-struct
level, before any template renders it:

* ``message_id`` keys on a message dict (and in its ``metadata`` dict) -> ``__STABLE_MSG_ID__``.
* OpenClaw untrusted-metadata JSON blocks in message text — a line such as
  ``Conversation info (untrusted metadata):`` or ``Sender (untrusted metadata):`` followed by a
  fenced ```json block (or a bare ``{ … }`` block): the values of ``message_id``,
  ``message_id_full`` -> ``__STABLE_MSG_ID__``; ``reply_to_id``, ``reply_to_id_full`` ->
  ``__STABLE_REPLY_TO_ID__``; ``timestamp``, ``timestamp_ms`` -> ``__STABLE_TIMESTAMP__``.
  Other fields (sender_id, sender, chat_id, …) stay: they identify who speaks.
* Inline ``[message_id: …]`` tags -> ``[message_id: __STABLE_MSG_ID__]`` (older OpenClaw shape).
* Older envelope headers at the start of a user line, ``[Telegram Ann id:42 +2m Sat 2026-03-28
  16:12 PDT] …``: the elapsed marker and weekday-date-time -> ``__STABLE_TIMESTAMP__``.
* OpenClaw ``## Inbound Context (trusted metadata)`` section (heading, prose and JSON block, up to
  the next markdown heading or ``<!-- OPENCLAW_CACHE_BOUNDARY -->``) is **removed**.
  NOTE: removal, not a ``__STABLE_INBOUND_CONTEXT_SECTION__`` sentinel. The requirement is that
  the canonical output be identical whether OpenClaw includes the block or omits it. Removal
  gives that for every input by construction. A sentinel would also have to be inserted when the
  block is absent, which needs a guess at "is this an OpenClaw prompt, and where would the block
  have been" — a heuristic that could inject text into other clients' prompts and that breaks
  when OpenClaw reorders sections. Both designs give the same equivalence classes where the guess
  is right, so removal is strictly safer. The cost is a canonical key a few hundred
  characters shorter than the model input; reuse depth is still decided in model-token space.
* In a system/developer text, the per-turn part after ``<!-- OPENCLAW_CACHE_BOUNDARY -->``:
  lines ``Current date: …`` / ``Current time: …`` / ``Current date and time: …`` ->
  ``Current date: __STABLE_DATETIME__`` (label kept), and a first non-blank line that itself is
  a date/time -> ``__STABLE_DATETIME__``. Nothing before the boundary is touched.
* Sub-agent report lines ``Stats: runtime 45s • tokens 12.3k (in 10k / out 2.3k) • …`` (and the
  older ``Stats: runtime 1m 3s | tokens …`` / ``• sessionKey …`` shapes) -> ``__STABLE_RUNTIME__``
  (the whole line).

All text rules are line-scoped except two bounded multi-line ones: a metadata header plus its
JSON block (ends at the first closing fence / closing-brace line; unterminated -> untouched) and
the fence-aware inbound-context section (ends at the next heading or the cache boundary). They
apply to string content and to ``{"type": "text"}`` / ``{"type": "input_text"}`` parts of list
content; other parts (images, tool calls) are copied as they are. Canonicalisation can only ever merge keys;
acceptance of a hit is verified on model tokens, so over-normalising costs a rejected
candidate (counted), never a wrong reuse.

With ``enabled=False`` the canonical list is a plain deep copy of the original.
"""
from __future__ import annotations

import copy
import functools
import re
from typing import Any, Callable, Sequence

STABLE_MSG_ID = "__STABLE_MSG_ID__"
STABLE_REPLY_TO_ID = "__STABLE_REPLY_TO_ID__"
STABLE_TIMESTAMP = "__STABLE_TIMESTAMP__"
STABLE_DATETIME = "__STABLE_DATETIME__"
STABLE_RUNTIME = "__STABLE_RUNTIME__"

OPENCLAW_CACHE_BOUNDARY = "<!-- OPENCLAW_CACHE_BOUNDARY -->"

_SYSTEM_ROLES = frozenset({"system", "developer"})
_TEXT_PART_TYPES = frozenset({"text", "input_text"})

# --- billing header ----------------------------------------------------------------------------
_BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)")

# --- untrusted metadata blocks -------------------------------------------------------------------
# A header line such as "Conversation info (untrusted metadata):" directly followed by a fenced
# block (closed by the first fence line) or by a bare JSON object (one line, or up to the first
# line that is just "}"). An unterminated block does not match and is left alone.
_META_BLOCK = re.compile(
    r"^[^\n]{1,120}\((?:un)?trusted\b[^)\n]*\):[ \t]*\n"
    r"(?:[ \t]*```[^\n]*\n(?:(?![ \t]*```)[^\n]*\n)*[ \t]*```"
    r"|[ \t]*\{[^\n]*\}[ \t]*(?=\n|\Z)"
    r"|[ \t]*\{[^\n]*\n(?:(?![ \t]*\}[ \t]*(?:\n|\Z))[^\n]*\n)*[ \t]*\}[ \t]*(?=\n|\Z))",
    re.MULTILINE,
)
_FENCE = re.compile(r"^[ \t]*```")
_VOLATILE_KEYS = {
    "message_id": STABLE_MSG_ID,
    "message_id_full": STABLE_MSG_ID,
    "reply_to_id": STABLE_REPLY_TO_ID,
    "reply_to_id_full": STABLE_REPLY_TO_ID,
    "timestamp": STABLE_TIMESTAMP,
    "timestamp_ms": STABLE_TIMESTAMP,
}
_VOLATILE_JSON_FIELD = re.compile(
    r'"(?P<key>' + "|".join(map(re.escape, _VOLATILE_KEYS)) + r')"(?P<sep>[ \t]*:[ \t]*)'
    r'(?:"(?:[^"\\\n]|\\.)*"|-?\d+(?:\.\d+)?)'
)
_MESSAGE_ID_TAG = re.compile(r"\[message_id:[ \t]*[^\]\n]+\]")

_WEEKDAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_ENVELOPE_TS = re.compile(
    r"^(?P<pre>\[[^\]\n]*?)"
    r"(?P<ts>(?:\+\d+[smhdw][ \t]+)?" + _WEEKDAY + r"[ \t]+\d{4}-\d{2}-\d{2}[ \t]+\d{1,2}:\d{2}(?::\d{2})?"
    r"(?:[ \t]+[A-Za-z]{1,5}(?:[+-]\d{1,2}(?::?\d{2})?)?)?)"
    r"(?P<post>\])",
    re.MULTILINE,
)

# --- inbound context -----------------------------------------------------------------------------
_INBOUND_HEADING = re.compile(r"^#{1,6}[ \t]+Inbound Context\b[^\n]*$", re.IGNORECASE)
_HEADING = re.compile(r"^#{1,6}[ \t]")

# --- sub-agent stats -----------------------------------------------------------------------------
_STATS_LINE = re.compile(r"^(?P<indent>[ \t]*)Stats:[ \t]*runtime\b[^\n]*$", re.MULTILINE)

# --- per-turn date after the cache boundary ------------------------------------------------------
_DATE_LABEL_LINE = re.compile(
    r"^(?P<label>[ \t]*Current (?:date and time|date|time))[ \t]*:[^\n]*$", re.MULTILINE | re.IGNORECASE
)
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
_DATE_LIKE = re.compile(
    r"\d{4}-\d{2}-\d{2}"
    r"|\b(?:Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\b"
    r"|\b" + _MONTH + r"[ \t]+\d{1,2}(?:st|nd|rd|th)?,?[ \t]+\d{4}"
    r"|\b\d{1,2}[ \t]+" + _MONTH + r"[ \t]+\d{4}",
    re.IGNORECASE,
)


# =================================================================================================
# public API
# =================================================================================================

def copy_json(obj: Any) -> Any:
    """Deep copy of JSON-shaped data (dicts, lists, scalars): ~5x faster than copy.deepcopy,
    which matters when agents send 100+ messages per request. Other objects fall back to it."""
    if isinstance(obj, dict):
        return {k: copy_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_json(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return copy.deepcopy(obj)


def canonicalize_messages(
    messages: Sequence[dict[str, Any]],
    *,
    enabled: bool = True,
    strip_billing_header: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deep-copy ``messages`` into (original, canonical); see the module docstring.

    Args:
        messages: OpenAI-style chat messages (``role``, ``content`` str or list of parts, …).
        enabled: apply canonical normalisations (CACHE_CANONICALIZE_TOOL_CONTEXT).
        strip_billing_header: drop Claude Code's billing telemetry line from both lists
            (STRIP_BILLING_HEADER).

    Returns:
        (original, canonical): two independent deep copies.
    """
    original = copy_json(list(messages))
    if strip_billing_header:
        for message in original:
            if isinstance(message, dict) and _role(message) in _SYSTEM_ROLES:
                _strip_billing_line(message)
    canonical = copy_json(original)
    if enabled:
        for message in canonical:
            if isinstance(message, dict):
                _canonicalize_message(message)
    return original, canonical


_canonicalize_messages = canonicalize_messages


def strip_billing_header_line(text: str) -> str:
    """Remove a leading ``x-anthropic-billing-header: …`` line (and its newline) from ``text``."""
    return _BILLING_LINE.sub("", text, count=1)


def canonicalize_text(text: str, role: str | None) -> str:
    """All text-level canonical rules for one piece of message text of the given role."""
    if len(text) <= _MEMO_MAX_CHARS:
        return _canonicalize_text_memo(text, role)
    return _canonicalize_text(text, role)


# Agent clients resend the whole history every turn, so the same (text, role) pairs recur on
# every request; the rules are pure, so a bounded memo of short texts (where per-call overhead
# dominates) is safe. Worst-case memory: _MEMO_SIZE * _MEMO_MAX_CHARS * 2 characters.
_MEMO_MAX_CHARS = 8192
_MEMO_SIZE = 2048


def _canonicalize_text(text: str, role: str | None) -> str:
    text = remove_inbound_context(text)
    text = normalize_untrusted_metadata(text)
    if "[message_id:" in text:
        text = _MESSAGE_ID_TAG.sub(f"[message_id: {STABLE_MSG_ID}]", text)
    if role == "user" and "[" in text:
        text = _ENVELOPE_TS.sub(lambda m: m["pre"] + STABLE_TIMESTAMP + m["post"], text)
    if "Stats:" in text:
        text = _STATS_LINE.sub(lambda m: m["indent"] + STABLE_RUNTIME, text)
    if role in _SYSTEM_ROLES:
        text = normalize_boundary_datetime(text)
    return text


_canonicalize_text_memo = functools.lru_cache(maxsize=_MEMO_SIZE)(_canonicalize_text)


def remove_inbound_context(text: str) -> str:
    """Remove every ``## Inbound Context (…)`` section (heading up to the next heading or the
    OpenClaw cache boundary, exclusive). Fenced code blocks inside the section are respected."""
    if "nbound" not in text:
        return text
    lines = _split_lines(text)
    out: list[str] = []
    i = 0
    while i < len(lines):
        if _INBOUND_HEADING.match(lines[i].rstrip("\r\n")):
            end = _inbound_section_end(lines, i)
            if end == len(lines) and out and not lines[end - 1].endswith("\n"):
                # Section was the tail of the text: also drop the newline that introduced it,
                # so the result equals the text without the section.
                out[-1] = out[-1][:-1] if out[-1].endswith("\n") else out[-1]
            i = end
            continue
        out.append(lines[i])
        i += 1
    return "".join(out)


def normalize_untrusted_metadata(text: str) -> str:
    """Normalise volatile ids/timestamps inside OpenClaw ``… (untrusted metadata):`` JSON blocks."""
    if "trusted" not in text:
        return text
    return _META_BLOCK.sub(lambda m: _VOLATILE_JSON_FIELD.sub(_volatile_replacement, m.group(0)), text)


def normalize_boundary_datetime(text: str) -> str:
    """In the per-turn part after ``<!-- OPENCLAW_CACHE_BOUNDARY -->``, replace the date/time
    line(s) with ``__STABLE_DATETIME__``. Text before the boundary is untouched."""
    pos = text.find(OPENCLAW_CACHE_BOUNDARY)
    if pos < 0:
        return text
    cut = pos + len(OPENCLAW_CACHE_BOUNDARY)
    head, tail = text[:cut], text[cut:]
    tail = _DATE_LABEL_LINE.sub(lambda m: f"{m['label']}: {STABLE_DATETIME}", tail)
    # A dynamic part that starts with a bare date/time line ("Tuesday, March 17th, 2026 — 10:06 PM").
    lines = _split_lines(tail)
    for k, line in enumerate(lines):
        stripped = line.strip()
        if not stripped:
            continue
        if STABLE_DATETIME not in stripped and not _HEADING.match(stripped) and _DATE_LIKE.search(stripped):
            ending = line[len(line.rstrip("\r\n")):]
            indent = line[: len(line) - len(line.lstrip(" \t"))]
            lines[k] = indent + STABLE_DATETIME + ending
        break
    return head + "".join(lines)


# =================================================================================================
# helpers
# =================================================================================================

def _split_lines(text: str) -> list[str]:
    """Lines with their "\n" kept; only "\n" separates lines (unlike str.splitlines)."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _volatile_replacement(match: re.Match[str]) -> str:
    key = match["key"]
    return f'"{key}"{match["sep"]}"{_VOLATILE_KEYS[key]}"'


def _inbound_section_end(lines: list[str], heading: int) -> int:
    """Index of the first line after the inbound-context section that starts at ``heading``."""
    def is_end(line: str) -> bool:
        bare = line.rstrip("\r\n")
        return bool(_HEADING.match(bare)) or OPENCLAW_CACHE_BOUNDARY in bare

    in_fence = False
    for k in range(heading + 1, len(lines)):
        if _FENCE.match(lines[k]):
            in_fence = not in_fence
            continue
        if not in_fence and is_end(lines[k]):
            return k
    if not in_fence:
        return len(lines)
    # Unterminated fence: do not swallow the rest of the prompt; stop at the first heading.
    for k in range(heading + 1, len(lines)):
        if is_end(lines[k]):
            return k
    return len(lines)


def _role(message: dict[str, Any]) -> str | None:
    role = message.get("role")
    return role if isinstance(role, str) else None


def _map_text(message: dict[str, Any], fn: Callable[[str], str]) -> None:
    """Apply ``fn`` to the message's string content or to each text part of list content."""
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = fn(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
                part["text"] = fn(part["text"])


def _strip_billing_line(message: dict[str, Any]) -> None:
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = strip_billing_header_line(content)
    elif isinstance(content, list):
        kept = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PART_TYPES and isinstance(part.get("text"), str):
                stripped = strip_billing_header_line(part["text"])
                if stripped != part["text"] and not stripped:
                    continue  # the part held only the telemetry line
                part["text"] = stripped
            kept.append(part)
        message["content"] = kept


def _canonicalize_message(message: dict[str, Any]) -> None:
    if "message_id" in message:
        message["message_id"] = STABLE_MSG_ID
    metadata = message.get("metadata")
    if isinstance(metadata, dict) and "message_id" in metadata:
        metadata["message_id"] = STABLE_MSG_ID
    role = _role(message)
    _map_text(message, lambda text: canonicalize_text(text, role))


__all__ = [
    "canonicalize_messages",
    "_canonicalize_messages",
    "canonicalize_text",
    "remove_inbound_context",
    "normalize_untrusted_metadata",
    "normalize_boundary_datetime",
    "strip_billing_header_line",
    "STABLE_MSG_ID",
    "STABLE_REPLY_TO_ID",
    "STABLE_TIMESTAMP",
    "STABLE_DATETIME",
    "STABLE_RUNTIME",
    "OPENCLAW_CACHE_BOUNDARY",
]
