"""Requests that arrive together with one long common prompt prefill it once: whom a request
follows, and when it may take its leader's KV.

    lead = plan_follow(seq, prefilling, min_tokens)   # (leader, depth) or None, at admission
    if ready(seq): core forks it                      # once the leader's prefill reached depth

Eight sub-agents started at once under the same system prompt all miss the prompt cache (nothing
is stored until a request finishes), so each would prefill the same tokens. Instead the first is
the leader: a follower whose prompt shares at least ``min_tokens`` more with it than the cache
gave it waits, the leader's prefill stops exactly at the shared depth, and the follower takes the
leader's KV of those tokens by reference (engine/core.py ``fork``). Plain-KV models only (a
recurrent state at a depth is not a slice).

A request here is the engine's (engine/request.py): its prompt tokens, checkout depth ``start``,
prefill position ``pos``, ``follows`` and its live cache's ``can_share()`` / ``depth``.
"""
from __future__ import annotations

from typing import Any

from ..cache.lcp import lcp


def plan_follow(seq: Any, prefilling: list[Any], min_tokens: int) -> tuple[Any, int] | None:
    """The request ``seq`` should take its first tokens from, and how many: the one still
    prefilling (and not itself waiting) that shares the most tokens with it, when that is at least
    ``min_tokens`` more than ``seq`` already reused, of the same cache scope; never its last
    prompt token."""
    best: tuple[Any, int] | None = None
    tokens = seq.prep.model_tokens
    for other in prefilling:
        if other is seq or other.follows is not None or other.job.scope != seq.job.scope:
            continue            # a prompt of another cache scope is never shared, however alike
        theirs = other.prep.model_tokens
        n = min(lcp(tokens, theirs), len(tokens) - 1, len(theirs) - 1)
        if n - seq.start >= min_tokens and (best is None or n > best[1]) and _can_reach(other, n):
            best = (other, n)
    return best


def _can_reach(leader: Any, depth: int) -> bool:
    """The leader holds (or, still prefilling towards it, will hold) its first ``depth`` tokens in
    a form every layer can hand out (``LiveCache.can_share``): the same check whether or not it
    has passed ``depth`` -- a prefixed layer's tail is not its whole sequence (LESSONS 63)."""
    at = leader.start if leader.pos < 0 else leader.pos
    return leader.live.can_share() and (at <= depth or leader.live.depth >= depth)


def ready(follower: Any) -> bool:
    leader, depth = follower.follows
    return leader.pos >= depth
