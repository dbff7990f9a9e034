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
hold the prefix once (engine/batch_cache.py), and the entries they store share it
(``KVKind.capture_rooted``). Plain-KV models only (a recurrent state at a depth is not a slice).
The follower's KV is exactly what its own prefill would compute from those tokens (the same
model, the same tokens, causal attention), the way any prompt-cache hit is.
"""
from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache

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
    """The leader still holds (or will hold) exactly its first ``depth`` tokens in plain KV."""
    at = leader.start if leader.pos < 0 else leader.pos
    return at <= depth or all(type(layer) is KVCache or type(layer) is PrefixedKVCache and layer.n_prefix >= depth
                              for layer in leader.live.layers)


def ready(follower: Sequence) -> bool:
    leader, depth = follower.follows
    return leader.pos >= depth


def fork(follower: Sequence, quant: Any) -> None:
    """Give ``follower`` its leader's first ``depth`` tokens (references), as both's root."""
    leader, depth = follower.follows
    roots, layers = [], []
    for i, layer in enumerate(leader.live.layers):
        held = leader.live.roots[i]
        if held is not None and held[2] >= depth:      # every follower shares the same objects
            rk, rv = held[0], held[1]
        else:
            rk, rv = layer.keys[..., :depth, :], layer.values[..., :depth, :]
            leader.live.roots[i] = (rk, rv, depth)
            if type(layer) is KVCache and layer.offset == depth:
                # the leader goes on with the prefix by reference too: its next append writes a
                # tail, instead of copying its whole buffer away from the followers' view of it
                leader.live.layers[i] = PrefixedKVCache((rk, rv, depth))
        roots.append((rk, rv, depth))
        layers.append(PrefixedKVCache((rk, rv, depth)))
    follower.live = LiveCache(layers, depth, quant, roots)
    follower.shared_prefill = depth - follower.start
    follower.start = depth
    follower.pos = depth
    follower.follows = None
