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
                family: str = "generic", id_salt: str = "") -> ParsedOutput:
    if family == HARMONY:
        from .harmony import split_harmony

        return split_harmony(text, tools=tools, id_salt=id_salt)
    return split_output(text, thinking_started=thinking_started, tools=tools, family=family, id_salt=id_salt)


def reply_splitter(*, thinking_started: bool = False, tools: list | None = None, family: str = "generic",
                   id_salt: str = "") -> Any:
    if family == HARMONY:
        from .harmony import HarmonyStreamSplitter

        return HarmonyStreamSplitter(tools=tools, id_salt=id_salt)
    return ReasoningStreamSplitter(thinking_started=thinking_started, tools=tools, family=family, id_salt=id_salt)
