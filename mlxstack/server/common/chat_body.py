"""Pieces every front uses to write the chat-completions body its request means (pure).

The Responses and Anthropic fronts translate their request into a chat-completions body that
job_adapter validates like any /v1/chat/completions body; these are the steps they share:

    joined([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    function_tool("get_weather", tool, "input_schema")   # {"type": "function", "function": {...}}
    copy_fields(body, chat, (("max_output_tokens", "max_tokens"), ("top_p", "top_p")))
"""
from __future__ import annotations

from typing import Any, Iterable

def joined(parts: list[dict]) -> str | list[dict]:
    """Chat content from chat parts: text-only parts as one string (the renderer joins text parts
    the same way), else the parts themselves (images among them)."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def function_tool(name: str, tool: dict, schema_key: str) -> dict:
    """A chat function tool named ``name`` from a front's tool object: its parameters under
    ``schema_key`` (an empty object schema when absent), ``description`` and ``strict`` when given."""
    fn: dict[str, Any] = {"name": name, "parameters": tool.get(schema_key) or {"type": "object", "properties": {}}}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool):
        fn["strict"] = tool["strict"]
    return {"type": "function", "function": fn}


def copy_fields(body: dict, chat: dict, pairs: Iterable[tuple[str, str]]) -> None:
    """``chat[dst] = body[src]`` for each (src, dst) whose value is present and not None."""
    for src, dst in pairs:
        if body.get(src) is not None:
            chat[dst] = body[src]


def copy_cache_salt(body: dict, chat: dict) -> None:
    """The client's ``cache_salt`` (top level or ``extra_body``) onto the translated chat body,
    unvalidated: the chat validation names it for every front alike."""
    if body.get("cache_salt") is not None:
        chat["cache_salt"] = body["cache_salt"]
    elif isinstance(body.get("extra_body"), dict) and body["extra_body"].get("cache_salt") is not None:
        chat["extra_body"] = {"cache_salt": body["extra_body"]["cache_salt"]}


__all__ = ["copy_cache_salt", "copy_fields", "function_tool", "joined"]
