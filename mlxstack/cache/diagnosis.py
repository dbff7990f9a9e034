"""Why a request reused what it reused: request fingerprints and their comparison (pure).

    fp = fingerprint(model="m", messages=original, canonical=canonical, tools=tools,
                     settings={"text_format": ..., "reasoning": ..., "tool_choice": ..., "prompt_cache_key": ...},
                     tokens=model_tokens)
    fp = with_tokens(fp, model_tokens + reply_ids)        # what the next turn can reuse
    d = diagnose(previous_fp, fp, model_tokens, cached=seq.start, cache_on=True)
    d.status, d.where, d.message, d.field, d.missed     # "miss", "messages", 3, "content", 412

A fingerprint holds hashes and counts only, never text: one digest per part the client controls
(model name, the leading system messages, tools, each message field by field, the settings that
shape the prompt) and a chained digest per ``BLOCK`` tokens of what the request left in the cache
(its prompt, then its reply), plus one digest of all of those tokens.

The comparison walks the parts in prompt order (model, prompt_cache_key, system, tools, each
earlier message, the settings) and names the first that differs; the token position is the
longest prefix of the previous request's tokens the current prompt starts with: exact when the
whole of it matches, else a multiple of ``BLOCK`` (the last block both start with).

What a diagnosis says about reuse (``missed``): the previous request's tokens the current one
could have reused (all of them, less the last prompt token that is always computed) minus what
was shared -- the longer of the common prefix and, with the cache on, the tokens the server
really reused (a request that diverged but still hit through the canonical pipeline, or another
entry, did not miss those tokens). No miss and a prefix the server did not reuse (an evicted or
expired entry) is ``unavailable``: the prompt did not change, the server could not serve it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

BLOCK = 16                    # tokens per chained digest
SETTINGS = ("text_format", "reasoning", "tool_choice")   # prompt-shaping settings, compared in this order
MESSAGE_FIELDS = ("role", "content", "images", "tool_calls", "reasoning", "tool_call_id", "name")
SYSTEM_ROLES = ("system", "developer")

# statuses
HIT, MISS, NOT_FOUND, UNAVAILABLE, NONE = "hit", "miss", "not_found", "unavailable", "none"


def _digest(value: Any) -> str:
    raw = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True, ensure_ascii=False,
                                                             default=str).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def _tokens(tokens: Any) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def block_chain(tokens: Any) -> tuple[bytes, ...]:
    """One chained 8-byte digest per full ``BLOCK`` of tokens."""
    arr = _tokens(tokens)
    out: list[bytes] = []
    prev = b""
    for i in range(len(arr) // BLOCK):
        prev = hashlib.blake2b(prev + arr[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=8).digest()
        out.append(prev)
    return tuple(out)


def _full(tokens: Any) -> bytes:
    return hashlib.blake2b(_tokens(tokens).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class MessagePrint:
    role: str
    fields: tuple[tuple[str, str], ...]   # (field, digest) for each of MESSAGE_FIELDS
    canonical: str                        # digest of the canonical message's text (volatile parts normalised)

    def field(self, name: str) -> str:
        return dict(self.fields)[name]


@dataclass(frozen=True)
class Fingerprint:
    model: str
    prompt_cache_key: str
    system: str
    system_count: int                     # leading system / developer messages
    tools: str
    messages: tuple[MessagePrint, ...]
    settings: tuple[tuple[str, str], ...]
    prompt_tokens: int
    tokens: int                           # tokens the digests cover (prompt, then reply)
    blocks: tuple[bytes, ...]
    full: bytes

    @property
    def nbytes(self) -> int:
        """About what the fingerprint holds in memory (for the bounded store)."""
        return 256 + 8 * len(self.blocks) + 200 * len(self.messages)


def _parts(content: Any) -> tuple[list[str], list[str]]:
    """(texts, image references) of a message's content."""
    if isinstance(content, str):
        return [content], []
    texts: list[str] = []
    images: list[str] = []
    for part in content if isinstance(content, list) else []:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            kind = part.get("type")
            if kind in ("image_url", "input_image", "image"):
                images.append(_digest(part.get("image_url", part.get("source", part))))
            elif "text" in part:
                texts.append(str(part.get("text")))
    return texts, images


def message_print(message: Any, canonical: Any) -> MessagePrint:
    m = message if isinstance(message, dict) else {}
    texts, images = _parts(m.get("content"))
    calls = [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
             for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    values = {"role": m.get("role"), "content": texts, "images": images, "tool_calls": calls,
              "reasoning": m.get("reasoning_content") or m.get("reasoning"),
              "tool_call_id": m.get("tool_call_id"), "name": m.get("name")}
    canon_texts, _ = _parts((canonical if isinstance(canonical, dict) else {}).get("content"))
    return MessagePrint(str(m.get("role")), tuple((f, _digest(values[f])) for f in MESSAGE_FIELDS),
                        _digest(canon_texts))


def fingerprint(*, model: str, messages: Sequence[Any], canonical: Sequence[Any] | None = None,
                tools: Any = None, settings: Mapping[str, Any] | None = None, prompt_cache_key: Any = None,
                tokens: Any = ()) -> Fingerprint:
    canonical = list(canonical) if canonical is not None and len(canonical) == len(messages) else list(messages)
    n_system = 0
    while n_system < len(messages) and isinstance(messages[n_system], dict) \
            and messages[n_system].get("role") in SYSTEM_ROLES:
        n_system += 1
    arr = _tokens(tokens)
    return Fingerprint(
        model=_digest(model), prompt_cache_key=_digest(prompt_cache_key),
        system=_digest([_parts(m.get("content"))[0] for m in messages[:n_system]]), system_count=n_system,
        tools=_digest(tools or []),
        messages=tuple(message_print(m, c) for m, c in zip(messages, canonical)),
        settings=tuple((name, _digest((settings or {}).get(name))) for name in SETTINGS),
        prompt_tokens=len(arr), tokens=len(arr), blocks=block_chain(arr), full=_full(arr))


def with_tokens(fp: Fingerprint, tokens: Any) -> Fingerprint:
    """The same request, its digests over ``tokens`` (the prompt and the reply the cache holds)."""
    arr = _tokens(tokens)
    return replace(fp, tokens=len(arr), blocks=block_chain(arr), full=_full(arr))


def common_prefix(previous: Fingerprint, tokens: Any) -> int:
    """Tokens of ``previous`` that ``tokens`` starts with: exact when all of them match, else a
    multiple of BLOCK."""
    arr = _tokens(tokens)
    if len(arr) >= previous.tokens and _full(arr[:previous.tokens]) == previous.full:
        return previous.tokens
    mine = block_chain(arr[: len(previous.blocks) * BLOCK])
    n = 0
    for a, b in zip(mine, previous.blocks):
        if a != b:
            break
        n += 1
    return n * BLOCK


@dataclass(frozen=True)
class Diagnosis:
    status: str                   # hit | miss | not_found | unavailable | none (nothing to compare with)
    where: str | None = None      # model | prompt_cache_key | system | tools | messages | settings.<name> | reply
    message: int | None = None    # the first differing message's index (chat messages, system included)
    field: str | None = None      # content | tool_calls | images | ... | content (volatile) | added | removed
    missed: int = 0               # tokens the previous request left reusable that this one did not reuse
    common: int = 0               # tokens both prompts start with
    previous: int = 0             # tokens the previous request left reusable


def divergence(previous: Fingerprint, current: Fingerprint) -> tuple[str | None, int | None, str | None]:
    """The first part that differs, in prompt order: (where, message index, field)."""
    if previous.model != current.model:
        return "model", None, None
    if previous.prompt_cache_key != current.prompt_cache_key:
        return "prompt_cache_key", None, None
    if previous.system != current.system:
        return "system", None, None
    if previous.tools != current.tools:
        return "tools", None, None
    start = min(previous.system_count, current.system_count)
    for i in range(start, len(previous.messages)):
        if i >= len(current.messages):
            return "messages", i, "removed"
        a, b = previous.messages[i], current.messages[i]
        for name in MESSAGE_FIELDS:
            if a.field(name) != b.field(name):
                if name == "content" and a.canonical == b.canonical:
                    return "messages", i, "content (volatile)"
                return "messages", i, name
    for (name, a), (_, b) in zip(previous.settings, current.settings):
        if a != b:
            return f"settings.{name}", None, None
    return None, None, None


def diagnose(previous: Fingerprint | None, current: Fingerprint, tokens: Any, *, cached: int,
             cache_on: bool) -> Diagnosis:
    """Compare this request (``current``, its prompt ``tokens``, ``cached`` tokens reused) with
    ``previous`` (None: no record of it -> not_found)."""
    if previous is None:
        return Diagnosis(NOT_FOUND)
    n = len(_tokens(tokens))
    reusable = max(0, min(previous.tokens, n - 1))
    common = min(common_prefix(previous, tokens), n)
    shared = max(common, cached) if cache_on else common
    missed = max(0, reusable - shared)
    if missed == 0:
        if cache_on and cached < min(common, reusable):
            return Diagnosis(UNAVAILABLE, common=common, previous=reusable)
        return Diagnosis(HIT, common=common, previous=reusable)
    where, message, field = divergence(previous, current)
    if where is None:   # every part the client sent matches: the previous reply came back otherwise
        where, message, field = "reply", len(previous.messages), "reply"
    return Diagnosis(MISS, where, message, field, missed, common, reusable)


def describe(d: Diagnosis | None) -> str:
    """One line for logs and headers (no text): ``hit``, ``miss messages[3].content missed=412 at=640`` ..."""
    if d is None or d.status == NONE:
        return "first"
    if d.status != MISS:
        return d.status
    place = d.where if d.message is None else f"{d.where}[{d.message}].{d.field}"
    return f"miss {place} missed={d.missed} at={d.common}"


def as_dict(d: Diagnosis | None) -> dict | None:
    if d is None:
        return None
    return {"status": d.status, "where": d.where, "message": d.message, "field": d.field, "missed": d.missed,
            "common": d.common, "previous": d.previous}


__all__ = ["BLOCK", "Diagnosis", "Fingerprint", "HIT", "MISS", "MessagePrint", "NONE", "NOT_FOUND", "SETTINGS",
           "UNAVAILABLE", "as_dict", "block_chain", "common_prefix", "describe", "diagnose", "divergence",
           "fingerprint", "message_print", "with_tokens"]
