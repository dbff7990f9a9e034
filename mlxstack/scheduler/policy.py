"""Pure choices the scheduler makes each step: whose prefill chunk runs, which short prompts
share one forward, and how many generated tokens a request in flight is counted for."""
from __future__ import annotations

GROWTH = 256   # generated tokens a request in flight is counted for beyond what it holds (admission)


def growth(max_tokens: int, produced: int) -> int:
    """Generated tokens a request may still add while in flight, at most ``GROWTH``."""
    return max(0, min(GROWTH, max_tokens - produced))


def remaining(prompt_tokens: int, start: int, pos: int) -> int:
    """Prompt tokens a request still has to feed: from its checkout depth ``start`` before its
    first chunk (``pos`` < 0), from ``pos`` after."""
    return prompt_tokens - (start if pos < 0 else pos)


def next_round_robin(count: int, last: int) -> int:
    """Index of the next member after ``last`` in a round of ``count`` (0 when none yet)."""
    return 0 if count <= 0 else (last + 1) % count


def shortest_fitting(remainders: list[int], budget: int) -> int | None:
    """Index of the smallest remainder that one chunk finishes, when a longer one also waits
    (None when every remainder fits -- round-robin serves them -- or none does)."""
    fits = [i for i, n in enumerate(remainders) if 0 < n <= budget]
    if not fits or len(fits) == len(remainders):
        return None
    return min(fits, key=lambda i: remainders[i])


def choose_short(lengths: list[int], budget: int) -> list[int]:
    """Indices (in order) of the waiting prompts to prefill together: each remainder at least 1
    token, and the padded batch (members x longest remainder) within ``budget`` tokens."""
    chosen: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if n < 1:
            continue
        if (len(chosen) + 1) * max(longest, n) <= budget:
            chosen.append(i)
            longest = max(longest, n)
    return chosen
