"""Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) on the chat pipeline.

Claude Code's full request reaches the model: LiteLLM passes these two paths through unchanged
(``general_settings.pass_through_endpoints``, see launcher/litellm_config.py), because its own
Anthropic->chat adapter rewrites a ``role: "system"`` entry inside ``messages[]`` into a user turn
with an injected "Operator note" and drops ``metadata`` (measured on LiteLLM 1.106.2).

    body --to_chat_body--> chat body --job_adapter--> the ChatJob /v1/chat/completions builds
         --ContentBlocks--> message JSON, or SSE (message_start, content_block_start/delta/stop,
                            message_delta, message_stop)

Request (pure): ``system`` (string or text blocks) first; ``messages`` in order, a ``role: "system"``
entry kept in place; user text / image / ``tool_result`` blocks (each tool_result becomes a
``tool`` message at its position); assistant ``text``, ``thinking`` (-> reasoning_content; the text,
or when the client got it omitted, the text carried in the block's ``signature``) and ``tool_use``
(-> tool_calls); ``cache_control`` on a block, a tool or the request (ttl 5m / 1h) is a
stored-entry boundary with its lifetime (docs/cache-diagnostics.md; the KV cache stays automatic
without it); tools with
``input_schema`` (``defer_loading`` tools are not shown to the model, as on Anthropic's API;
Anthropic-defined tool types cannot be described to it and are left out); ``thinking``
{enabled|adaptive} -> thinking on, {disabled} or absent -> off (Anthropic's default; ``output_config.
effort`` without ``thinking`` shapes the answer, not reasoning, so it does not switch thinking on);
``max_tokens``, ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``; the session id from
``x-claude-code-session-id`` or ``metadata.user_id`` (prompt/session_context.py).

Reply: ``thinking`` / ``text`` / ``tool_use`` blocks in generation order; ``thinking.display:
"omitted"`` streams thinking blocks without their text (the signature carries it back, so the next
turn renders the same tokens). Usage (server/common/usage.py): ``cache_read_input_tokens`` = tokens reused
from the KV cache, ``cache_creation_input_tokens`` = tokens this request stored (with
``cache_creation`` by lifetime; with breakpoints: up to the last one), ``input_tokens`` = the rest, ``output_tokens``; in a stream the
input side is on ``message_start`` already. ``diagnostics: {previous_message_id}`` (beta
``cache-diagnosis-2026-04-07``; null on a first turn to opt in) answers ``diagnostics.
cache_miss_reason`` (server/common/cache_diagnostics.py), on ``message_start`` in a stream.
Errors are Anthropic-shaped: ``{"type": "error", "error": {"type", "message"}}``; a prompt over the
window answers 400 "prompt is too long: ..." (the phrase Claude Code compacts on).
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from ...engine.request import CacheBreakpoint
from ...parsing.reasoning import REASONING
from ..common.chat_body import copy_cache_salt, copy_fields, function_tool, joined
from ..common.error_shapes import answer_errors
from ..common.error_shapes import messages_error as error_body
from ..http.errors import APIError, bad_request
from ..common.finish import matched_stop_sequence
from ..common.finish import messages_stop_reason as stop_reason
from ..common.items import ReplyParts, ReplySplit, whole_reply_events
from ..common.cache_diagnostics import anthropic_diagnostics, anthropic_request
from ..common.job_adapter import (Diagnosis, JobRun, chat_job, chat_request, request_headers, require_ready,
                                  submit_on_worker)
from ..common.opaque import decode_opaque, encode_opaque
from ..http.sse import event_frame
from ..common.structured import MESSAGES_FIELDS
from ..common.usage import outcome_usage, report_usage
from ..common.usage import messages_usage as usage_object
from ..common.validation import parse_json

SIGNATURE_PREFIX = "mlxstack.thinking.v1:"
MESSAGE_ROLES = ("user", "assistant", "system")


# ============================================================================ request -> chat body
def encode_signature(text: str) -> str:
    """A thinking block's ``signature``: the thinking text, base64-encoded (our own opaque state,
    not a cryptographic signature), so an omitted thinking block still round-trips exactly."""
    return encode_opaque(SIGNATURE_PREFIX, text, urlsafe=False)


def decode_signature(signature: Any) -> str | None:
    return decode_opaque(SIGNATURE_PREFIX, signature, urlsafe=False)


def _text_blocks(content: Any, where: str, marks: "Marks | None" = None, message: int = 0) -> str:
    """``system`` / text-only content: a string or a list of text blocks, joined (a block's
    ``cache_control`` marks chat message ``message`` after its text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", param=where)
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{j}] must be {{\"type\": \"text\", \"text\": ...}}", param=f"{where}[{j}]")
        out.append(block["text"])
        if marks is not None:
            marks.block(block, f"{where}[{j}]", message, sum(map(len, out)))
    return "".join(out)


ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4          # Anthropic's limit on blocks with cache_control


def cache_control_ttl(value: Any, where: str) -> float:
    """Seconds a ``cache_control`` asks for: {"type": "ephemeral", "ttl": "5m" | "1h"} (5m default)."""
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise bad_request(f"{where} must be {{\"type\": \"ephemeral\"}} (optionally with \"ttl\": \"5m\" or \"1h\")",
                          param=where)
    ttl = value.get("ttl", "5m")
    if ttl not in ANTHROPIC_TTLS:
        raise bad_request(f"{where}.ttl must be one of {', '.join(ANTHROPIC_TTLS)}", param=f"{where}.ttl")
    return ANTHROPIC_TTLS[ttl]


class Marks:
    """The request's ``cache_control`` breakpoints as chat-message positions, collected while the
    messages are translated (a mark after ``chars`` characters of a text message; None: after
    the whole message -- a tool_result, an assistant block, a turn with images). ``wheres``: each
    mark's block, in the same order."""

    def __init__(self) -> None:
        self.found: list[CacheBreakpoint] = []
        self.wheres: list[str] = []

    def block(self, block: Any, where: str, message: int, chars: int | None = None) -> None:
        if isinstance(block, dict) and block.get("cache_control") is not None:
            ttl = cache_control_ttl(block["cache_control"], f"{where}.cache_control")
            self.found.append(CacheBreakpoint(message, chars, ttl))
            self.wheres.append(where)
            if len(self.found) > MAX_BREAKPOINTS:
                raise bad_request(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                                  f"Found {len(self.found)}.", param=where)


def _image_part(block: dict, where: str) -> dict:
    source = block.get("source") if isinstance(block.get("source"), dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") if isinstance(source.get("media_type"), str) else "image/png"
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source['data']}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(f"{where}.source must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                      "{\"type\": \"url\", \"url\"}", param=f"{where}.source")


def _tool_result_content(content: Any, where: str) -> str | list[dict]:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of blocks", param=where)
    parts: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, f"{where}[{j}]"))
        elif kind == "tool_reference" and isinstance(block.get("tool_name"), str):
            parts.append({"type": "text", "text": f"tool_reference: {block['tool_name']}"})
        else:
            raise bad_request(f"{where}[{j}].type {kind!r} is not supported in a tool_result; use text or image",
                              param=f"{where}[{j}].type")
    return joined(parts)


def _user_messages(content: Any, where: str, marks: Marks | None = None, base: int = 0) -> list[dict]:
    """One user turn -> chat messages: text/image runs become user messages, each tool_result a tool
    message, in block order (``base``: the chat index of the first; ``marks`` collects cache_control)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", param=where)
    out: list[dict] = []
    run: list[dict] = []

    def flush() -> None:
        if run:
            out.append({"role": "user", "content": joined(list(run))})
            run.clear()

    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        w = f"{where}[{j}]"
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{w}.text must be a string", param=f"{w}.text")
            run.append({"type": "text", "text": block["text"]})
            if marks is not None:   # (a run with images stays a list of parts: its mark is its end)
                marks.block(block, w, base + len(out), sum(len(p.get("text", "")) for p in run))
        elif kind == "image":
            run.append(_image_part(block, w))
            if marks is not None:
                marks.block(block, w, base + len(out))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise bad_request(f"{w}.tool_use_id must be a non-empty string", param=f"{w}.tool_use_id")
            flush()
            if marks is not None:
                marks.block(block, w, base + len(out))
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": _tool_result_content(block.get("content"), f"{w}.content")})
        else:
            raise bad_request(f"{w}.type {kind!r} is not supported in a user message; use text, image or "
                              "tool_result", param=f"{w}.type")
    flush()
    return out


def _assistant_message(content: Any, where: str, marks: Marks | None = None, index: int = 0) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", param=where)
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        w = f"{where}[{j}]"
        if marks is not None:   # an assistant turn is marked at its end (reasoning, calls, closer)
            marks.block(block, w, index)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{w}.text must be a string", param=f"{w}.text")
            text.append(block["text"])
        elif kind == "thinking":
            thought = block.get("thinking") if isinstance(block.get("thinking"), str) else ""
            reasoning.append(thought or decode_signature(block.get("signature")) or "")
        elif kind == "redacted_thinking":
            continue  # opaque data from another server: nothing the model can be shown
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{w} (tool_use) needs string 'id' and 'name'", param=w)
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{w}.input must be an object", param=f"{w}.input")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        else:
            raise bad_request(f"{w}.type {kind!r} is not supported in an assistant message; use text, thinking "
                              "or tool_use", param=f"{w}.type")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
        msg["content"] = msg["content"] or None
    return msg


def messages_to_chat(system: Any, messages: Any, marks: Marks | None = None) -> list[dict]:
    """Anthropic ``system`` + ``messages`` -> chat messages, every entry kept in its place
    (``marks`` collects the blocks' ``cache_control`` breakpoints by chat message)."""
    out: list[dict] = []
    if system is not None:
        text = _text_blocks(system, "system", marks, 0)
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in MESSAGE_ROLES:
            raise bad_request(f"{where}.role {role!r} is not one of {', '.join(MESSAGE_ROLES)}", param=f"{where}.role")
        content = m.get("content")
        if role == "user":
            out += _user_messages(content, f"{where}.content", marks, len(out))
        elif role == "assistant":
            out.append(_assistant_message(content, f"{where}.content", marks, len(out)))
        else:
            out.append({"role": "system", "content": _text_blocks(content, f"{where}.content", marks, len(out))})
    return out


def cache_marks(body: dict, chat: dict, marks: Marks) -> tuple[tuple[CacheBreakpoint, ...], float | None]:
    """(breakpoints, the lifetime asked for the rest) of a request whose messages ``marks``
    collected: a tool's ``cache_control`` marks the end of the leading system message (where
    templates write the tools; none without one), the top-level one (automatic caching) the end
    of the last message, as Anthropic places it on the last cacheable block."""
    found = list(marks.found)
    messages = chat["messages"]
    ordered: list[tuple[str, float]] = []      # (block, ttl) in Anthropic's order: tools, system, messages
    for k, tool in enumerate(body.get("tools") or []):
        if isinstance(tool, dict) and tool.get("cache_control") is not None:
            ttl = cache_control_ttl(tool["cache_control"], f"tools[{k}].cache_control")
            ordered.append((f"tools[{k}]", ttl))
            if messages and messages[0].get("role") == "system":
                found.append(CacheBreakpoint(0, None, ttl))
    ordered += [(where, mark.ttl) for where, mark in zip(marks.wheres, marks.found)]
    top = body.get("cache_control")
    rest = None
    if top is not None:
        rest = cache_control_ttl(top, "cache_control")
        found.append(CacheBreakpoint(len(messages) - 1, None, rest))
        ordered.append(("", rest))             # automatic caching marks the last block
    if len(found) > MAX_BREAKPOINTS:
        raise bad_request(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                          f"Found {len(found)}.", param="cache_control")
    check_ttl_order(ordered)
    return tuple(found), rest


def check_ttl_order(ordered: list[tuple[str, float]]) -> None:
    """Anthropic's rule: a longer-lived breakpoint never follows a shorter-lived one (1h after 5m
    is a 400), in processing order -- tools, system, messages -- whatever the body's key order."""
    shortest = None
    for where, ttl in ordered:
        if shortest is not None and ttl > shortest:
            field = f"{where}.cache_control.ttl" if where else "cache_control.ttl"
            dotted = re.sub(r"\[(\d+)\]", r".\1", field)          # messages[0].content[4] -> messages.0.content.4
            raise bad_request(f"{dotted}: a ttl='{_ttl_name(ttl)}' cache_control block must not come after a "
                              f"ttl='{_ttl_name(shortest)}' cache_control block. Note that blocks are processed in "
                              "the following order: `tools`, `system`, `messages`.", param=field)
        shortest = ttl if shortest is None else min(shortest, ttl)


def _ttl_name(seconds: float) -> str:
    return next(name for name, value in ANTHROPIC_TTLS.items() if value == seconds)


INTERLEAVED_THINKING_BETA = "interleaved-thinking-2025-05-14"


def check_thinking_budget(body: dict, headers: dict[str, str]) -> None:
    """Anthropic's rule: ``thinking.budget_tokens`` must be below ``max_tokens`` (the thinking is
    part of the reply) -- except with interleaved thinking (the ``anthropic-beta`` header names it),
    where the budget covers every thinking block of the turn and may exceed ``max_tokens``."""
    thinking, limit = body.get("thinking"), body.get("max_tokens")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if not (_is_int(budget) and _is_int(limit)) or limit < 1 or budget < limit:
        return          # (a max_tokens out of range is its own validator's 400)
    betas = {b.strip() for b in headers.get("anthropic-beta", "").split(",")}
    if INTERLEAVED_THINKING_BETA in betas:
        return
    raise bad_request("`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation "
                      "at https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
                      "#max-tokens-and-context-window-size", param="thinking.budget_tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def anthropic_tools(tools: Any) -> list[dict] | None:
    """Client tools -> chat function tools (deferred and Anthropic-defined tools left out)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", param="tools")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object", param=where)
        if tool.get("type") not in (None, "custom") or tool.get("defer_loading") is True:
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"{where} needs a non-empty string 'name'", param=f"{where}.name")
        out.append(function_tool(tool["name"], tool, "input_schema"))
    return out or None


def chat_tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise bad_request("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                          "{\"type\": \"tool\", \"name\": ...}", param="tool_choice")
    return mapped


def output_format(body: dict) -> dict | None:
    """Anthropic JSON outputs -> chat ``response_format``: ``output_config.format`` (what the SDK's
    ``messages.create`` / ``messages.parse(output_format=Model)`` send) or the beta top-level
    ``output_format``, each ``{"type": "json_schema", "schema": {...}}``; enforced strictly."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("'output_config' must be an object", param="output_config")
    for where, fmt in (("output_config.format", (config or {}).get("format")), ("output_format", body.get("output_format"))):
        if fmt is None:
            continue
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise bad_request(f"'{where}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", param=where)
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}
    return None


def to_chat_body(body: dict, marks: Marks | None = None) -> dict:
    """Translate an Anthropic Messages request into the chat-completions body it means (``marks``
    collects its ``cache_control`` breakpoints)."""
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages_to_chat(body.get("system"),
                                                                                      body.get("messages"), marks),
                            "stream": body.get("stream", False)}
    tools = anthropic_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        choice = chat_tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
        if isinstance(body.get("tool_choice"), dict) and body["tool_choice"].get("disable_parallel_tool_use") is True:
            chat["parallel_tool_calls"] = False
    fmt = output_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    copy_cache_salt(body, chat)
    copy_fields(body, chat, (("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("top_k", "top_k"), ("stop_sequences", "stop"), ("metadata", "metadata")))
    # Anthropic semantics: no `thinking` field means no extended thinking (Claude Code with
    # CLAUDE_CODE_DISABLE_THINKING=1 still sends output_config.effort, which shapes the answer).
    chat["thinking"] = body["thinking"] if body.get("thinking") is not None else {"type": "disabled"}
    return chat


def thinking_omitted(body: dict) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("display") == "omitted"


# ============================================================================ reply -> content blocks
class ContentBlocks(ReplyParts):
    """Splitter events -> Anthropic content blocks (``blocks``, in generation order), plus the stream
    events that build them (items.ReplyParts): thinking and text blocks grow delta by delta; a
    thinking block ends with its signature; each tool call is a tool_use block."""

    def __init__(self, omit_thinking: bool = False) -> None:
        super().__init__()
        self.omit_thinking = omit_thinking
        self.blocks = self.parts

    @property
    def has_tool_use(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _start(self, kind: str) -> list[dict]:
        start = {"type": "thinking", "thinking": "", "signature": ""} if kind == REASONING else \
            {"type": "text", "text": ""}
        return [{"type": "content_block_start", "index": len(self.blocks), "content_block": start}]

    def _delta(self, kind: str, text: str) -> list[dict]:
        if kind == REASONING:
            if self.omit_thinking:
                return []
            return [{"type": "content_block_delta", "index": len(self.blocks),
                     "delta": {"type": "thinking_delta", "thinking": text}}]
        return [{"type": "content_block_delta", "index": len(self.blocks),
                 "delta": {"type": "text_delta", "text": text}}]

    def _end(self, kind: str, text: str) -> list[dict]:
        index = len(self.blocks)
        out: list[dict] = []
        if kind == REASONING:
            signature = encode_signature(text)
            self.blocks.append({"type": "thinking", "thinking": "" if self.omit_thinking else text,
                                "signature": signature})
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": signature}})
        else:
            self.blocks.append({"type": "text", "text": text})
        return out + [{"type": "content_block_stop", "index": index}]

    def _tool_call(self, call: Any) -> list[dict]:
        index = len(self.blocks)
        try:
            args = json.loads(call.arguments)
        except ValueError:
            args = {}
        self.blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": args})
        return [{"type": "content_block_start", "index": index,
                 "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                {"type": "content_block_stop", "index": index}]


def reply_blocks(text: str, *, thinking_started: bool, tools: list | None, family: str, salt: str,
                 omit_thinking: bool) -> ContentBlocks:
    """The content blocks of a whole reply: the streaming path's blocks, built in one pass."""
    blocks = ContentBlocks(omit_thinking)
    blocks.push_events(whole_reply_events(text, thinking_started=thinking_started, tools=tools, family=family,
                                          salt=salt))
    blocks.close()
    return blocks


def message_object(message_id: str, model: str, blocks: list[dict], *, stop: str | None,
                   stop_sequence: str | None, usage: dict, diagnostics: dict | None = None) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": stop, "stop_sequence": stop_sequence, "usage": usage, "diagnostics": diagnostics}


def message_diagnostics(report: Any) -> dict | None:
    """``diagnostics`` for a request that sent ``diagnostics: {previous_message_id}`` (null otherwise,
    and when nothing diverged)."""
    return anthropic_diagnostics(report.asked) if report is not None else None


def whole_message(message_id: str, model: str, outcome: Any, *, tools: list | None, family: str,
                  stops: list[str], omit_thinking: bool) -> dict:
    """The message object of a whole (non-streamed) reply."""
    blocks = reply_blocks(outcome.text, thinking_started=outcome.thinking_started, tools=tools, family=family,
                          salt=message_id, omit_thinking=omit_thinking)
    seq = matched_stop_sequence(outcome.text, outcome.raw_text, stops)
    return message_object(message_id, model, blocks.blocks,
                          stop=stop_reason(outcome.finish_reason, blocks.has_tool_use, seq),
                          stop_sequence=seq, usage=usage_object(outcome_usage(outcome)),
                          diagnostics=message_diagnostics(outcome.cache))


class MessagesStream:
    """FrameEncoder for one streamed message (see job_adapter.FrameEncoder)."""

    def __init__(self, message_id: str, model: str, *, tools: list | None, family: str, stops: list[str],
                 omit_thinking: bool) -> None:
        self.message_id, self.model, self.stops = message_id, model, stops
        self.blocks = ContentBlocks(omit_thinking)
        self.split = ReplySplit(tools=tools, family=family, salt=message_id)

    def start(self, ready: Any) -> list[bytes]:
        self.split.open(ready)
        # Token counts are known only when the reply ends: message_delta carries them in full.
        # the input side is known once the prompt is looked up; output tokens come with message_delta
        report = getattr(ready, "cache", None)
        opening = message_object(self.message_id, self.model, [], stop=None, stop_sequence=None,
                                 usage=usage_object(report_usage(report)),
                                 diagnostics=message_diagnostics(getattr(ready, "cache", None)))
        return [event_frame({"type": "message_start", "message": opening})]

    def feed(self, text: str) -> list[bytes]:
        return [event_frame(p) for p in self.blocks.push_events(self.split.feed(text))]

    def finish(self, outcome: Any) -> list[bytes]:
        payloads = self.blocks.push_events(self.split.finish(outcome)) + self.blocks.close()
        seq = matched_stop_sequence(outcome.text, outcome.raw_text, self.stops)
        reason = stop_reason(outcome.finish_reason, self.blocks.has_tool_use, seq)
        payloads.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                         "usage": usage_object(outcome_usage(outcome))})
        payloads.append({"type": "message_stop"})
        return [event_frame(p) for p in payloads]

    def error(self, err: APIError) -> list[bytes]:
        return [event_frame(error_body(err))]


# ============================================================================ HTTP handlers
def handle_messages(h: Any) -> None:
    """POST /v1/messages (errors in Anthropic's envelope)."""
    answer_errors(h, lambda: _messages(h), error_body)


def handle_count_tokens(h: Any) -> None:
    """POST /v1/messages/count_tokens: the rendered prompt's real token count."""
    answer_errors(h, lambda: _count_tokens(h), error_body)


def _messages(h: Any) -> None:
    app = h.app
    body = parse_json(h.read_body())
    require_ready(app)
    marks = Marks()
    chat = to_chat_body(body, marks)
    breakpoints, ttl = cache_marks(body, chat, marks)
    check_thinking_budget(body, request_headers(h))
    req = chat_request(app, chat, MESSAGES_FIELDS, app.alias_patterns)   # LiteLLM's pass-through: the client's name
    message_id = "msg_" + uuid.uuid4().hex
    omit = thinking_omitted(body)
    wanted, previous = anthropic_request(body, request_headers(h))
    run = JobRun.submit(h, req, message_id[-12:], stream=req.stream,
                        diagnosis=Diagnosis(message_id, wanted, previous, breakpoints=breakpoints, cache_ttl=ttl))
    run.answer(h, lambda: MessagesStream(message_id, app.model_id, tools=req.tools, family=app.family,
                                         stops=req.stop, omit_thinking=omit),
               lambda outcome: whole_message(message_id, app.model_id, outcome, tools=req.tools, family=app.family,
                                             stops=req.stop, omit_thinking=omit))


def _count_tokens(h: Any) -> None:
    app = h.app
    body = parse_json(h.read_body())
    require_ready(app)
    chat = to_chat_body(body)
    chat["stream"] = False
    req = chat_request(app, chat, None, app.alias_patterns)    # counting needs no grammar
    job = chat_job(req, "count-" + uuid.uuid4().hex[:6], request_headers(h), emit=lambda _t: None,
                   on_prompt=lambda _p: None, is_cancelled=lambda: False)
    future = submit_on_worker(app, app.prepare_call(job))
    n = h._result(future)
    app.count_status(200)
    h._json(200, {"input_tokens": n})


__all__ = ["ContentBlocks", "MessagesStream", "anthropic_tools", "chat_tool_choice", "decode_signature",
           "encode_signature", "error_body", "handle_count_tokens", "handle_messages", "matched_stop_sequence",
           "messages_to_chat", "output_format", "reply_blocks", "stop_reason", "to_chat_body", "usage_object"]
