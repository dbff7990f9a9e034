"""OpenAI Responses API (``POST /v1/responses``, Codex's wire protocol) on the chat pipeline.

    request body --to_chat_body--> chat-completions body --job_adapter--> the same ChatJob, cache and
    session layers as /v1/chat/completions --OutputItems--> response object, or SSE events

Request side (pure, responses_to_chat.py): ``input`` items and the request's fields -> the
chat-completions body they mean, plus what the reply must echo (``ResponsesCall``);
``previous_response_id`` conversations are kept in response_store.py.

Output side (pure): the reply is split by the chat grammar (``<think>``, tool calls) into output
items -- ``reasoning`` (raw text as ``reasoning_text`` content, and, when the request includes
``reasoning.encrypted_content``, the same text in ``encrypted_content``: Codex never echoes raw
reasoning content, but echoes that opaque field, so the next turn sees the reasoning it was given),
``message`` (``output_text``), ``function_call`` (``call_id``, ``namespace`` for grouped tools) --
streamed as response.created, response.in_progress, then per item response.output_item.added,
content_part.added / output_text.delta / output_text.done / content_part.done,
reasoning_text.delta / reasoning_text.done, function_call_arguments.delta / .done,
response.output_item.done, and finally response.completed (response.incomplete when the token
budget cut the reply, response.failed on an error). Usage: input_tokens (+ input_tokens_details.
cached_tokens = tokens reused from the KV cache), output_tokens (+ output_tokens_details.
reasoning_tokens = the reasoning text re-encoded), total_tokens.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Callable
from urllib.parse import parse_qs

from ...parsing.reasoning import CONTENT, REASONING
from ..common.error_shapes import responses_error
from ..http.errors import APIError, bad_request
from ..common.finish import responses_status as reply_status
from ..common.items import ReplyParts, ReplySplit, whole_reply_events
from ..common.cache_diagnostics import openai_diagnostics
from ...cache.summary import TENANT_HEADER, scope_of
from ..common.job_adapter import Diagnosis, JobRun, chat_request, request_headers, require_ready
from .response_store import (ResponseStore, assistant_message, conversation_bytes, input_items,  # noqa: F401
                             response_store)
from .responses_to_chat import (ResponsesCall, ToolNames, chat_tool_choice, decode_reasoning_blob,  # noqa: F401
                                encode_reasoning_blob, input_to_messages, responses_tools, to_chat_body)
from ..http.sse import event_frame
from ..common.structured import RESPONSES_FIELDS
from ..common.usage import outcome_usage
from ..common.usage import responses_usage as usage_object
from ..common.validation import parse_json


# ============================================================================ output items
class OutputItems(ReplyParts):
    """Splitter events -> Responses output items (``items``, in output order), plus the stream events
    that build them (items.ReplyParts; event payloads without ``sequence_number``): reasoning and
    message items grow delta by delta, each tool call is a function_call item."""

    def __init__(self, response_id: str, tool_names: ToolNames, reasoning_blob: bool) -> None:
        super().__init__()
        self._stem = response_id.split("_", 1)[-1][:24]
        self._names = tool_names
        self._blob = reasoning_blob
        self.items = self.parts
        self._item: dict = {}             # the open item, as output_item.added showed it

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{self._stem}{len(self.items):03d}"

    @property
    def _index(self) -> int:
        return len(self.items)

    def _start(self, kind: str) -> list[dict]:
        if kind == REASONING:
            self._item = {"id": self._id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            return [{"type": "response.output_item.added", "output_index": self._index, "item": dict(self._item)}]
        self._item = {"id": self._id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                      "content": []}
        return [{"type": "response.output_item.added", "output_index": self._index, "item": dict(self._item)},
                {"type": "response.content_part.added", "item_id": self._item["id"], "output_index": self._index,
                 "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}]

    def _delta(self, kind: str, text: str) -> list[dict]:
        item_id, idx = self._item["id"], self._index
        if kind == REASONING:
            return [{"type": "response.reasoning_text.delta", "item_id": item_id, "output_index": idx,
                     "content_index": 0, "delta": text}]
        return [{"type": "response.output_text.delta", "item_id": item_id, "output_index": idx,
                 "content_index": 0, "delta": text, "logprobs": []}]

    def _end(self, kind: str, text: str) -> list[dict]:
        item, idx = self._item, self._index
        if kind == REASONING:
            done = {"id": item["id"], "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}],
                    "encrypted_content": encode_reasoning_blob(text) if self._blob else None, "status": "completed"}
            events = [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": idx,
                       "content_index": 0, "text": text}]
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = {"id": item["id"], "type": "message", "status": "completed", "role": "assistant", "content": [part]}
            events = [{"type": "response.output_text.done", "item_id": item["id"], "output_index": idx,
                       "content_index": 0, "text": text, "logprobs": []},
                      {"type": "response.content_part.done", "item_id": item["id"], "output_index": idx,
                       "content_index": 0, "part": part}]
        self.items.append(done)
        return events + [{"type": "response.output_item.done", "output_index": idx, "item": done}]

    def _tool_call(self, call: Any) -> list[dict]:
        ns, name = self._names.source(call.name)
        item: dict[str, Any] = {"id": self._id("fc"), "type": "function_call", "status": "in_progress",
                                "call_id": call.id, "name": name, "arguments": ""}
        if ns is not None:
            item["namespace"] = ns
        idx = self._index
        done = {**item, "status": "completed", "arguments": call.arguments}
        self.items.append(done)
        return [{"type": "response.output_item.added", "output_index": idx, "item": item},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": idx,
                 "delta": call.arguments},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": idx,
                 "name": name, "arguments": call.arguments},
                {"type": "response.output_item.done", "output_index": idx, "item": done}]

    def finish(self) -> list[dict]:
        """Close the open item; a reply with no output at all still gets one (empty) message."""
        out = self.close()
        if not self.items:
            out += self._begin(CONTENT) + self.close()
        return out


def response_object(response_id: str, model: str, created_at: int, echo: dict, *, status: str,
                    output: list[dict], usage: dict | None, error: dict | None = None,
                    reason: str | None = "max_output_tokens", cache: Any = None) -> dict:
    """The Responses ``response`` object (what create returns and the stream events carry);
    ``cache`` (the engine's CacheReport, once the prompt was looked up) answers
    ``prompt_cache_diagnostics`` when ``prompt_cache_options.comparison_response_id`` asked."""
    opts = echo.get("prompt_cache_options")
    extra: dict[str, Any] = {}
    if opts is not None:
        extra["prompt_cache_options"] = {k: opts[k] for k in ("mode", "ttl", "comparison_response_id")}
        if opts["diagnose"] and cache is not None:
            extra["prompt_cache_diagnostics"] = openai_diagnostics(cache.asked)
    return {**extra, 
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": reason} if status == "incomplete" else None,
        "instructions": echo["instructions"], "max_output_tokens": echo["max_output_tokens"],
        "model": model, "output": output, "parallel_tool_calls": echo["parallel_tool_calls"],
        "previous_response_id": echo["previous_response_id"], "prompt_cache_key": echo["prompt_cache_key"],
        "prompt_cache_retention": echo.get("prompt_cache_retention"),
        "reasoning": echo["reasoning"], "store": echo["store"], "temperature": echo["temperature"],
        "text": echo["text"], "tool_choice": echo["tool_choice"], "tools": echo["tools"], "top_p": echo["top_p"],
        "truncation": "disabled", "usage": usage, "user": echo["user"], "metadata": echo["metadata"],
    }


def reply_items(text: str, *, thinking_started: bool, tools: list | None, family: str, response_id: str,
                tool_names: ToolNames, reasoning_blob: bool) -> list[dict]:
    """The output items of a whole reply: the streaming path's items, built in one pass."""
    builder = OutputItems(response_id, tool_names, reasoning_blob)
    builder.push_events(whole_reply_events(text, thinking_started=thinking_started, tools=tools, family=family,
                                           salt=response_id))
    builder.finish()
    return builder.items


def reasoning_text(items: list[dict]) -> str:
    return "".join(c["text"] for it in items if it["type"] == "reasoning" for c in it.get("content", []))


class ResponsesStream:
    """FrameEncoder for one streamed response (see job_adapter.FrameEncoder)."""

    def __init__(self, response_id: str, model: str, call: ResponsesCall, *, tools: list | None, family: str,
                 count_tokens: Callable[[str], int],
                 on_finish: Callable[[Any, dict], None] = lambda _o, _r: None) -> None:
        self.response_id, self.model, self.call = response_id, model, call
        self.count_tokens, self.on_finish = count_tokens, on_finish
        self.created_at = int(time.time())
        self.items = OutputItems(response_id, call.tool_names, call.reasoning_blob)
        self.split = ReplySplit(tools=tools, family=family, salt=response_id)
        self.seq = 0
        self.cache: Any = None

    def _frames(self, payloads: list[dict]) -> list[bytes]:
        out = []
        for p in payloads:
            out.append(event_frame({**p, "sequence_number": self.seq}))
            self.seq += 1
        return out

    def _response(self, status: str, usage: dict | None = None, error: dict | None = None,
                  reason: str | None = None) -> dict:
        return response_object(self.response_id, self.model, self.created_at, self.call.echo, status=status,
                               output=list(self.items.items), usage=usage, error=error, reason=reason,
                               cache=self.cache)

    def start(self, ready: Any) -> list[bytes]:
        self.cache = getattr(ready, "cache", None)
        self.split.open(ready)
        first = self._response("in_progress")
        return self._frames([{"type": "response.created", "response": first},
                             {"type": "response.in_progress", "response": first}])

    def feed(self, text: str) -> list[bytes]:
        return self._frames(self.items.push_events(self.split.feed(text)))

    def finish(self, outcome: Any) -> list[bytes]:
        self.cache = outcome.cache or self.cache
        payloads = self.items.push_events(self.split.finish(outcome)) + self.items.finish()
        if self.call.prewarm:
            payloads, self.items.items[:] = [], []   # prewarm: the prompt stored, no output
        status, reason = ("completed", None) if self.call.prewarm else reply_status(outcome)
        usage = usage_object(outcome_usage(outcome), self.count_tokens(reasoning_text(self.items.items)))
        final = self._response(status, usage, reason=reason)
        self.on_finish(outcome, final)  # before the last event: a client may chain on it (or GET it) at once
        return self._frames(payloads + [{"type": f"response.{status}", "response": final}])

    def error(self, err: APIError) -> list[bytes]:
        return self._frames([{"type": "response.failed", "response": self._response("failed",
                                                                                     error=responses_error(err))}])


# ============================================================================ HTTP handler
def handle_responses(h: Any) -> None:
    """POST /v1/responses (the handler thread; generation runs on the inference worker)."""
    app = h.app
    body = parse_json(h.read_body())
    require_ready(app)
    store = response_store(app)
    history = None
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise bad_request("'previous_response_id' must be a string", param="previous_response_id")
        history = store.get(stored_key(h, prev))
        if history is None:
            raise APIError(400, f"Previous response with id '{prev}' not found (this server keeps the last "
                           f"{store.max_entries} stored responses in memory; send the full conversation in "
                           "'input' instead)", param="previous_response_id", code="previous_response_not_found")
    call = to_chat_body(body, history)
    req = chat_request(app, call.chat_body, RESPONSES_FIELDS)
    response_id = "resp_" + uuid.uuid4().hex
    opts = call.echo.get("prompt_cache_options") or {}
    run = JobRun.submit(h, req, response_id[-12:], stream=call.stream,
                        diagnosis=Diagnosis(response_id, bool(opts.get("diagnose")), opts.get("compare_to"),
                                            call.prewarm, call.breakpoints, call.cache_ttl))

    def count_tokens(text: str) -> int:
        return len(app.loaded.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def remember(outcome: Any, response: dict) -> None:
        """Store the conversation, the response object and its input items before the client can
        see the response (and chain on its id, or retrieve it)."""
        if call.store and not outcome.aborted and not call.prewarm:
            reply = assistant_message(outcome.text, thinking_started=outcome.thinking_started, tools=req.tools,
                                      family=app.family, response_id=response_id)
            store.put(stored_key(h, response_id), [*call.conversation, reply], response,
                      input_items(body["input"], response_id))

    def whole(outcome: Any) -> dict:
        items = [] if call.prewarm else reply_items(
            outcome.text, thinking_started=outcome.thinking_started, tools=req.tools, family=app.family,
            response_id=response_id, tool_names=call.tool_names, reasoning_blob=call.reasoning_blob)
        usage = usage_object(outcome_usage(outcome), count_tokens(reasoning_text(items)))
        status, reason = ("completed", None) if call.prewarm else reply_status(outcome)
        response = response_object(response_id, app.model_id, int(time.time()), call.echo, status=status,
                                   output=items, usage=usage, reason=reason, cache=outcome.cache)
        remember(outcome, response)
        return response

    run.answer(h, lambda: ResponsesStream(response_id, app.model_id, call, tools=req.tools, family=app.family,
                                          count_tokens=count_tokens, on_finish=remember), whole)


# ============================================================================ stored responses
INPUT_ITEMS_MAX_LIMIT = 100      # OpenAI's bounds for input_items ``limit`` (default 20)


def stored_key(h: Any, response_id: str) -> str:
    """Where a response is stored: under its id in its tenant's space (the tenant the front door
    vouched for): another tenant's retrieve, delete, input_items or previous_response_id of that
    id finds nothing -- the same 404 as an id never issued."""
    tenant = request_headers(h).get(TENANT_HEADER, "")
    return f"{scope_of(tenant, '')}/{response_id}" if tenant else response_id


def stored_or_404(response_id: str, found: Any) -> Any:
    """``found``, or OpenAI's 404 for an id the store does not hold (never stored, store: false,
    evicted or deleted)."""
    if found is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
    return found


def handle_retrieve(h: Any, response_id: str) -> None:
    """GET /v1/responses/{id}: the stored response object, as it was answered."""
    store = response_store(h.app)
    query = query_params(h)
    if query.get("stream", "false") not in ("false", "0", ""):
        raise bad_request("'stream' is not supported when retrieving a response here; retrieve it whole",
                          param="stream", code="unsupported_parameter")
    h.app.count_status(200)
    h._json(200, stored_or_404(response_id, store.response(stored_key(h, response_id))))


def handle_delete(h: Any, response_id: str) -> None:
    """DELETE /v1/responses/{id}: forget it (no longer retrievable nor a previous_response_id)."""
    store = response_store(h.app)
    stored_or_404(response_id, True if store.delete(stored_key(h, response_id)) else None)
    h.app.count_status(200)
    h._json(200, {"id": response_id, "object": "response", "deleted": True})


def handle_input_items(h: Any, response_id: str) -> None:
    """GET /v1/responses/{id}/input_items?limit=&order=&after=: the request's input items, a page."""
    store = response_store(h.app)
    items = stored_or_404(response_id, store.input_items(stored_key(h, response_id)))
    q = query_params(h)
    h.app.count_status(200)
    h._json(200, input_items_page(items, q.get("limit"), q.get("order"), q.get("after")))


def input_items_page(items: list[dict], limit: Any = None, order: Any = None, after: Any = None) -> dict:
    """One page of input items in OpenAI's list shape (pure): ``order`` desc (default: newest
    first) or asc, ``limit`` 1-100 (default 20), ``after`` an item id (the page starts after it)."""
    try:
        n = 20 if limit is None else int(limit)
    except ValueError:
        n = 0
    if not 1 <= n <= INPUT_ITEMS_MAX_LIMIT:
        raise bad_request(f"'limit' must be an integer from 1 to {INPUT_ITEMS_MAX_LIMIT}", param="limit")
    order = "desc" if order is None else order
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'", param="order")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [it["id"] for it in ordered]
        if after not in ids:
            raise bad_request(f"'after' names no input item of this response: {after!r}", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + n]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + n < len(ordered)}


def query_params(h: Any) -> dict[str, str]:
    """The request's query parameters (the last value of each)."""
    query = h.path.split("?", 1)[1] if "?" in h.path else ""
    return {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}


__all__ = ["OutputItems", "ResponseStore", "ResponsesCall", "ResponsesStream", "ToolNames", "assistant_message",
           "chat_tool_choice", "decode_reasoning_blob", "encode_reasoning_blob", "handle_delete", "handle_input_items",
           "handle_responses", "handle_retrieve", "input_items_page",
           "input_to_messages", "reply_items", "response_object", "responses_tools", "to_chat_body",
           "usage_object"]
