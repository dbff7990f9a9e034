"""Requests that arrive together with one long common prompt prefill it once.

    lead = plan_follow(seq, prefilling, min_tokens)   # (leader, depth) or None, at admission
    fork(follower, leader, depth)                      # once the leader's prefill reached depth

Eight sub-agents started at once under the same system prompt all miss the prompt cache (nothing
is stored until a request finishes), so each would prefill the same tokens. Instead the first is
the leader: a follower whose prompt shares at least ``min_tokens`` more with it than the cache
gave it waits, the leader's prefill stops exactly at the shared depth, and the follower takes the
leader's KV of those tokens by reference (MLX arrays are values: the leader's next append copies
its buffer once, the follower's first append copies nothing of the prefix -- it is its root).
Both record the shared arrays as their root (``LiveCache.roots``): in the decode batch the rows
hold the prefix once (cache/slab.py), and the entries they store share it
(``KVKind.capture_rooted``). Plain-KV models only (a recurrent state at a depth is not a slice).
The follower's KV is exactly what its own prefill would compute from those tokens (the same
model, the same tokens, causal attention), the way any prompt-cache hit is.
"""
from __future__ import annotations

from typing import Any

from ..cache.kv_ops import LiveCache
from ..cache.lcp import lcp
from ..cache.prefixed_kv import PrefixedKVCache
from .request import Sequence


def plan_follow(seq: Sequence, prefilling: list[Sequence], min_tokens: int) -> tuple[Sequence, int] | None:
    """The request ``seq`` should take its first tokens from, and how many: the one still
    prefilling (and not itself waiting) that shares the most tokens with it, when that is at least
    ``min_tokens`` more than ``seq`` already reused; never its last prompt token."""
    best: tuple[Sequence, int] | None = None
    tokens = seq.prep.model_tokens
    for other in prefilling:
        if other is seq or other.follows is not None:
            continue
        theirs = other.prep.model_tokens
        n = min(lcp(tokens, theirs), len(tokens) - 1, len(theirs) - 1)
        if n - seq.start >= min_tokens and (best is None or n > best[1]) and _can_reach(other, n):
            best = (other, n)
    return best


def _can_reach(leader: Sequence, depth: int) -> bool:
    """The leader holds (or, still prefilling towards it, will hold) its first ``depth`` tokens in
    a form every layer can hand out (``LiveCache.can_share``): the same check whether or not it
    has passed ``depth`` -- a prefixed layer's tail is not its whole sequence (LESSONS 63)."""
    at = leader.start if leader.pos < 0 else leader.pos
    return leader.live.can_share() and (at <= depth or leader.live.depth >= depth)


def ready(follower: Sequence) -> bool:
    leader, depth = follower.follows
    return leader.pos >= depth


def fork(follower: Sequence, quant: Any) -> None:
    """Give ``follower`` its leader's first ``depth`` tokens (references), as both's root."""
    leader, depth = follower.follows
    roots = leader.live.share(depth)
    follower.live = LiveCache([PrefixedKVCache(r) for r in roots], depth, quant, list(roots))
    follower.shared_prefill = depth - follower.start
    follower.start = depth
    follower.pos = depth
    follower.follows = None
