"""Thinking controls -> one enable_thinking bool."""
from __future__ import annotations

import pytest

from mlxstack.prompt.thinking import ThinkingControlError, resolve_enable_thinking


@pytest.mark.parametrize("default", [True, False])
def test_no_field_gives_default(default):
    assert resolve_enable_thinking({"messages": []}, default) is default
    assert resolve_enable_thinking({"thinking": None, "reasoning_effort": None}, default) is default
    assert resolve_enable_thinking({"metadata": {"user_id": "u"}}, default) is default


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"enable_thinking": False}, False),
        ({"enable_thinking": True}, True),
        ({"enable_thinking": "false"}, False),
        ({"thinking": False}, False),
        ({"thinking": "off"}, False),
        ({"thinking": "none"}, False),
        ({"thinking": "disabled"}, False),
        ({"thinking": "0"}, False),
        ({"thinking": " OFF "}, False),
        ({"thinking": "on"}, True),
        ({"thinking": "low"}, True),
        ({"thinking": "medium"}, True),
        ({"thinking": "high"}, True),
        ({"thinking": "xhigh"}, True),
        ({"thinking": "minimal"}, True),
        ({"thinking": "enabled"}, True),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, True),
        ({"thinking": {"type": "disabled"}}, False),
        ({"thinking": {"type": "adaptive"}}, True),
        ({"thinking": {"budget_tokens": 0}}, False),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "off"}, False),
        ({"reasoning_effort": "minimal"}, True),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "xhigh"}, True),
        ({"reasoning": {"enabled": False}}, False),
        ({"reasoning": {"enabled": True}}, True),
        ({"reasoning": {"effort": "none"}}, False),
        ({"reasoning": {"effort": "high"}}, True),
        ({"reasoning": {"level": "off"}}, False),
        ({"reasoning": {"type": "disabled"}}, False),
        ({"reasoning": {"max_tokens": 1000}}, True),
        ({"reasoning": {"enabled": False, "effort": "high"}}, False),  # explicit flag wins inside
        ({"reasoning": "low"}, True),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"chat_template_kwargs": {"thinking": True}}, True),
        ({"chat_template_kwargs": {}}, None),  # present but empty -> falls through to default
        ({"extra_body": {"enable_thinking": False}}, False),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, False),
        ({"metadata": {"thinking": "off"}}, False),
        ({"metadata": {"enable_thinking": "false"}}, False),  # OpenAI metadata values are strings
    ],
)
def test_single_field(body, expected):
    for default in (True, False):
        want = default if expected is None else expected
        assert resolve_enable_thinking(body, default) is want, (body, default)


def test_precedence_by_field_then_location():
    # chat_template_kwargs > enable_thinking > thinking > reasoning > reasoning_effort
    assert resolve_enable_thinking(
        {"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True,
         "thinking": "high", "reasoning": {"enabled": True}, "reasoning_effort": "high"}, True) is False
    assert resolve_enable_thinking({"enable_thinking": False, "thinking": "high"}, True) is False
    assert resolve_enable_thinking({"thinking": "off", "reasoning": {"effort": "high"}}, True) is False
    assert resolve_enable_thinking({"reasoning": {"effort": "none"}, "reasoning_effort": "high"}, True) is False
    # a more explicit field nested in extra_body beats a less explicit one at top level
    assert resolve_enable_thinking(
        {"reasoning_effort": "high", "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, True
    ) is False
    # same field: top level > extra_body > metadata
    assert resolve_enable_thinking(
        {"thinking": "off", "extra_body": {"thinking": "on"}, "metadata": {"thinking": "on"}}, True) is False
    assert resolve_enable_thinking(
        {"extra_body": {"thinking": "off"}, "metadata": {"thinking": "on"}}, True) is False
    assert resolve_enable_thinking(
        {"extra_body": {"thinking": "on"}, "metadata": {"thinking": "off"}}, False) is True


@pytest.mark.parametrize(
    "body",
    [
        {"thinking": "sometimes"},
        {"thinking": 7},
        {"thinking": {"type": "maybe"}},
        {"thinking": {"foo": 1}},
        {"thinking": {"budget_tokens": -1}},
        {"enable_thinking": "perhaps"},
        {"reasoning_effort": "ultra-mega"},
        {"reasoning": {"effort": 3}},
        {"reasoning": {}},
        {"chat_template_kwargs": "enable_thinking=false"},
        {"chat_template_kwargs": {"enable_thinking": "nah"}},
        {"extra_body": {"reasoning_effort": "bogus"}},
        {"metadata": {"thinking": "bogus"}},
    ],
)
def test_invalid_values_raise_value_error_with_field_name(body):
    with pytest.raises(ThinkingControlError) as info:
        resolve_enable_thinking(body, True)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "invalid" in msg
    # the message names the offending field path
    leaf = next(iter(body))
    assert leaf in msg


def test_openclaw_and_pi_shapes():
    # OpenClaw with thinking=off through LiteLLM: reasoning_effort dropped, thinking kept.
    assert resolve_enable_thinking({"model": "m", "messages": [], "thinking": "off", "stream": True}, True) is False
    # PI coding agent: reasoning_effort
    assert resolve_enable_thinking({"model": "m", "messages": [], "reasoning_effort": "medium"}, False) is True
    # Claude Code via LiteLLM: Anthropic thinking dict
    assert resolve_enable_thinking({"thinking": {"type": "enabled", "budget_tokens": 31999}}, False) is True
