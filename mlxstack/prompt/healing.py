"""Healing store: put back what clients strip from echoed assistant turns.

After each response the server remembers (content as the client saw it, canonical tool calls)
-> the assistant text exactly as generated (``<think>`` block, raw tool-call markup, spacing).
When a later request echoes that assistant turn stripped or re-serialised, ``heal`` swaps the
original back in, so the rendered prompt equals the tokens already in the KV cache and the turn
is a hit instead of a re-prefill. The key uses parsed tool-call arguments, so clients that
re-serialise JSON (LiteLLM's Anthropic translation writes ``{"path": "a"}``) still match.

The key also binds the reply to the exact history that preceded it (a running digest over the
messages as the client sent them; only Claude Code's per-request billing line is left out), so
a stripped reply that is empty or generic ("" when all output was reasoning, "OK") is only ever
healed in the conversation that produced it -- never in another one, not even one that differs
only in a block the cache key normalises away.

    store = HealingStore(max_entries=2000, view=lambda m: m)
    store.remember(history_digest([store.view(m) for m in messages]), content, tool_calls, healed_text)
    messages = store.heal(messages)
"""
from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, Callable, Sequence, Union

from ..parsing.tool_calls import canonical_arguments
from .sized_lru import SizedLRU


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", "output_text"))


def _call_parts(call: Any) -> tuple[str, str]:
    if hasattr(call, "name"):  # parsing.tool_calls.ToolCall
        return call.name, canonical_arguments(call.arguments)
    fn = call.get("function", call) if isinstance(call, dict) else {}
    return str(fn.get("name", "")), canonical_arguments(fn.get("arguments", "{}"))


EMPTY_DIGEST = hashlib.sha256(b"mlxstack-history").hexdigest()


def extend_digest(digest: str, message: Any) -> str:
    """Running digest of a message list (order-sensitive, chained)."""
    blob = json.dumps(message, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256((digest + "\x00" + blob).encode()).hexdigest()


def scope_digest(scope: str) -> str:
    """Where a scope's history digests start: a reply remembered in one cache scope is never
    healed into another's conversation, however alike."""
    return EMPTY_DIGEST if not scope else hashlib.sha256((EMPTY_DIGEST + "\x00scope\x00" + scope).encode()).hexdigest()


def history_digest(messages: Sequence[Any], scope: str = "") -> str:
    digest = scope_digest(scope)
    for m in messages:
        digest = extend_digest(digest, m)
    return digest


def healing_key(history: str, content: Any, tool_calls: Sequence[Any] | None) -> str:
    """SHA-256 over the preceding history digest, the visible content (whitespace-trimmed)
    and the canonical tool calls."""
    payload = [history, _content_text(content).strip(), [list(_call_parts(c)) for c in tool_calls or ()]]
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


Healed = Union[str, dict]   # raw generated text (put in content) or a field patch (harmony)


def _size(value: Healed) -> int:
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def apply_patch(message: dict, patch: dict) -> dict:
    """``message`` with a harmony healing patch applied (parsing/harmony.py ``healing_patch``):
    content and reasoning as generated, each tool call's arguments byte for byte (ids kept)."""
    out = {k: v for k, v in message.items() if k not in ("reasoning", "thinking")}
    out["content"] = patch.get("content", "")
    if "reasoning_content" in patch:
        out["reasoning_content"] = patch["reasoning_content"]
    else:
        out.pop("reasoning_content", None)
    args = patch.get("tool_arguments")
    calls = message.get("tool_calls")
    if args and isinstance(calls, list) and len(calls) == len(args):
        out["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": a}} for c, a in zip(calls, args)]
    return out


class HealingStore:
    """LRU of healed replies, bounded by entry count and by bytes."""

    def __init__(self, max_entries: int = 2000, view: Callable[[dict], Any] = lambda m: m,
                 max_bytes: int = 64 * 1024 * 1024,
                 on_remember: Callable[[str, Healed], None] | None = None) -> None:
        self.view = view  # one message -> the form the history digest covers (exact, billing line dropped)
        self._items: SizedLRU[str, Healed] = SizedLRU(max_entries, max_bytes)
        self._lock = threading.Lock()
        self.healed = 0
        self.on_remember = on_remember   # persistence seam (the engine journals entries to disk)

    @property
    def nbytes(self) -> int:
        return self._items.nbytes

    def remember(self, history: str, content: Any, tool_calls: Sequence[Any] | None, healed: Healed) -> None:
        key = healing_key(history, content, tool_calls)
        if self._put(key, healed) and self.on_remember is not None:
            self.on_remember(key, healed)

    def restore(self, items: Sequence[tuple[str, Healed]]) -> None:
        """Entries remembered before a restart (oldest first)."""
        for key, healed in items:
            if isinstance(healed, (str, dict)):
                self._put(key, healed)

    def _put(self, key: str, healed: Healed) -> bool:
        size = _size(healed) + len(key)
        with self._lock:
            return self._items.put(key, healed, size)

    def lookup(self, history: str, message: dict) -> Healed | None:
        key = healing_key(history, message.get("content"), message.get("tool_calls"))
        with self._lock:
            return self._items.get(key)

    def heal(self, messages: list[dict], scope: str = "") -> list[dict]:
        """A new list where every recognised assistant turn carries what was generated (in ``scope``)."""
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        if last < 0 or not self._items:  # nothing could be healed: skip the history digests
            return list(messages)
        out = []
        digest = scope_digest(scope)
        for i, m in enumerate(messages):
            if i > last:  # no assistant turn follows: later digests are never looked up
                out.extend(messages[i:])
                break
            if m.get("role") == "assistant":
                healed = self.lookup(digest, m)
                new = m
                if isinstance(healed, dict):
                    new = apply_patch(m, healed)
                elif healed is not None and healed != _content_text(m.get("content")):
                    new = {k: v for k, v in m.items() if k not in ("tool_calls", "reasoning_content", "reasoning")}
                    new["content"] = healed
                if new != m:
                    m = new
                    with self._lock:
                        self.healed += 1
            out.append(m)
            digest = extend_digest(digest, self.view(m))
        return out

    def items(self) -> list[tuple[str, Healed]]:
        """(history digest, healed reply) pairs, least recently used first."""
        with self._lock:
            return self._items.items()

    def forget(self, key: str) -> None:
        with self._lock:
            self._items.pop(key)

    def __len__(self) -> int:
        return len(self._items)
