"""Post-render cache-key scrubs: atomic, line-scoped, never across a turn boundary."""
from __future__ import annotations

import re

import pytest

from mlxstack.prompt.scrub import (
    BILLING_PLACEHOLDER,
    CCH_PLACEHOLDER,
    REMINDER_PLACEHOLDER,
    TIME_PLACEHOLDER,
    _scrub_cache_key,
    _scrub_reminders,
    scrub_cache_key,
    scrub_cache_key_with_stats,
)

REMINDER = f"<system-reminder>{REMINDER_PLACEHOLDER}</system-reminder>"


def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + "<|im_start|>assistant\n"


def test_plain_text_untouched():
    text = chatml(("system", "You are helpful."), ("user", "What time is it?"))
    assert scrub_cache_key_with_stats(text) == (text, 0)
    assert _scrub_cache_key is scrub_cache_key


def test_claude_code_render_scrubs_everything_volatile():
    turn1 = chatml(
        ("system", "x-anthropic-billing-header: cc_version=2.1.37.a3f; cc_entrypoint=cli; cch=9f3ab;\n"
                   "You are Claude Code, Anthropic's official CLI for Claude."),
        ("user", "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
                 "# currentDate\nToday's date is 2026-03-01.\n</system-reminder>\nfix the bug in main.py"),
    )
    turn2 = turn1.replace("cch=9f3ab;", "cch=0c1d2;").replace("2026-03-01", "2026-03-02")
    assert turn1 != turn2
    s1, n1 = scrub_cache_key_with_stats(turn1)
    s2, n2 = scrub_cache_key_with_stats(turn2)
    assert s1 == s2
    assert n1 == n2 == 2  # billing line (includes its cch) + one reminder
    assert f"x-anthropic-billing-header: {BILLING_PLACEHOLDER}<|im_end|>" not in s1  # line continues
    assert f"x-anthropic-billing-header: {BILLING_PLACEHOLDER}\nYou are Claude Code" in s1
    assert f"{REMINDER}\nfix the bug in main.py<|im_end|>" in s1


def test_cch_outside_billing_line():
    s, n = scrub_cache_key_with_stats("telemetry cch=abc123; rest")
    assert s == f"telemetry cch={CCH_PLACEHOLDER}; rest" and n == 1
    # not hex / no semicolon -> untouched
    assert scrub_cache_key("cch=xyz; cch=abc") == "cch=xyz; cch=abc"


def test_current_time_rest_of_line_only():
    text = chatml(("system", "Current time is 2026-03-01T10:00:00Z (Sunday).\nBe nice."))
    s = scrub_cache_key(text)
    assert f"Current time is {TIME_PLACEHOLDER}\nBe nice.<|im_end|>" in s


def test_line_scrub_stops_at_turn_delimiter_on_same_line():
    text = chatml(("system", "Current time is 10:00"), ("user", "hi"))
    s = scrub_cache_key(text)
    assert f"Current time is {TIME_PLACEHOLDER}<|im_end|>\n<|im_start|>user\nhi<|im_end|>" in s
    billing = "<|start_header_id|>system<|end_header_id|>\n\nx-anthropic-billing-header: cch=ab;<|eot_id|>"
    assert scrub_cache_key(billing).endswith(f"x-anthropic-billing-header: {BILLING_PLACEHOLDER}<|eot_id|>")


def test_multiple_reminders_scrubbed_independently():
    text = chatml(
        ("user", "<system-reminder>a\nb</system-reminder>\nq1"),
        ("assistant", "ok"),
        ("user", "<system-reminder>c</system-reminder> and <system-reminder>d\ne</system-reminder>"),
    )
    s, n = scrub_cache_key_with_stats(text)
    assert n == 3
    assert s.count(REMINDER) == 3
    assert "q1" in s and "ok" in s and " and " in s


def test_unterminated_reminder_never_swallows_next_turn():
    text = chatml(
        ("user", "<system-reminder>\nunterminated reminder"),
        ("assistant", "answer"),
        ("user", "later </system-reminder> text"),
    )
    s, n = scrub_cache_key_with_stats(text)
    assert (s, n) == (text, 0)


def test_reminder_never_crosses_another_open_tag():
    text = chatml(("user", "<system-reminder>broken\n<system-reminder>inner</system-reminder>\ntail"))
    s, n = scrub_cache_key_with_stats(text)
    assert n == 1
    assert s.startswith("<|im_start|>user\n<system-reminder>broken\n" + REMINDER + "\ntail")


@pytest.mark.parametrize(
    "delimiter",
    ["<|im_end|>", "<|im_start|>", "<|eot_id|>", "<|end|>", "<｜User｜>", "<end_of_turn>", "<start_of_turn>",
     "[INST]", "[/INST]", "</s>"],
)
def test_reminder_never_crosses_any_turn_delimiter(delimiter):
    text = f"<system-reminder>start{delimiter}next turn</system-reminder>"
    assert scrub_cache_key(text) == text


def test_a_scrub_never_crosses_a_section_boundary():
    """Every scrub only changes text inside the turn it started in."""
    turns = [
        ("system", "x-anthropic-billing-header: cc_version=1; cch=ff;\nCurrent time is noon"),
        ("user", "<system-reminder>\nctx\n"),  # unterminated
        ("assistant", "Current time is"),
        ("user", "</system-reminder> cch=12;"),
    ]
    text = chatml(*turns)
    scrubbed = scrub_cache_key(text)
    parts = re.split(r"(<\|im_start\|>|<\|im_end\|>)", text)
    # Scrubbing the whole render equals scrubbing each section on its own: nothing crosses.
    assert scrubbed == "".join(scrub_cache_key(p) for p in parts)
    assert "user\n<system-reminder>\nctx\n<|im_end|>" in scrubbed  # unterminated reminder kept
    assert f"cch={CCH_PLACEHOLDER};" in scrubbed and f"Current time is {TIME_PLACEHOLDER}" in scrubbed


def test_idempotent():
    text = chatml(("system", "x-anthropic-billing-header: cch=1;\nCurrent time is 9"),
                  ("user", "<system-reminder>r</system-reminder> cch=abc;"))
    once = scrub_cache_key(text)
    assert scrub_cache_key(once) == once


def test_speed_on_large_prompt():
    import time
    body = ("line of ordinary prompt text with code `x = y[0]` and <tags>\n" * 2000)
    text = chatml(("system", body), ("user", "<system-reminder>" + body + "</system-reminder> question"))
    t0 = time.perf_counter()
    s, n = scrub_cache_key_with_stats(text)
    ms = (time.perf_counter() - t0) * 1000
    print(f"scrub {len(text)} chars: {ms:.2f} ms")
    assert n == 1 and ms < 500


def _reference_reminder_scrub(text: str) -> str:
    """The documented semantics as one tempered, non-greedy regex (slow but obviously right)."""
    from mlxstack.prompt.scrub import TURN_DELIMITER

    open_, close = "<system-reminder>", "</system-reminder>"
    pattern = re.compile(
        re.escape(open_) + r"(?:(?!" + re.escape(open_) + "|" + TURN_DELIMITER + r")[\s\S])*?" + re.escape(close)
    )
    return pattern.sub(REMINDER, text)


def test_reminder_scrub_matches_reference_regex_on_random_texts():
    import random

    pieces = ["<system-reminder>", "</system-reminder>", "<|im_end|>\n", "<|im_start|>user\n", "abc", "\n",
              "x y", "<|eot_id|>", "[INST]", "<", "|", "cch=1f;", "Current time is 5"]
    rng = random.Random(1234)
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert _scrub_reminders(text)[0] == _reference_reminder_scrub(text), text
