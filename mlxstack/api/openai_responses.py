"""OpenAI Responses API (``POST /v1/responses``, Codex's wire protocol) on the chat pipeline.

    request body --to_chat_body--> chat-completions body --job_adapter--> the same ChatJob, cache and
    session layers as /v1/chat/completions --OutputItems--> response object, or SSE events

Request side (pure): ``input`` as a string or items -- ``message`` (roles user, system, developer,
assistant; parts input_text / output_text / input_image), ``function_call``,
``function_call_output``, ``reasoning`` -- plus ``instructions`` (a leading system message, not
carried over by ``previous_response_id``, as in OpenAI's API), function tools and ``namespace``
tool groups (hosted tools such as web_search run on OpenAI's servers: they are not offered to the
model here), ``tool_choice``, ``reasoning.effort`` (``none`` = thinking off, any other effort = on,
absent = DEFAULT_THINKING), ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format``,
``prompt_cache_key`` (the session id) and ``previous_response_id`` (a bounded in-memory store of
stored responses' conversations, ``store: true``, the API's default).

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

import base64
import binascii
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..parsing.output import reply_splitter, split_reply
from ..parsing.reasoning import CONTENT, REASONING, TOOL_CALLS
from .errors import APIError, bad_request
from ..engine.chat import GRAMMAR_DEAD_END
from ..pipeline.sized_lru import SizedLRU
from .job_adapter import JobRun, Usage, chat_request, outcome_incomplete, outcome_usage, require_ready
from .structured import RESPONSES_FIELDS
from .validation import parse_json

log = logging.getLogger("mlxstack.responses")

RESPONSE_STORE_MAX = 256          # conversations kept for previous_response_id (LRU; RESPONSE_STORE_MAX_ENTRIES)
RESPONSE_STORE_MAX_BYTES = 256 << 20   # and their bytes (RESPONSE_STORE_MAX_BYTES)
REASONING_BLOB_PREFIX = "mlxstack.reasoning.v1:"
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


# ============================================================================ request -> chat body
@dataclass
class ToolNames:
    """Chat-side function names <-> Responses tools (a namespaced tool keeps its group)."""
    by_flat: dict[str, tuple[str | None, str]] = field(default_factory=dict)

    def flat(self, name: str, namespace: str | None = None) -> str:
        for flat, (ns, inner) in self.by_flat.items():
            if inner == name and (namespace is None or ns == namespace):
                return flat
        return name

    def source(self, flat: str) -> tuple[str | None, str]:
        return self.by_flat.get(flat, (None, flat))


@dataclass
class ResponsesCall:
    """A parsed Responses request: the translated chat body plus what the reply must echo."""
    chat_body: dict
    conversation: list[dict]          # history + this input, as chat messages (no instructions)
    tool_names: ToolNames
    stream: bool
    store: bool
    reasoning_blob: bool              # include has "reasoning.encrypted_content"
    echo: dict                        # request fields the response object repeats


def _where(i: int, *rest: Any) -> str:
    return f"input[{i}]" + "".join(f"[{r}]" if isinstance(r, int) else f".{r}" for r in rest)


def encode_reasoning_blob(text: str) -> str:
    """Opaque ``encrypted_content`` for a reasoning item: our own state, handed back by the client
    (base64 of the text, not encryption: the client already holds the text it was streamed)."""
    return REASONING_BLOB_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def decode_reasoning_blob(blob: Any) -> str | None:
    """The reasoning text inside a blob from ``encode_reasoning_blob``; None for any other value
    (e.g. OpenAI's real encrypted content from another server)."""
    if not isinstance(blob, str) or not blob.startswith(REASONING_BLOB_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(blob[len(REASONING_BLOB_PREFIX):].encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def _text_of(parts: Any, where: str) -> str:
    """Text of a string or a list of text parts (summary_text, reasoning_text, input_text, ...)."""
    if parts is None:
        return ""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise bad_request(f"{where} must be a string or a list of text parts", param=where)
    out = []
    for j, part in enumerate(parts):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str):
            raise bad_request(f"{where}[{j}] must be an object with a string 'text'", param=f"{where}[{j}]")
        out.append(text)
    return "".join(out)


def _content_parts(content: Any, where: str) -> str | list[dict]:
    """Responses message content -> chat content (a string, or text / image_url parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise bad_request(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise bad_request(f"{where}[{j}] needs 'image_url' (a data: or http(s) URL); file_id images "
                                  "are not supported here", param=f"{where}[{j}].image_url")
            image: dict[str, Any] = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise bad_request(f"{where}[{j}].type {kind!r} is not supported; use input_text, output_text or "
                              "input_image", param=f"{where}[{j}].type")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # the renderer joins text parts the same way
    return parts


def _output_text(output: Any, where: str) -> str | list[dict]:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content_parts(output, where)
    raise bad_request(f"{where} must be a string or a list of content parts", param=where)


def input_to_messages(items: Any, tool_names: ToolNames | None = None) -> list[dict]:
    """Responses ``input`` -> chat messages, in order.

    One assistant turn arrives as several items (reasoning, message, function_call...): they are
    merged into one assistant message (reasoning_content, content, tool_calls) -- the shape the
    chat pipeline renders and the healing store remembers.
    """
    names = tool_names or ToolNames()
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a non-empty string or a non-empty list of items", param="input")
    messages: list[dict] = []
    open_turn: dict | None = None     # the assistant message items are still being merged into
    reasoning: list[str] = []         # reasoning items waiting for their assistant message

    def assistant() -> dict:
        nonlocal open_turn
        if open_turn is None:
            open_turn = {"role": "assistant", "content": ""}
            messages.append(open_turn)
        if reasoning:
            open_turn["reasoning_content"] = open_turn.get("reasoning_content", "") + "".join(reasoning)
            reasoning.clear()
        return open_turn

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad_request(f"{_where(i)} must be an object", param=_where(i))
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise bad_request(f"{_where(i, 'role')} {role!r} is not one of {', '.join(MESSAGE_ROLES)}",
                                  param=_where(i, "role"))
            content = _content_parts(item.get("content"), _where(i, "content"))
            if role == "assistant":
                turn = assistant()
                if turn.get("content") or turn.get("tool_calls"):  # a second message: a new turn
                    open_turn = None
                    turn = assistant()
                turn["content"] = content
            else:
                if reasoning:
                    assistant()  # a reply that was only reasoning is still a turn, in its place
                open_turn = None
                messages.append({"role": role, "content": content})
        elif kind == "reasoning":
            text = _text_of(item.get("content"), _where(i, "content"))
            if not text:
                text = decode_reasoning_blob(item.get("encrypted_content")) or ""
            if open_turn is not None and (open_turn.get("content") or open_turn.get("tool_calls")):
                open_turn = None  # reasoning after visible output starts the next turn
            reasoning.append(text)
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{_where(i)} (function_call) needs string 'name' and 'call_id'", param=_where(i))
            if not isinstance(args, str):
                raise bad_request(f"{_where(i, 'arguments')} must be a JSON string", param=_where(i, "arguments"))
            ns = item.get("namespace") if isinstance(item.get("namespace"), str) else None
            turn = assistant()
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": names.flat(name, ns), "arguments": args}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{_where(i)} (function_call_output) needs a string 'call_id'", param=_where(i))
            if reasoning:
                assistant()
            open_turn = None
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _output_text(item.get("output", ""), _where(i, "output"))})
        else:
            raise bad_request(f"{_where(i, 'type')} {kind!r} is not supported; use one of "
                              f"{', '.join(INPUT_ITEM_TYPES)} (send the full item instead of an item_reference)",
                              param=_where(i, "type"))
    if reasoning:
        assistant()  # reasoning with nothing after it still belongs to an assistant turn
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls") and m.get("content") == "":
            m["content"] = None
    return messages


def responses_tools(tools: Any) -> tuple[list[dict] | None, ToolNames]:
    """Responses tools -> chat function tools. Namespaced functions are flattened to their own
    name (``group.name`` when two groups share one); hosted and other non-function tools are not
    offered to the model (it cannot call them here)."""
    names = ToolNames()
    if tools is None:
        return None, names
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", param="tools")
    found: list[tuple[str | None, dict, str]] = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", param=where)
        if tool.get("type") == "function":
            found.append((None, tool, where))
        elif tool.get("type") == "namespace":
            inner = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(inner, list):
                raise bad_request(f"{where} (namespace) needs a string 'name' and a list 'tools'", param=where)
            for j, t in enumerate(inner):
                if isinstance(t, dict) and t.get("type", "function") == "function":
                    found.append((tool["name"], t, f"{where}.tools[{j}]"))
    counts: dict[str, int] = {}
    for _, t, _ in found:
        if isinstance(t.get("name"), str):
            counts[t["name"]] = counts.get(t["name"], 0) + 1
    chat_tools = []
    for ns, t, where in found:
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where} needs a non-empty string 'name'", param=f"{where}.name")
        flat = f"{ns}.{name}" if ns is not None and counts[name] > 1 else name
        names.by_flat[flat] = (ns, name)
        fn: dict[str, Any] = {"name": flat, "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        if isinstance(t.get("strict"), bool):
            fn["strict"] = t["strict"]
        chat_tools.append({"type": "function", "function": fn})
    return chat_tools or None, names


def chat_tool_choice(choice: Any, names: ToolNames) -> Any:
    """Responses tool_choice -> chat tool_choice (a hosted-tool choice means no function is forced)."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": names.flat(choice["name"], choice.get("namespace"))}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return choice.get("mode", "auto")
    if isinstance(choice, dict):
        return "auto"
    raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                      param="tool_choice")


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise bad_request("'text.format.type' must be text, json_object or json_schema", param="text.format.type")


def to_chat_body(body: dict, history: list[dict] | None = None) -> ResponsesCall:
    """Translate a Responses request (and the stored conversation of ``previous_response_id``)."""
    for name in ("background", "conversation"):
        if body.get(name):
            raise bad_request(f"'{name}' is not supported by this server; send the conversation in 'input' "
                              "(or chain with previous_response_id)", param=name, code="unsupported_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", param="instructions")
    chat_tools, names = responses_tools(body.get("tools"))
    conversation = [*(history or []), *input_to_messages(body.get("input"), names)]
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    if chat_tools:
        chat["tools"] = chat_tools
    choice = chat_tool_choice(body.get("tool_choice"), names)
    if choice is not None and chat_tools:
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k"), ("seed", "seed"), ("metadata", "metadata"),
                     ("enable_thinking", "enable_thinking"), ("chat_template_kwargs", "chat_template_kwargs")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object like {\"effort\": \"medium\"}", param="reasoning")
    if reasoning and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if isinstance(body.get("prompt_cache_key"), str) and body["prompt_cache_key"].strip():
        chat["session_id"] = body["prompt_cache_key"]  # Codex sends its conversation id here
    include = body.get("include") or []
    if not isinstance(include, list):
        raise bad_request("'include' must be a list of strings", param="include")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise bad_request("'store' must be true or false", param="store")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"), "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": (reasoning or {}).get("summary")},
            "text": body.get("text") or {"format": {"type": "text"}}, "store": store,
            "prompt_cache_key": body.get("prompt_cache_key"), "user": body.get("user")}
    return ResponsesCall(chat_body=chat, conversation=conversation, tool_names=names,
                         stream=bool(body.get("stream", False)), store=store,
                         reasoning_blob="reasoning.encrypted_content" in include, echo=echo)


# ============================================================================ output items
class OutputItems:
    """Splitter events -> Responses output items, plus the stream events that build them.

    ``push``/``close`` return event payloads (without ``sequence_number``); ``items`` holds the
    finished items in output order. Consecutive pieces of one kind extend the open item.
    """

    def __init__(self, response_id: str, tool_names: ToolNames, reasoning_blob: bool) -> None:
        self._stem = response_id.split("_", 1)[-1][:24]
        self._names = tool_names
        self._blob = reasoning_blob
        self.items: list[dict] = []
        self._open: dict | None = None
        self._text: list[str] = []

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{self._stem}{len(self.items):03d}"

    @property
    def _index(self) -> int:
        return len(self.items)

    def push(self, kind: str, text: str = "", calls: tuple = ()) -> list[dict]:
        out: list[dict] = []
        want = {REASONING: "reasoning", CONTENT: "message"}.get(kind)
        if self._open is not None and self._open["type"] != want:
            out += self.close()
        if kind == TOOL_CALLS:
            for call in calls:
                out += self._function_call(call)
            return out
        if not text:
            return out
        if self._open is None:
            out += self._start(want)
        self._text.append(text)
        item_id, idx = self._open["id"], self._index
        if want == "reasoning":
            out.append({"type": "response.reasoning_text.delta", "item_id": item_id, "output_index": idx,
                        "content_index": 0, "delta": text})
        else:
            out.append({"type": "response.output_text.delta", "item_id": item_id, "output_index": idx,
                        "content_index": 0, "delta": text, "logprobs": []})
        return out

    def _start(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            self._open = {"id": self._id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            return [{"type": "response.output_item.added", "output_index": self._index, "item": dict(self._open)}]
        self._open = {"id": self._id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                      "content": []}
        return [{"type": "response.output_item.added", "output_index": self._index, "item": dict(self._open)},
                {"type": "response.content_part.added", "item_id": self._open["id"], "output_index": self._index,
                 "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}]

    def close(self) -> list[dict]:
        """Finish the open reasoning / message item, if any."""
        if self._open is None:
            return []
        item, idx, text = self._open, self._index, "".join(self._text)
        self._open, self._text = None, []
        if item["type"] == "reasoning":
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

    def _function_call(self, call: Any) -> list[dict]:
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
            out += self._start("message") + self.close()
        return out


def usage_object(usage: Usage, reasoning_tokens: int) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


INCOMPLETE_REASONS = {"length": "max_output_tokens", GRAMMAR_DEAD_END: "content_filter"}


def reply_status(outcome: Any) -> tuple[str, str | None]:
    """(status, incomplete_details.reason): "completed", or "incomplete" with "max_output_tokens"
    (the token budget cut the reply) or "content_filter" (its grammar could not continue it: the
    API's own word for a reply the server cut, as finish_reason on chat completions)."""
    why = outcome_incomplete(outcome)
    return ("incomplete", INCOMPLETE_REASONS[why]) if why else ("completed", None)


def response_object(response_id: str, model: str, created_at: int, echo: dict, *, status: str,
                    output: list[dict], usage: dict | None, error: dict | None = None,
                    reason: str | None = "max_output_tokens") -> dict:
    """The Responses ``response`` object (what create returns and the stream events carry)."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": reason} if status == "incomplete" else None,
        "instructions": echo["instructions"], "max_output_tokens": echo["max_output_tokens"],
        "model": model, "output": output, "parallel_tool_calls": echo["parallel_tool_calls"],
        "previous_response_id": echo["previous_response_id"], "prompt_cache_key": echo["prompt_cache_key"],
        "reasoning": echo["reasoning"], "store": echo["store"], "temperature": echo["temperature"],
        "text": echo["text"], "tool_choice": echo["tool_choice"], "tools": echo["tools"], "top_p": echo["top_p"],
        "truncation": "disabled", "usage": usage, "user": echo["user"], "metadata": echo["metadata"],
    }


def reply_items(text: str, *, thinking_started: bool, tools: list | None, family: str, response_id: str,
                tool_names: ToolNames, reasoning_blob: bool) -> list[dict]:
    """The output items of a whole reply: the streaming path's items, built in one pass."""
    builder = OutputItems(response_id, tool_names, reasoning_blob)
    splitter = reply_splitter(thinking_started=thinking_started, tools=tools, family=family, id_salt=response_id)
    for ev in [*splitter.feed(text), *splitter.finish()]:
        builder.push(ev.kind, ev.text, ev.calls)
    builder.finish()
    return builder.items


def reasoning_text(items: list[dict]) -> str:
    return "".join(c["text"] for it in items if it["type"] == "reasoning" for c in it.get("content", []))


def sse_event(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n".encode("utf-8")


class ResponsesStream:
    """FrameEncoder for one streamed response (see job_adapter.FrameEncoder)."""

    def __init__(self, response_id: str, model: str, call: ResponsesCall, *, tools: list | None, family: str,
                 count_tokens: Callable[[str], int], on_finish: Callable[[Any], None] = lambda _o: None) -> None:
        self.response_id, self.model, self.call = response_id, model, call
        self.tools, self.family, self.count_tokens, self.on_finish = tools, family, count_tokens, on_finish
        self.created_at = int(time.time())
        self.items = OutputItems(response_id, call.tool_names, call.reasoning_blob)
        self.splitter: Any = None
        self.seq = 0

    def _frames(self, payloads: list[dict]) -> list[bytes]:
        out = []
        for p in payloads:
            out.append(sse_event({**p, "sequence_number": self.seq}))
            self.seq += 1
        return out

    def _response(self, status: str, usage: dict | None = None, error: dict | None = None,
                  reason: str | None = None) -> dict:
        return response_object(self.response_id, self.model, self.created_at, self.call.echo, status=status,
                               output=list(self.items.items), usage=usage, error=error, reason=reason)

    def _split(self, events: list) -> list[dict]:
        out: list[dict] = []
        for ev in events:
            out += self.items.push(ev.kind, ev.text, ev.calls)
        return out

    def start(self, ready: Any) -> list[bytes]:
        if ready is not None:
            self.splitter = reply_splitter(thinking_started=ready.thinking_started, tools=self.tools,
                                           family=self.family, id_salt=self.response_id)
        first = self._response("in_progress")
        return self._frames([{"type": "response.created", "response": first},
                             {"type": "response.in_progress", "response": first}])

    def feed(self, text: str) -> list[bytes]:
        return self._frames(self._split(self.splitter.feed(text)))

    def finish(self, outcome: Any) -> list[bytes]:
        if self.splitter is None:
            self.splitter = reply_splitter(thinking_started=outcome.thinking_started, tools=self.tools,
                                           family=self.family, id_salt=self.response_id)
        payloads = self._split(self.splitter.finish()) + self.items.finish()
        status, reason = reply_status(outcome)
        usage = usage_object(outcome_usage(outcome), self.count_tokens(reasoning_text(self.items.items)))
        self.on_finish(outcome)  # before the last event: a client may chain on it at once
        return self._frames(payloads + [{"type": f"response.{status}",
                                         "response": self._response(status, usage, reason=reason)}])

    def error(self, err: APIError) -> list[bytes]:
        failed = self._response("failed", error={"code": err.code or "server_error", "message": err.message})
        return self._frames([{"type": "response.failed", "response": failed}])


# ============================================================================ previous_response_id
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
        history = store.get(prev)
        if history is None:
            raise APIError(400, f"Previous response with id '{prev}' not found (this server keeps the last "
                           f"{store.max_entries} stored responses in memory; send the full conversation in "
                           "'input' instead)", param="previous_response_id", code="previous_response_not_found")
    call = to_chat_body(body, history)
    req = chat_request(app, call.chat_body, RESPONSES_FIELDS)
    response_id = "resp_" + uuid.uuid4().hex
    run = JobRun.submit(h, req, response_id[-12:], stream=call.stream)

    def count_tokens(text: str) -> int:
        return len(app.loaded.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def remember(outcome: Any) -> None:
        """Store the conversation before the client can see the response (and chain on its id)."""
        if call.store and not outcome.aborted:
            reply = assistant_message(outcome.text, thinking_started=outcome.thinking_started, tools=req.tools,
                                      family=app.family, response_id=response_id)
            store.put(response_id, [*call.conversation, reply])

    if call.stream:
        encoder = ResponsesStream(response_id, app.model_id, call, tools=req.tools, family=app.family,
                                  count_tokens=count_tokens, on_finish=remember)
        outcome = run.stream(h, encoder)
    else:
        outcome = run.wait(h)
        if outcome is None:
            return
        items = reply_items(outcome.text, thinking_started=outcome.thinking_started, tools=req.tools,
                            family=app.family, response_id=response_id, tool_names=call.tool_names,
                            reasoning_blob=call.reasoning_blob)
        usage = usage_object(outcome_usage(outcome), count_tokens(reasoning_text(items)))
        status, reason = reply_status(outcome)
        remember(outcome)
        app.count_status(200)
        h._json(200, response_object(response_id, app.model_id, int(time.time()), call.echo, status=status,
                                     output=items, usage=usage, reason=reason))
    if outcome is not None:
        app.after_response(run.job, outcome)


__all__ = ["OutputItems", "ResponseStore", "ResponsesCall", "ResponsesStream", "ToolNames", "assistant_message",
           "chat_tool_choice", "decode_reasoning_blob", "encode_reasoning_blob", "handle_responses",
           "input_to_messages", "reply_items", "response_object", "responses_tools", "to_chat_body",
           "usage_object"]
