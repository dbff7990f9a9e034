"""Responses API request -> the chat-completions body it means (pure; responses.py is the front).

``input`` as a string or items -- ``message`` (roles user, system, developer, assistant; parts
input_text / output_text / input_image), ``function_call``, ``function_call_output``,
``reasoning`` -- plus ``instructions`` (a leading system message, not carried over by
``previous_response_id``, as in OpenAI's API), function tools and ``namespace`` tool groups (hosted
tools such as web_search run on OpenAI's servers: they are not offered to the model here),
``tool_choice``, ``reasoning.effort`` (``none`` = thinking off, any other effort = on, absent =
DEFAULT_THINKING), ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format``,
``prompt_cache_key`` (the session id), ``prompt_cache_breakpoint`` on content parts (stored-entry
boundaries) with ``prompt_cache_options.ttl`` / ``prompt_cache_retention`` (their lifetime), and
``previous_response_id`` (the stored conversation it
names, response_store.py, comes in as ``history``).

Codex's reasoning round trip: a reasoning item it echoes carries the text in ``encrypted_content``
(``encode_reasoning_blob``, written by the reply side), read back here when its content is empty.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...engine.request import CacheBreakpoint
from ..common.chat_body import copy_cache_salt, copy_fields, function_tool, joined
from ..http.errors import bad_request
from ..common.opaque import decode_opaque, encode_opaque

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
    breakpoints: tuple = ()           # engine/request.CacheBreakpoint per prompt_cache_breakpoint
    cache_ttl: float | None = None    # prompt_cache_options.ttl / prompt_cache_retention, seconds

    @property
    def prewarm(self) -> bool:
        """``prompt_cache_options.prewarm``: prefill and store the prompt, generate nothing."""
        return bool((self.echo.get("prompt_cache_options") or {}).get("prewarm"))


def _where(i: int, *rest: Any) -> str:
    return f"input[{i}]" + "".join(f"[{r}]" if isinstance(r, int) else f".{r}" for r in rest)


def encode_reasoning_blob(text: str) -> str:
    """Opaque ``encrypted_content`` for a reasoning item: our own state, handed back by the client
    (base64 of the text, not encryption: the client already holds the text it was streamed)."""
    return encode_opaque(REASONING_BLOB_PREFIX, text, urlsafe=True)


def decode_reasoning_blob(blob: Any) -> str | None:
    """The reasoning text inside a blob from ``encode_reasoning_blob``; None for any other value
    (e.g. OpenAI's real encrypted content from another server)."""
    return decode_opaque(REASONING_BLOB_PREFIX, blob, urlsafe=True)


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


def _breakpoint(part: dict, where: str) -> bool:
    """Whether a content part carries ``prompt_cache_breakpoint`` ({"mode": "explicit"})."""
    mark = part.get("prompt_cache_breakpoint")
    if mark is None:
        return False
    if not isinstance(mark, dict) or mark.get("mode", "explicit") != "explicit":
        raise bad_request(f"{where}.prompt_cache_breakpoint must be {{\"mode\": \"explicit\"}}",
                          param=f"{where}.prompt_cache_breakpoint")
    return True


def _content_parts(content: Any, where: str, marks: list | None = None) -> str | list[dict]:
    """Responses message content -> chat content (a string, or text / image_url parts);
    ``marks`` gets, per ``prompt_cache_breakpoint``, the characters of text up to the marked part
    (None: the whole message -- a part that is not text)."""
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
        if marks is not None and _breakpoint(part, f"{where}[{j}]"):
            marks.append(sum(len(p["text"]) for p in parts if p["type"] == "text") if kind in _TEXT_PARTS else None)
    return joined(parts)


def _output_text(output: Any, where: str) -> str | list[dict]:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _content_parts(output, where)
    raise bad_request(f"{where} must be a string or a list of content parts", param=where)


def input_to_messages(items: Any, tool_names: ToolNames | None = None,
                      marks: list[tuple[int, int | None]] | None = None) -> list[dict]:
    """Responses ``input`` -> chat messages, in order (``marks`` gets (message index, chars) per
    ``prompt_cache_breakpoint``; chars None: after the whole message).

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
    open_at = -1                      # its index in messages (by position: equal messages are not the same turn)
    reasoning: list[str] = []         # reasoning items waiting for their assistant message

    def assistant() -> dict:
        nonlocal open_turn, open_at
        if open_turn is None:
            open_turn = {"role": "assistant", "content": ""}
            open_at = len(messages)
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
            found: list = []
            content = _content_parts(item.get("content"), _where(i, "content"), found)
            if role == "assistant":
                turn = assistant()
                if turn.get("content") or turn.get("tool_calls"):  # a second message: a new turn
                    open_turn = None
                    turn = assistant()
                turn["content"] = content
                at = open_at
                found = [None] * len(found)   # an assistant turn is marked at its end
            else:
                if reasoning:
                    assistant()  # a reply that was only reasoning is still a turn, in its place
                open_turn = None
                at = len(messages)
                messages.append({"role": role, "content": content})
            if marks is not None:
                marks.extend((at, chars if isinstance(content, str) else None) for chars in found)
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
            found = []
            output = item.get("output", "")
            output = _content_parts(output, _where(i, "output"), found) if isinstance(output, list) \
                else _output_text(output, _where(i, "output"))
            if marks is not None:
                marks.extend((len(messages), None) for _ in found)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
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
        chat_tools.append(function_tool(flat, t, "parameters"))
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
    marks: list[tuple[int, int | None]] = []
    conversation = [*(history or []), *input_to_messages(body.get("input"), names, marks)]
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    before = len(messages) - len(conversation) + len(history or [])   # chat index of the input's first message
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False)}
    if chat_tools:
        chat["tools"] = chat_tools
    choice = chat_tool_choice(body.get("tool_choice"), names)
    if choice is not None and chat_tools:
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    copy_fields(body, chat, (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k"), ("seed", "seed"), ("metadata", "metadata"),
                             ("enable_thinking", "enable_thinking"), ("chat_template_kwargs", "chat_template_kwargs")))
    copy_cache_salt(body, chat)
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
        chat["prompt_cache_key"] = body["prompt_cache_key"]   # compared by cache diagnoses
    cache_options = prompt_cache_options(body)
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in RETENTIONS:
        raise bad_request(f"'prompt_cache_retention' must be one of {', '.join(RETENTIONS)}",
                          param="prompt_cache_retention")
    asked = [t for t in (RETENTIONS.get(retention), CACHE_TTLS.get((cache_options or {}).get("ttl"))) if t is not None]
    ttl = max(asked) if asked else None
    if len(marks) > MAX_BREAKPOINTS:
        raise bad_request(f"at most {MAX_BREAKPOINTS} content blocks may carry prompt_cache_breakpoint "
                          f"(found {len(marks)})", param="input")
    breakpoints = tuple(CacheBreakpoint(before + m, chars, ttl) for m, chars in marks)
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
            "prompt_cache_key": body.get("prompt_cache_key"), "user": body.get("user"),
            "prompt_cache_options": cache_options, "prompt_cache_retention": retention}
    return ResponsesCall(chat_body=chat, conversation=conversation, tool_names=names,
                         stream=bool(body.get("stream", False)), store=store,
                         reasoning_blob="reasoning.encrypted_content" in include, echo=echo,
                         breakpoints=breakpoints, cache_ttl=ttl)


CACHE_TTLS = {"30m": 1800.0, "12h": 12 * 3600.0}      # prompt_cache_options.ttl -> seconds
RETENTIONS = {"in_memory": None, "24h": 24 * 3600.0}  # prompt_cache_retention -> seconds (None: default)
MAX_BREAKPOINTS = 4                                   # cache writes a request may mark
CACHE_MODES = ("implicit", "explicit")


def prompt_cache_options(body: dict) -> dict | None:
    """``prompt_cache_options`` = {comparison_response_id, prewarm, ttl, mode}, checked; None when
    absent. The response echoes mode, ttl and comparison_response_id."""
    opts = body.get("prompt_cache_options")
    if opts is None:
        return None
    where = "prompt_cache_options"
    if not isinstance(opts, dict):
        raise bad_request(f"'{where}' must be an object", param=where)
    cmp_id = opts.get("comparison_response_id")
    if cmp_id is not None and not isinstance(cmp_id, str):
        raise bad_request(f"'{where}.comparison_response_id' must be a string", param=f"{where}.comparison_response_id")
    if not isinstance(opts.get("prewarm", False), bool):
        raise bad_request(f"'{where}.prewarm' must be true or false", param=f"{where}.prewarm")
    ttl, mode = opts.get("ttl", "30m"), opts.get("mode", "implicit")
    if ttl not in CACHE_TTLS:
        raise bad_request(f"'{where}.ttl' must be one of {', '.join(CACHE_TTLS)}", param=f"{where}.ttl")
    if mode not in CACHE_MODES:
        raise bad_request(f"'{where}.mode' must be one of {', '.join(CACHE_MODES)}", param=f"{where}.mode")
    return {"mode": mode, "ttl": ttl, "comparison_response_id": cmp_id, "prewarm": opts.get("prewarm", False),
            "diagnose": "comparison_response_id" in opts,
            "compare_to": None if cmp_id is None else backend_response_id(cmp_id)}


LITELLM_ID_PREFIX = "litellm:custom_llm_provider:"


def backend_response_id(response_id: str) -> str:
    """Our own id inside a LiteLLM-managed one: LiteLLM's Responses route hands clients
    ``resp_`` + base64("litellm:custom_llm_provider:P;model_id:M;response_id:<ours>") and decodes
    ``previous_response_id`` on the way back, but not ids inside other fields."""
    import base64
    import binascii

    try:
        decoded = base64.b64decode(response_id.removeprefix("resp_").encode(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return response_id
    parts = decoded.split(";")
    if len(parts) >= 3 and parts[0].startswith(LITELLM_ID_PREFIX) and parts[2].startswith("response_id:"):
        return parts[2].removeprefix("response_id:")
    return response_id


__all__ = ["CACHE_MODES", "CACHE_TTLS", "backend_response_id", "prompt_cache_options", "INPUT_ITEM_TYPES", "MESSAGE_ROLES", "REASONING_BLOB_PREFIX", "ResponsesCall", "ToolNames",
           "chat_tool_choice", "decode_reasoning_blob", "encode_reasoning_blob", "input_to_messages",
           "responses_tools", "to_chat_body"]
