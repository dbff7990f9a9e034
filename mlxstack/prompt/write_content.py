"""Old file writes out of the model input (NORMALIZE_WRITE_TOOL_CONTENT_FOR_PROMPT; pure).

    messages, omitted, nbytes = omit_written_content(healed, client_messages)

An agent that writes files resends every write call, whole file included, on every later turn.
With the setting on, each assistant message *before the last one* has the whole-file content
argument of its write calls replaced by a placeholder that depends only on that content:

    [file content omitted: 18342 bytes, sha256 3f2a9c1e]

(UTF-8 bytes; the first 8 hex digits of the content's SHA-256), so the rendered history is the
same on every later turn and the prompt cache keeps hitting through it.

Which calls count: a tool named ``Write`` (Claude Code), ``write`` (PI, OpenClaw), ``write_file``,
``create_file`` or ``write_to_file`` (names compared case-insensitively), argument ``content``, a
string longer than its placeholder. Left alone: the last assistant message (the turn the model is
continuing, which the KV and the healing store hold as generated), tool results, every other
argument (``file_path`` / ``path`` stay), edit tools (``Edit`` / ``edit``: ``old_string`` /
``new_string`` are short and the model copies them), patch tools (Codex ``apply_patch``).

Healing: the messages arrive healed (prompt/healing.py), which may have replaced an assistant
message by the raw text it generated -- its tool calls inlined as markup, content included. Such
a message is taken as the client sent it (``client``: its structured tool calls), with the
content replaced; every other message stays as healed.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

WRITE_TOOLS: dict[str, str] = {"write": "content", "write_file": "content", "create_file": "content",
                               "write_to_file": "content"}   # lower-cased tool name -> whole-file argument
_STYLES = (((",", ":"), False), ((", ", ": "), False), ((",", ":"), True), ((", ", ": "), True))


def placeholder(content: str) -> str:
    """The stand-in for ``content``: its UTF-8 size and the first 8 hex digits of its SHA-256."""
    data = content.encode("utf-8", "surrogatepass")
    return f"[file content omitted: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:8]}]"


def _omit_in_arguments(name: Any, arguments: Any) -> tuple[Any, int]:
    """(arguments with the content replaced, bytes omitted); (arguments, 0) when nothing applies.
    JSON-string arguments are written back in the client's own separators / escaping."""
    field = WRITE_TOOLS.get(name.lower()) if isinstance(name, str) else None
    if field is None:
        return arguments, 0
    parsed = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments, 0
    if not isinstance(parsed, dict) or not isinstance(parsed.get(field), str):
        return arguments, 0
    content = parsed[field]
    stand_in = placeholder(content)
    size = len(content.encode("utf-8", "surrogatepass"))
    if size <= len(stand_in):
        return arguments, 0
    replaced = {**parsed, field: stand_in}
    if not isinstance(arguments, str):
        return replaced, size
    seps, ascii_only = next(((s, a) for s, a in _STYLES if json.dumps(parsed, separators=s, ensure_ascii=a) == arguments),
                            ((", ", ": "), False))
    return json.dumps(replaced, separators=seps, ensure_ascii=ascii_only), size


def _omit_in_message(message: Any) -> tuple[Any, int, int]:
    """(message with its write contents replaced, calls changed, bytes omitted)."""
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not isinstance(calls, list):
        return message, 0, 0
    out, changed, omitted = [], 0, 0
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            args, size = _omit_in_arguments(fn.get("name"), fn.get("arguments"))
            if size:
                call = {**call, "function": {**fn, "arguments": args}}
                changed, omitted = changed + 1, omitted + size
        out.append(call)
    return ({**message, "tool_calls": out}, changed, omitted) if changed else (message, 0, 0)


def omit_written_content(messages: Sequence[Any], client: Sequence[Any] | None = None) -> tuple[list, int, int]:
    """(messages with earlier write contents replaced, calls changed, bytes omitted).

    Args:
        messages: the request's messages after healing.
        client: the same messages as the client sent them (before healing), index for index; a
            healed message without tool calls is taken from here when its write calls apply.
    Returns:
        A new list (the input is never mutated; unchanged messages are the same objects), how many
        write calls had their content replaced, and the UTF-8 bytes those contents held.
    """
    out = list(messages)
    last = max((i for i, m in enumerate(out) if isinstance(m, dict) and m.get("role") == "assistant"), default=-1)
    if client is not None and len(client) != len(out):
        client = None
    changed = omitted = 0
    for i in range(last):
        m = out[i]
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        new, n, size = _omit_in_message(m)
        if not n and client is not None and not m.get("tool_calls") and client[i] is not m:
            new, n, size = _omit_in_message(client[i])     # healed into raw text: the client's calls
        if n:
            out[i], changed, omitted = new, changed + n, omitted + size
    return out, changed, omitted
