"""The Responses API's ``previous_response_id``: stored conversations, bounded in memory.

A stored response (``store: true``, the API's default) keeps the conversation up to and including
its reply, as chat messages, so the next request can send only its new input; and the response
object and this request's input items, for GET /v1/responses/{id} and its input_items:

    store = response_store(app)                   # one per app, made on first use
    store.put("resp_1", [*conversation, assistant_message(outcome.text, ...)], response, items)
    history = store.get("resp_1")                 # a copy; None when unknown or evicted
    store.response("resp_1"); store.input_items("resp_1"); store.delete("resp_1")
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
    """Bounded, thread-safe LRU: response id -> the conversation up to and including its reply
    (and the response object and its input items, when given). Bounded by count and by bytes
    (each entry's JSON size, measured once when stored): a chained turn stores the whole
    conversation again, images included, so a count alone could hold 256 copies of a 64 MB body.
    An entry alone over the byte cap is not kept."""

    def __init__(self, max_entries: int = RESPONSE_STORE_MAX, max_bytes: int = RESPONSE_STORE_MAX_BYTES) -> None:
        self._data: SizedLRU[str, tuple[list[dict], str | None, str | None]] = SizedLRU(max_entries, max_bytes)
        self._lock = threading.Lock()

    @property
    def max_entries(self) -> int:
        return self._data.max_entries

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    def get(self, response_id: str) -> list[dict] | None:
        """The conversation (a copy), or None."""
        with self._lock:
            entry = self._data.get(response_id)
            return None if entry is None else [dict(m) for m in entry[0]]

    def response(self, response_id: str) -> dict | None:
        """The response object as it was answered (a copy), or None."""
        with self._lock:
            entry = self._data.get(response_id)
        return None if entry is None or entry[1] is None else json.loads(entry[1])

    def input_items(self, response_id: str) -> list[dict] | None:
        """The request's input items, each with its id (a copy), or None."""
        with self._lock:
            entry = self._data.get(response_id)
        return None if entry is None or entry[2] is None else json.loads(entry[2])

    def put(self, response_id: str, conversation: list[dict], response: dict | None = None,
            input_items: list[dict] | None = None) -> bool:
        """Store ``conversation`` (and the response object, its input items, kept as their JSON);
        False when the entry alone is over the byte cap (not kept)."""
        texts = [None if v is None else json.dumps(v, ensure_ascii=False) for v in (response, input_items)]
        size = conversation_bytes(conversation) + sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if t)
        with self._lock:
            kept = self._data.put(response_id, (conversation, *texts), size)
        if not kept:
            log.warning("response %s not kept for previous_response_id: %d bytes > RESPONSE_STORE_MAX_BYTES",
                        response_id, size)
        return kept

    def delete(self, response_id: str) -> bool:
        """Forget a response; False when it was not stored (or already evicted)."""
        with self._lock:
            return self._data.pop(response_id) is not None

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


INPUT_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(items: Any, response_id: str) -> list[dict]:
    """A request's ``input`` (already checked by responses_to_chat.py) as the input items
    GET /v1/responses/{id}/input_items lists (pure): a string is one user message; every item has
    a ``type`` and an ``id`` (the client's own, else one made from the response id); a message's
    string content becomes its one text part (input_text, output_text for the assistant)."""
    stem = response_id.split("_", 1)[-1][:24]
    out = []
    for k, item in enumerate([{"role": "user", "content": items}] if isinstance(items, str) else items):
        item = json.loads(json.dumps(item))
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = f"{INPUT_ITEM_PREFIXES.get(kind, 'item')}_{stem}in{k:03d}"
        out.append({"id": item.pop("id"), **item})
    return out


def response_store(app: Any) -> ResponseStore:
    """The app's store, created on first use (dict.setdefault is atomic under the GIL)."""
    s = app.settings
    return app.__dict__.setdefault("responses_store", ResponseStore(s.response_store_max_entries,
                                                                    s.response_store_max_bytes))


__all__ = ["INPUT_ITEM_PREFIXES", "RESPONSE_STORE_MAX", "RESPONSE_STORE_MAX_BYTES", "ResponseStore",
           "assistant_message", "conversation_bytes", "input_items", "response_store"]
