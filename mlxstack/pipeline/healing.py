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
from collections import OrderedDict
from typing import Any, Callable, Sequence

from ..parsing.tool_calls import canonical_arguments


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


def history_digest(messages: Sequence[Any]) -> str:
    digest = EMPTY_DIGEST
    for m in messages:
        digest = extend_digest(digest, m)
    return digest


def healing_key(history: str, content: Any, tool_calls: Sequence[Any] | None) -> str:
    """SHA-256 over the preceding history digest, the visible content (whitespace-trimmed)
    and the canonical tool calls."""
    payload = [history, _content_text(content).strip(), [list(_call_parts(c)) for c in tool_calls or ()]]
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


class HealingStore:
    def __init__(self, max_entries: int = 2000, view: Callable[[dict], Any] = lambda m: m) -> None:
        self.max_entries = max_entries
        self.view = view  # one message -> the form the history digest covers (exact, billing line dropped)
        self._items: "OrderedDict[str, str]" = OrderedDict()
        self._lock = threading.Lock()
        self.healed = 0

    def remember(self, history: str, content: Any, tool_calls: Sequence[Any] | None, original_text: str) -> None:
        key = healing_key(history, content, tool_calls)
        with self._lock:
            self._items[key] = original_text
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def lookup(self, history: str, message: dict) -> str | None:
        key = healing_key(history, message.get("content"), message.get("tool_calls"))
        with self._lock:
            text = self._items.get(key)
            if text is not None:
                self._items.move_to_end(key)
            return text

    def heal(self, messages: list[dict]) -> list[dict]:
        """A new list where every recognised assistant turn carries the generated text verbatim."""
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        if last < 0 or not self._items:  # nothing could be healed: skip the history digests
            return list(messages)
        out = []
        digest = EMPTY_DIGEST
        for i, m in enumerate(messages):
            if i > last:  # no assistant turn follows: later digests are never looked up
                out.extend(messages[i:])
                break
            if m.get("role") == "assistant":
                original = self.lookup(digest, m)
                if original is not None and original != _content_text(m.get("content")):
                    m = {k: v for k, v in m.items() if k not in ("tool_calls", "reasoning_content", "reasoning")}
                    m["content"] = original
                    with self._lock:
                        self.healed += 1
            out.append(m)
            digest = extend_digest(digest, self.view(m))
        return out

    def __len__(self) -> int:
        return len(self._items)
