"""A request's priority (vLLM's integer: lower goes first) and where it came from: the body's
``priority`` field, else the ``x-mlxstack-priority`` header (any front, through LiteLLM's
forwarded ``x-*`` headers), else what agent clients send (``derive``): the user's own turn is
interactive (0); a sub-agent's (Claude Code's Task agents, OpenClaw's spawned sub-agents) and a
background call's (a topic check no user waits on) wait behind it (1, 2). A client that says
nothing is interactive. The scheduler only compares the numbers (scheduler/priority.py).
"""
from __future__ import annotations

from typing import Any, Iterable, NamedTuple

INTERACTIVE, SUBAGENT, BACKGROUND = 0, 1, 2
LIMIT = 1000                      # |priority| accepted from a request
HEADER = "x-mlxstack-priority"

# what agent clients' own system prompts say (tools/real_clients captures): a sub-agent's, and a
# background call's that no user waits on
SUBAGENT_MARKERS = (
    ("claude-code-subagent", "You are an agent for Claude Code"),
    ("openclaw-subagent", "# Subagent Context"),
)
BACKGROUND_MARKERS = (
    ("claude-code-topic", "Analyze if this message indicates a new conversation topic"),
)


class Priority(NamedTuple):
    value: int
    source: str                   # request | header | <marker name> | default


def parse(value: Any, where: str) -> int:
    """An explicit priority: an integer within +-LIMIT (a numeric string from a header); raises
    ValueError naming ``where`` otherwise."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"'{where}' must be an integer (lower goes first)") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"'{where}' must be an integer (lower goes first)")
    if abs(value) > LIMIT:
        raise ValueError(f"'{where}' must be between -{LIMIT} and {LIMIT}")
    return value


def _system_texts(messages: Iterable[dict]) -> Iterable[str]:
    for m in messages:
        if m.get("role") not in ("system", "developer"):
            continue
        content = m.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]


def derive(messages: list[dict]) -> Priority:
    """The priority an agent client's request shape implies (``INTERACTIVE`` unless its system
    prompt is a known sub-agent's or background call's)."""
    texts = list(_system_texts(messages))
    for level, markers in ((BACKGROUND, BACKGROUND_MARKERS), (SUBAGENT, SUBAGENT_MARKERS)):
        for name, marker in markers:
            if any(marker in t for t in texts):
                return Priority(level, name)
    return Priority(INTERACTIVE, "default")


def resolve(body_value: Any, header_value: str | None, messages: list[dict]) -> Priority:
    """The request's priority: its body's ``priority``, else the header, else ``derive``."""
    if body_value is not None:
        return Priority(parse(body_value, "priority"), "request")
    if header_value is not None and header_value.strip():
        return Priority(parse(header_value, HEADER), "header")
    return derive(messages)


