"""Thinking controls: every client's reasoning knob -> one ``enable_thinking`` bool.

Usage:
    enable_thinking = resolve_enable_thinking(body, default=settings.DEFAULT_THINKING)

Recognised fields (values are case-insensitive; surrounding whitespace ignored):

    chat_template_kwargs.enable_thinking   bool (also chat_template_kwargs.thinking, DeepSeek-style)
    enable_thinking                         bool
    thinking                                bool | "off"|"none"|"disabled"|... | "on"|"low"|...|"xhigh"
                                            | Anthropic {"type": "enabled"|"disabled"|"adaptive", "budget_tokens": n}
    reasoning                               {"enabled": bool} | {"effort"|"level"|"type": str} | str | bool
                                            (OpenRouter / Responses style; "max_tokens": n > 0 means on)
    reasoning_effort                        "none"|"off" -> False; "minimal"|"low"|"medium"|"high"|"xhigh"|"max" -> True

Precedence (first field present wins; ``None`` counts as absent):
  1. By field, most explicit first: chat_template_kwargs > enable_thinking > thinking >
     reasoning > reasoning_effort.
  2. Within one field, by location: top level > ``extra_body`` > ``metadata``.
  So ``extra_body.chat_template_kwargs.enable_thinking`` beats a top-level ``reasoning_effort``:
  the template switch is what the model actually sees, and LiteLLM may add a translated
  ``reasoning_effort`` next to a client's explicit switch.
  3. Nothing present -> ``default`` (DEFAULT_THINKING).

NOTE: "minimal" maps to True for both ``thinking`` and ``reasoning_effort``. It asks for a
little reasoning, not none (OpenAI later added "none" as a distinct value, and OpenClaw lists
"minimal" as a thinking level above "off"); the templates we drive only have an on/off switch.

Invalid values raise ``ThinkingControlError`` (a ``ValueError``) naming the field and the valid
choices; the HTTP layer answers it with 400.
"""
from __future__ import annotations

from typing import Any, Mapping

OFF_WORDS = frozenset({"off", "none", "disabled", "disable", "false", "no", "0"})
ON_WORDS = frozenset({
    "on", "true", "yes", "1", "enabled", "enable", "auto", "adaptive",
    "minimal", "low", "medium", "high", "xhigh", "max",
})

_FIELDS = ("chat_template_kwargs", "enable_thinking", "thinking", "reasoning", "reasoning_effort")
_LOCATIONS = ((), ("extra_body",), ("metadata",))


class ThinkingControlError(ValueError):
    """A thinking/reasoning request field has a value we cannot interpret (-> HTTP 400)."""


def _choices() -> str:
    return "true/false, " + "|".join(sorted(OFF_WORDS - {"0", "false"})) + " (off) or " + "|".join(
        sorted(ON_WORDS - {"1", "true"})
    ) + " (on)"


def _parse_word(value: Any, where: str) -> bool:
    """bool, 0/1 or an on/off/effort word."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in OFF_WORDS:
            return False
        if word in ON_WORDS:
            return True
    raise ThinkingControlError(f"invalid {where}={value!r}; use {_choices()}")


def _parse_budget(value: Any, where: str) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ThinkingControlError(f"invalid {where}={value!r}; use a token count >= 0 (0 = no thinking)")
    return value > 0


def _parse_thinking(value: Any, where: str) -> bool:
    if isinstance(value, Mapping):
        # Anthropic: {"type": "enabled", "budget_tokens": 2048} / {"type": "disabled"}
        if value.get("type") is not None:
            return _parse_word(value["type"], f"{where}.type")
        if value.get("enabled") is not None:
            return _parse_word(value["enabled"], f"{where}.enabled")
        if value.get("budget_tokens") is not None:
            return _parse_budget(value["budget_tokens"], f"{where}.budget_tokens")
        raise ThinkingControlError(
            f"invalid {where}={dict(value)!r}; expected {{\"type\": \"enabled\"|\"disabled\"}} "
            "(optionally with budget_tokens)"
        )
    return _parse_word(value, where)


def _parse_reasoning(value: Any, where: str) -> bool:
    if isinstance(value, Mapping):
        # An explicit enabled flag outranks effort/level/type inside the same object.
        for key in ("enabled", "type", "effort", "level"):
            if value.get(key) is not None:
                return _parse_word(value[key], f"{where}.{key}")
        if value.get("max_tokens") is not None:
            return _parse_budget(value["max_tokens"], f"{where}.max_tokens")
        raise ThinkingControlError(
            f"invalid {where}={dict(value)!r}; expected one of enabled, effort, level, type"
        )
    return _parse_word(value, where)


def _lookup(body: Mapping[str, Any], location: tuple[str, ...]) -> Mapping[str, Any] | None:
    node: Any = body
    for key in location:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def _field_value(container: Mapping[str, Any], field: str, prefix: str) -> tuple[bool, bool]:
    """(present, value) for one field in one container."""
    raw = container.get(field)
    if raw is None:
        return False, False
    where = prefix + field
    if field == "chat_template_kwargs":
        if not isinstance(raw, Mapping):
            raise ThinkingControlError(f"invalid {where}={raw!r}; expected an object")
        for key in ("enable_thinking", "thinking"):
            if raw.get(key) is not None:
                return True, _parse_word(raw[key], f"{where}.{key}")
        return False, False
    if field == "enable_thinking":
        return True, _parse_word(raw, where)
    if field == "thinking":
        return True, _parse_thinking(raw, where)
    if field == "reasoning":
        return True, _parse_reasoning(raw, where)
    return True, _parse_word(raw, where)  # reasoning_effort


def resolve_enable_thinking(body: Mapping[str, Any], default: bool) -> bool:
    """Map a request body's thinking/reasoning fields to one ``enable_thinking`` bool.

    Args:
        body: the parsed JSON request body.
        default: value when no field is present (DEFAULT_THINKING).

    Returns:
        True to render the prompt with thinking enabled.

    Raises:
        ThinkingControlError: a present field has an invalid value (answer with HTTP 400).
    """
    if not isinstance(body, Mapping):
        return bool(default)
    containers = [(loc, _lookup(body, loc)) for loc in _LOCATIONS]
    for field in _FIELDS:
        for loc, container in containers:
            if container is None:
                continue
            prefix = "".join(f"{k}." for k in loc)
            present, value = _field_value(container, field, prefix)
            if present:
                return value
    return bool(default)


__all__ = ["ThinkingControlError", "resolve_enable_thinking", "OFF_WORDS", "ON_WORDS"]
