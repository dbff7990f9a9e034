"""The canonical messages' rendering, derived from the original's without a second render (pure).

    key_text = canonical_text(model_text, original, canonical)   # None: render canonical instead

The canonicaliser (prompt/canonicalize.py) changes only message *text*: volatile ids and
timestamps inside a string content or a text part, a removed inbound-context section. A chat
template writes message text verbatim (or trimmed) between markup that depends on roles, tools
and flags -- never on the text itself. So the canonical rendering is the original rendering with
each changed text replaced where the template wrote it: found in order, each search starting
where the previous message's text ended, so an equal text earlier in the prompt is never taken
for a later one's.

Returns ``model_text`` itself when no text changed (a ``message_id`` key the template does not
render changes nothing), and None when a changed text cannot be found verbatim or trimmed (a
template that escapes or rewrites content): the caller renders the canonical messages then.

Correctness never depends on this text: it is the cache *key*, and reuse is accepted only up to
where an entry's model tokens equal the request's (LESSONS 1). A substitution in the wrong place
could only make a key that matches nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

_TEXT_PARTS = ("text", "input_text", "output_text")


def message_texts(message: Any) -> list[str]:
    """The texts of a message the way a template meets them: the string content, or each text
    part of list content, in order (other parts carry no text)."""
    if not isinstance(message, dict):
        return []
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    out = []
    for part in content:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
            out.append(str(part.get("text", "")))
    return out


def canonical_text(model_text: str, original: Sequence[Any], canonical: Sequence[Any]) -> str | None:
    if len(original) != len(canonical):
        return None
    out: list[str] = []
    cursor = 0
    changed = False
    for orig, canon in zip(original, canonical):
        before, after = message_texts(orig), message_texts(canon)
        if len(before) != len(after):
            return None
        for old, new in zip(before, after):
            if old == new:
                at = model_text.find(old, cursor) if old else -1
                if at >= 0:            # an unchanged text moves the cursor past itself
                    out.append(model_text[cursor:at + len(old)])
                    cursor = at + len(old)
                continue
            found = _locate(model_text, old, new, cursor)
            if found is None:
                return None
            at, written_old, written_new = found
            out.append(model_text[cursor:at])
            out.append(written_new)
            cursor = at + len(written_old)
            changed = True
    if not changed:
        return model_text
    out.append(model_text[cursor:])
    return "".join(out)


def _locate(text: str, old: str, new: str, cursor: int) -> tuple[int, str, str] | None:
    """Where the template wrote ``old`` (verbatim, else trimmed as ``| trim`` would) -> (index,
    the text as written, its replacement written the same way)."""
    for written_old, written_new in ((old, new), (old.strip(), new.strip())):
        if written_old:
            at = text.find(written_old, cursor)
            if at >= 0:
                return at, written_old, written_new
    return None
