"""The Responses API's ``previous_response_id``: stored conversations, bounded in memory.

A stored response (``store: true``, the API's default) keeps the conversation up to and including
its reply, as chat messages, so the next request can send only its new input:

    store = response_store(app)                   # one per app, made on first use
    store.put("resp_1", [*conversation, assistant_message(outcome.text, ...)])
    history = store.get("resp_1")                 # a copy; None when unknown or evicted
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

from ...parsing.output import split_reply
from ...prompt.sized_lru import SizedLRU

log = logging.getLogger("mlxstack.responses")

RESPONSE_STORE_MAX = 256          # conversations kept for previous_response_id (LRU; RESPONSE_STORE_MAX_ENTRIES)
RESPONSE_STORE_MAX_BYTES = 256 << 20   # and their bytes (RESPONSE_STORE_MAX_BYTES)


class ResponseStore:
    """Bounded, thread-safe LRU: response id -> the conversation up to and including its reply.
    Bounded by count and by bytes (each conversation's JSON size, measured once when stored):
    a chained turn stores the whole conversation again, images included, so a count alone could
    hold 256 copies of a 64 MB body. A conversation alone over the byte cap is not kept."""

    def __init__(self, max_entries: int = RESPONSE_STORE_MAX, max_bytes: int = RESPONSE_STORE_MAX_BYTES) -> None:
        self._data: SizedLRU[str, list[dict]] = SizedLRU(max_entries, max_bytes)
        self._lock = threading.Lock()

    @property
    def max_entries(self) -> int:
        return self._data.max_entries

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            conv = self._data.get(response_id)
            return None if conv is None else [dict(m) for m in conv]

    def put(self, response_id: str, conversation: list[dict]) -> bool:
        """Store ``conversation``; False when it alone is over the byte cap (not kept)."""
        size = conversation_bytes(conversation)
        with self._lock:
            kept = self._data.put(response_id, conversation, size)
        if not kept:
            log.warning("response %s not kept for previous_response_id: %d bytes > RESPONSE_STORE_MAX_BYTES",
                        response_id, size)
        return kept

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


def conversation_bytes(conversation: list[dict]) -> int:
    """Bytes a stored conversation holds, as its JSON (pure)."""
    return len(json.dumps(conversation, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))


def assistant_message(text: str, *, thinking_started: bool, tools: list | None, family: str,
                      response_id: str) -> dict:
    """The reply as the chat message a client would echo (reasoning_content, content, tool_calls)."""
    parsed = split_reply(text, thinking_started=thinking_started, tools=tools, family=family, id_salt=response_id)
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        msg["content"] = parsed.content or None
    return msg


def response_store(app: Any) -> ResponseStore:
    """The app's store, created on first use (dict.setdefault is atomic under the GIL)."""
    s = app.settings
    return app.__dict__.setdefault("responses_store", ResponseStore(s.response_store_max_entries,
                                                                    s.response_store_max_bytes))


__all__ = ["RESPONSE_STORE_MAX", "RESPONSE_STORE_MAX_BYTES", "ResponseStore", "assistant_message",
           "conversation_bytes", "response_store"]
