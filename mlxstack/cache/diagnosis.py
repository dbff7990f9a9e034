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
(its prompt, then its reply), plus one digest of all of those tokens. The digests are 8-byte
integers in numpy arrays (a row per message, one per block), so what a fingerprint holds is a few
arrays and its ``nbytes`` is measured, not estimated: ``FingerprintStore`` charges that, once per
fingerprint however many keys name it, and holds at most its byte limit.

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
import sys
from collections import OrderedDict
from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

BLOCK = 16                    # tokens per chained digest
SETTINGS = ("text_format", "reasoning", "tool_choice")   # prompt-shaping settings, compared in this order
MESSAGE_FIELDS = ("role", "content", "images", "tool_calls", "reasoning", "tool_call_id", "name")
SYSTEM_ROLES = ("system", "developer")

# statuses
HIT, MISS, NOT_FOUND, UNAVAILABLE, NONE = "hit", "miss", "not_found", "unavailable", "none"


DIGEST = np.dtype("<u8")      # every part digest and block digest: 8 bytes
CANONICAL = len(MESSAGE_FIELDS)   # a message row's last column: its canonical text's digest


def _digest_bytes(value: Any) -> bytes:
    raw = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True, ensure_ascii=False,
                                                             default=str).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=8).digest()


def _digest(value: Any) -> int:
    return int.from_bytes(_digest_bytes(value), "little")


def _digests(values: Iterable[Any], width: int | None = None) -> np.ndarray:
    """The digests of ``values`` as one array that owns its 8 bytes each (rows of ``width``)."""
    flat = np.frombuffer(b"".join(_digest_bytes(v) for v in values), dtype=DIGEST)
    return (flat if width is None else flat.reshape(-1, width)).copy()


def _tokens(tokens: Any) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


def block_chain(tokens: Any) -> np.ndarray:
    """One chained 8-byte digest per full ``BLOCK`` of tokens (an array that owns its bytes)."""
    arr = _tokens(tokens)
    out = bytearray()
    prev = b""
    for i in range(len(arr) // BLOCK):
        prev = hashlib.blake2b(prev + arr[i * BLOCK:(i + 1) * BLOCK].tobytes(), digest_size=8).digest()
        out += prev
    return np.frombuffer(bytes(out), dtype=DIGEST).copy()


def _full(tokens: Any) -> bytes:
    return hashlib.blake2b(_tokens(tokens).tobytes(), digest_size=16).digest()


def _held(value: Any) -> int:
    """Bytes a fingerprint's field holds: the object, and an array's buffer where it does not own it."""
    n = sys.getsizeof(value)
    if isinstance(value, np.ndarray) and value.base is not None:
        n += value.nbytes
    return n


@dataclass(frozen=True, slots=True)
class Fingerprint:
    model: int                            # 8-byte digests of the parts the client controls
    prompt_cache_key: int
    system: int
    system_count: int                     # leading system / developer messages
    tools: int
    messages: np.ndarray                  # [messages, MESSAGE_FIELDS + 1] digests: each field, then canonical
    settings: np.ndarray                  # [SETTINGS] digests
    prompt_tokens: int
    tokens: int                           # tokens the digests cover (prompt, then reply)
    blocks: np.ndarray                    # [tokens // BLOCK] chained digests
    full: bytes

    @property
    def nbytes(self) -> int:
        """What the fingerprint holds in memory, measured: the object and each field (arrays with
        their buffers), the charge of the bounded store."""
        return sys.getsizeof(self) + sum(_held(getattr(self, f.name)) for f in fields(self))


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


def message_values(message: Any, canonical: Any) -> list[Any]:
    """What a message's row digests: each of MESSAGE_FIELDS, then the canonical message's text."""
    m = message if isinstance(message, dict) else {}
    texts, images = _parts(m.get("content"))
    calls = [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
             for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    values = {"role": m.get("role"), "content": texts, "images": images, "tool_calls": calls,
              "reasoning": m.get("reasoning_content") or m.get("reasoning"),
              "tool_call_id": m.get("tool_call_id"), "name": m.get("name")}
    canon_texts, _ = _parts((canonical if isinstance(canonical, dict) else {}).get("content"))
    return [values[f] for f in MESSAGE_FIELDS] + [canon_texts]


def message_print(message: Any, canonical: Any) -> np.ndarray:
    """A message's row: the digest of each of MESSAGE_FIELDS, then of its canonical text."""
    return _digests(message_values(message, canonical))


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
        messages=_digests((v for m, c in zip(messages, canonical) for v in message_values(m, c)), CANONICAL + 1),
        settings=_digests((settings or {}).get(name) for name in SETTINGS),
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
    differ = np.flatnonzero(mine != previous.blocks[:len(mine)])
    return int(differ[0] if len(differ) else len(mine)) * BLOCK


class FingerprintStore:
    """The bounded store of fingerprints (CACHE_DIAGNOSTICS_MAX_ENTRIES / _MAX_BYTES), least
    recently used first out. A fingerprint is held once under all the keys that name it (the
    session's previous request, the reply's id): one charge, its measured ``nbytes`` plus what
    its keys and its slot hold; the store's tables count as they are (``sys.getsizeof``: a
    dict keeps the room its deleted entries left), so it never holds more than its limit.
    Storing under a key forgets what that key named before; a fingerprint alone over the limit is
    not stored (its keys then name nothing: an older request is no comparison for the next one)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._slots: OrderedDict[int, tuple[Fingerprint, int, tuple[str, ...]]] = OrderedDict()
        self._keys: dict[str, int] = {}
        self._slot_of: dict[int, int] = {}     # id(fingerprint) -> its slot: one object, one slot
        self._next = 0

    @staticmethod
    def charge(fp: Fingerprint, keys: Sequence[str]) -> int:
        """What ``fp`` costs the store under ``keys``: the fingerprint, its slot (a 3-tuple, its size
        and id as ints), the keys' tuple and the keys (the tables are counted apart)."""
        ints = 2 * sys.getsizeof(1 << 62)
        return (fp.nbytes + sys.getsizeof((fp, 0, ())) + ints + sys.getsizeof(tuple(keys))
                + sum(sys.getsizeof(k) for k in keys))

    @property
    def held(self) -> int:
        """Bytes the store holds: its fingerprints' charges and its tables."""
        return self.nbytes + sum(sys.getsizeof(t) for t in (self._slots, self._keys, self._slot_of))

    def get(self, key: str) -> Fingerprint | None:
        slot = self._keys.get(key)
        if slot is None:
            return None
        self._slots.move_to_end(slot)
        return self._slots[slot][0]

    def put(self, keys: Sequence[str], fp: Fingerprint) -> bool:
        """Store ``fp`` under every one of ``keys`` (once) as the most recently used, then drop
        the least recently used until both bounds hold. False: alone over the byte limit."""
        keys = tuple(dict.fromkeys(keys))
        for key in keys:
            self._forget(key)
        held = self._slot_of.get(id(fp))
        if held is not None:                  # already held under other keys: one slot, more keys
            keys = self._slots[held][2] + keys
            self._drop(held)
        size = self.charge(fp, keys)
        if not keys or size + sys.getsizeof(OrderedDict()) + 2 * sys.getsizeof({}) > self.max_bytes:
            return False
        self._next += 1
        self._slots[self._next] = (fp, size, keys)
        self._slot_of[id(fp)] = self._next
        for key in keys:
            self._keys[key] = self._next
        self.nbytes += size
        while self._slots and (len(self._slots) > self.max_entries or self.held > self.max_bytes):
            self._drop(next(iter(self._slots)))
        return True

    def _forget(self, key: str) -> None:
        """``key`` names nothing any more; its fingerprint stays under its other keys, if any."""
        slot = self._keys.pop(key, None)
        if slot is None:
            return
        fp, size, keys = self._slots[slot]
        rest = tuple(k for k in keys if k != key)
        if not rest:
            self._drop(slot)
            return
        smaller = self.charge(fp, rest)
        self._slots[slot] = (fp, smaller, rest)
        self.nbytes -= size - smaller

    def _drop(self, slot: int) -> None:
        fp, size, keys = self._slots.pop(slot)
        for key in keys:
            self._keys.pop(key, None)
        self._slot_of.pop(id(fp), None)
        self.nbytes -= size

    def __len__(self) -> int:
        """Fingerprints held (each once, whatever its number of keys)."""
        return len(self._slots)


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
    content = MESSAGE_FIELDS.index("content")
    for i in range(start, len(previous.messages)):
        if i >= len(current.messages):
            return "messages", i, "removed"
        a, b = previous.messages[i], current.messages[i]
        for j, name in enumerate(MESSAGE_FIELDS):
            if a[j] != b[j]:
                if j == content and a[CANONICAL] == b[CANONICAL]:
                    return "messages", i, "content (volatile)"
                return "messages", i, name
    for name, a, b in zip(SETTINGS, previous.settings, current.settings):
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


__all__ = ["BLOCK", "Diagnosis", "Fingerprint", "FingerprintStore", "HIT", "MISS", "NONE", "NOT_FOUND", "SETTINGS",
           "UNAVAILABLE", "as_dict", "block_chain", "common_prefix", "describe", "diagnose", "divergence",
           "fingerprint", "message_print", "message_values", "with_tokens"]
