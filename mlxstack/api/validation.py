"""Request validation: JSON body -> ChatRequest, or an APIError(400) that says what to fix."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..config.settings import Settings
from ..pipeline.images import image_parts
from ..pipeline.thinking import resolve_enable_thinking
from .errors import APIError, bad_request

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    repetition_context_size: int
    max_tokens: int
    stop: list[str]
    seed: int | None
    tools: list | None
    enable_thinking: bool
    body: dict


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _number(body: dict, name: str, default: float, *, lo: float | None = None, hi: float | None = None,
            integer: bool = False, positive: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise bad_request(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(value)[:40]}", param=name)
    if positive and value <= 0:
        raise bad_request(f"'{name}' must be a positive integer, got {value}", param=name)
    if lo is not None and value < lo or hi is not None and value > hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return int(value) if integer else float(value)


def _validate_message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", param=where)
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role {role!r} is not one of {', '.join(sorted(ROLES))}", param=f"{where}.role")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise bad_request(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, (dict, str)):
                raise bad_request(f"{where}.content[{j}] must be a content part object", param=f"{where}.content")
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise bad_request(f"{where}.tool_calls must be a list of {{'id','type','function':{{'name','arguments'}}}}",
                              param=f"{where}.tool_calls")
    if content is None and role != "assistant":
        raise bad_request(f"{where}.content is required for role {role!r}", param=f"{where}.content")
    return m


def parse_chat_request(body: dict, settings: Settings) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    messages = [_validate_message(i, m) for i, m in enumerate(messages)]
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", settings.default_max_tokens, integer=True, positive=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("'stop' must be a string or a list of strings", param="stop")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad_request("'tools' must be a list of tool objects", param="tools")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_request("'seed' must be an integer", param="seed")
    try:
        thinking = resolve_enable_thinking(body, settings.default_thinking)
    except ValueError as exc:
        raise bad_request(str(exc), param="thinking") from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        temperature=_number(body, "temperature", settings.default_temperature, lo=0, hi=5),
        top_p=_number(body, "top_p", settings.default_top_p, lo=0, hi=1),
        top_k=_number(body, "top_k", settings.default_top_k, lo=0, integer=True),
        min_p=_number(body, "min_p", settings.default_min_p, lo=0, hi=1),
        repetition_penalty=_number(body, "repetition_penalty", settings.default_repetition_penalty, lo=0, hi=10),
        repetition_context_size=_number(body, "repetition_context_size", settings.default_repetition_context_size,
                                        integer=True, positive=True),
        max_tokens=max_tokens,
        stop=stop,
        seed=seed,
        tools=tools or None,
        enable_thinking=thinking,
        body=body,
    )


def reject_images(messages: list[dict], model_id: str) -> None:
    """A text-only model cannot see images: say so instead of silently dropping them."""
    for i, j, part in image_parts(messages):
        raise bad_request(f"model {model_id} does not accept images (messages[{i}].content[{j}] is "
                          f"{part.get('type', 'image_url')!r}); send text only or serve a vision-language model",
                          param=f"messages[{i}].content", code="images_not_supported")


def model_matches(requested: str | None, served: str, aliases: set[str]) -> bool:
    if not requested:
        return True
    names = {served, *aliases}
    bare = requested.split("/", 1)[1] if "/" in requested else requested
    return requested in names or bare in names or requested.rsplit("/", 1)[-1] in names


__all__ = ["APIError", "ChatRequest", "parse_chat_request", "parse_json", "model_matches", "reject_images"]
