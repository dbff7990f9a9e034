"""Post-render scrubs of the canonical prompt text (the cache key only; never the model input).

Usage:
    key_text = scrub_cache_key(canonical_rendered_text)
    key_text, n = scrub_cache_key_with_stats(canonical_rendered_text)

Each scrub is atomic and section-scoped, in this order:

1. ``<system-reminder>…</system-reminder>`` -> ``<system-reminder>__SCRUBBED_SYSTEM_REMINDER__</system-reminder>``.
   The only scrub that may span lines (Claude Code reminders are multi-line). The body is
   matched non-greedily and may contain neither another ``<system-reminder>`` open tag nor a
   chat-template turn delimiter (see ``TURN_DELIMITER``). An unterminated reminder, or one whose
   close tag lies in a later turn, is left untouched: scrubbing too little costs a cache miss,
   scrubbing across a turn would hide a real difference from the key.
2. ``x-anthropic-billing-header: …`` -> ``x-anthropic-billing-header: __SCRUBBED_BILLING_HEADER__``
   (rest of that line).
3. ``cch=<hex>;`` -> ``cch=__SCRUBBED_CCH__;`` anywhere else.
4. ``Current time is …`` -> ``Current time is __SCRUBBED_TIME__`` (rest of that line).

"Rest of the line" always stops at a newline *and* at the first turn delimiter on that line:
templates such as ChatML put ``<|im_end|>`` right after the content on the same line, and a
scrub must never eat it. No pattern uses ``re.DOTALL``.
"""
from __future__ import annotations

import re

REMINDER_PLACEHOLDER = "__SCRUBBED_SYSTEM_REMINDER__"
BILLING_PLACEHOLDER = "__SCRUBBED_BILLING_HEADER__"
CCH_PLACEHOLDER = "__SCRUBBED_CCH__"
TIME_PLACEHOLDER = "__SCRUBBED_TIME__"

# Chat-template turn/segment delimiters: ChatML / Llama-3 / harmony / Phi (`<|…|>`), DeepSeek
# (`<｜…｜>`, full-width bars), Gemma (`<start_of_turn>`/`<end_of_turn>`), Mistral/Llama-2
# (`[INST]`, `[/INST]`, `</s>`), GLM (`<|user|>` etc. are covered by the first form).
TURN_DELIMITER = (
    r"<\|[^|\n]{1,40}\|>"
    r"|<｜[^｜\n]{1,40}｜>"
    r"|<(?:start|end)_of_turn>"
    r"|\[/?INST\]"
    r"|</s>"
)

_REMINDER_OPEN = "<system-reminder>"
_REMINDER_CLOSE = "</system-reminder>"

# What a reminder body may not contain: another open tag or a turn delimiter.
_REMINDER_BARRIER_RE = re.compile(re.escape(_REMINDER_OPEN) + "|" + TURN_DELIMITER)
_REMINDER_REPLACEMENT = f"{_REMINDER_OPEN}{REMINDER_PLACEHOLDER}{_REMINDER_CLOSE}"
# One "rest of line" character: not a newline and not the start of a turn delimiter.
_LINE_CHAR = r"(?:(?!" + TURN_DELIMITER + r")[^\n])"
_BILLING_RE = re.compile(r"x-anthropic-billing-header:" + _LINE_CHAR + "*")
_CCH_RE = re.compile(r"\bcch=[0-9A-Fa-f]+;")
_TIME_RE = re.compile(r"Current time is" + _LINE_CHAR + "*")

# (pattern, replacement, literal that must occur for the pattern to match: a cheap pre-check)
_LINE_SCRUBS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (_BILLING_RE, f"x-anthropic-billing-header: {BILLING_PLACEHOLDER}", "x-anthropic-billing-header:"),
    (_CCH_RE, f"cch={CCH_PLACEHOLDER};", "cch="),
    (_TIME_RE, f"Current time is {TIME_PLACEHOLDER}", "Current time is"),
)


def _scrub_reminders(text: str) -> tuple[str, int]:
    """Replace each ``<system-reminder>`` … first following ``</system-reminder>`` whose body holds
    no barrier (another open tag, a turn delimiter). Same result as the non-greedy tempered regex
    ``OPEN (?:(?!OPEN|DELIM)[\\s\\S])*? CLOSE``, without its per-character cost on long reminders."""
    out: list[str] = []
    emitted = scan = count = 0
    close = -1
    open_len = len(_REMINDER_OPEN)
    while True:
        start = text.find(_REMINDER_OPEN, scan)
        if start < 0:
            break
        if close < start + open_len:  # reuse the last close while it is still ahead (no O(n^2))
            close = text.find(_REMINDER_CLOSE, start + open_len)
            if close < 0:
                break
        barrier = _REMINDER_BARRIER_RE.search(text, start + open_len, close)
        if barrier is not None:
            scan = barrier.start()  # this open tag is unterminated within its section
            continue
        out.append(text[emitted:start])
        out.append(_REMINDER_REPLACEMENT)
        emitted = scan = close + len(_REMINDER_CLOSE)
        count += 1
    if not count:
        return text, 0
    out.append(text[emitted:])
    return "".join(out), count


def scrub_cache_key_with_stats(text: str) -> tuple[str, int]:
    """Scrub volatile non-structural text from a canonical render.

    Args:
        text: the canonical prompt as rendered by the chat template.

    Returns:
        (scrubbed text, number of replacements made). A replacement whose output equals its
        input (already-scrubbed text) still counts; scrubbing is idempotent.
    """
    text, total = _scrub_reminders(text) if _REMINDER_CLOSE in text else (text, 0)
    for pattern, replacement, literal in _LINE_SCRUBS:
        if literal not in text:  # most prompts contain none of these markers
            continue
        text, n = pattern.subn(replacement, text)
        total += n
    return text, total


def scrub_cache_key(text: str) -> str:
    """``scrub_cache_key_with_stats(text)[0]``."""
    return scrub_cache_key_with_stats(text)[0]


_scrub_cache_key = scrub_cache_key

__all__ = [
    "scrub_cache_key",
    "scrub_cache_key_with_stats",
    "_scrub_cache_key",
    "TURN_DELIMITER",
    "REMINDER_PLACEHOLDER",
    "BILLING_PLACEHOLDER",
    "CCH_PLACEHOLDER",
    "TIME_PLACEHOLDER",
]
