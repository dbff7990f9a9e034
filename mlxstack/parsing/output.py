"""Which output grammar a model's replies follow, in one place (pure).

    parsed = split_reply(text, thinking_started=..., tools=..., family=...)      # whole reply
    splitter = reply_splitter(thinking_started=..., tools=..., family=...)      # streamed

Families: ``harmony`` (GPT-OSS channels, parsing/harmony.py) or the ``<think>`` / ``<tool_call>``
grammar every other family shares (parsing/reasoning.py, parsing/tool_calls.py).
"""
from __future__ import annotations

from typing import Any

from .reasoning import ParsedOutput, ReasoningStreamSplitter, split_output

HARMONY = "harmony"


def split_reply(text: str, *, thinking_started: bool = False, tools: list | None = None,
                family: str = "generic", id_salt: str = "", parse_tools: bool = True) -> ParsedOutput:
    """``parse_tools=False`` (tool_choice "none"): no tool calls are returned; call markup the
    model wrote anyway stays in the content, never silently dropped."""
    if family == HARMONY:
        from .harmony import split_harmony

        parsed = split_harmony(text, tools=tools, id_salt=id_salt)
        if not parse_tools and parsed.tool_calls:
            calls = "\n".join(f"{c.name}({c.arguments})" for c in parsed.tool_calls)
            return ParsedOutput(parsed.reasoning, (parsed.content + "\n" + calls).strip(), [])
        return parsed
    return split_output(text, thinking_started=thinking_started, tools=tools, family=family, id_salt=id_salt,
                        parse_tools=parse_tools)


def reply_splitter(*, thinking_started: bool = False, tools: list | None = None, family: str = "generic",
                   id_salt: str = "", parse_tools: bool = True) -> Any:
    if family == HARMONY:
        from .harmony import HarmonyStreamSplitter

        return HarmonyStreamSplitter(tools=tools, id_salt=id_salt)
    return ReasoningStreamSplitter(thinking_started=thinking_started, tools=tools, family=family, id_salt=id_salt,
                                   parse_tools=parse_tools)
