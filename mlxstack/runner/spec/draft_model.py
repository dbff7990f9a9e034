"""Drafts from a smaller model of the same tokenizer (``DRAFT_MODEL``), with its own prompt cache.

    draft = DraftModel(model, vocab=49152, cost=0.1, max_entries=8, max_bytes=1 << 30)
    d = draft.drafter(prompt_tokens)      # per request: a ModelDrafter (same verbs as NgramDrafter)
    d.extend(reply_tokens)                 # tokens as they are accepted
    d.propose(4)                           # -> 4 greedy tokens of the draft model
    d.close()                              # the row ended: its draft cache goes back to the store

A row's draft cache holds the tokens the draft model has seen: the request's tokens and the drafts
of the last step. Before drafting, it is cut back to where it agrees with the request's tokens
(drafts the target did not keep go) and fed what it has not seen (the target's own next token,
accepted drafts it had not fed); then the draft model decodes ``k`` tokens greedily, lazily, with
one evaluation for all of them. Greedy drafts are deterministic, so the rejection rule that
verifies prompt-lookup drafts (``Sampler.verify``) is exact for them as well.

The store keeps the caches of rows that ended (least recently used first out, bounded by entries
and bytes): a new request takes the one sharing the longest prefix with its prompt -- its own
session's last turn, or another agent under the same system prompt -- so the draft model
prefills only what is new, as the main model does with the prompt cache.

The draft model sees at most the last ``window`` tokens when it starts (``DRAFT_WINDOW``): the
catch-up runs inside the batch's decode step, so a 30k-token agent prompt must not stall every
row for a draft prefill of 30k tokens. Its cache then starts at ``base`` (RoPE positions are
relative: the drafts are those of the window as a prompt), and a catch-up longer than the window
starts over on the last ``window`` tokens. Copies from far back are prompt lookup's job.
"""
from __future__ import annotations

from itertools import count
from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ...cache.lcp import lcp
from ...prompt.sized_lru import SizedLRU
from ..mlx_stream import generation_stream
from ..kv_bytes import resident_bytes
from ..forward import forward

__all__ = ["DraftModel", "ModelDrafter"]


class DraftModel:
    """A loaded draft model, what one of its draft tokens costs, and the store of its caches."""

    def __init__(self, model: Any, vocab: int, cost: float, step: int = 512, window: int = 0,
                 max_entries: int = 8, max_bytes: int = 1 << 30, name: str = "", counters: Any = None) -> None:
        self.model = model
        self.counters = counters              # the engine's (draft_tokens / draft_fed / draft_reused)
        self.vocab = int(vocab)               # drafts are argmaxes below this (a padded head never wins)
        self.cost = float(cost)               # one draft token, in plain target decode steps (batch of 1)
        self.step = int(step)                 # catch-up chunk (the draft's prefill step)
        self.window = int(window)             # most tokens a catch-up feeds (0: no bound)
        self.name = name
        # entries: (cache, held, base, scope): the cache holds held[base:] (held[:base] is context it
        # skipped), taken again only by a request of the same cache scope
        self.store: SizedLRU[int, tuple[list[Any], list[int], int, str]] = SizedLRU(max_entries, max_bytes)
        self._keys = count()
        self.fed = 0                          # tokens fed to catch up (prompt prefill included)
        self.drafted = 0                      # draft tokens decoded
        self.reused = 0                       # tokens a row found in a stored cache

    def drafter(self, tokens: Sequence[int], scope: str = "") -> "ModelDrafter":
        """A row's drafter over ``tokens`` (its prompt), starting from the stored cache of its cache
        scope that shares the longest prefix with them past its skipped context (taken out of the
        store: a cache has one owner at a time)."""
        tokens = [int(t) for t in tokens]
        best_key, best = None, 0
        for key, (_, held, base, owner_scope) in self.store.items():
            n = lcp(held, tokens) if owner_scope == scope else 0
            if n > base and n - base > best:
                best_key, best = key, n - base
        if best_key is not None:
            cache, held, base, _ = self.store.pop(best_key)
            self._count("reused", min(best, max(0, len(tokens) - 1 - base)))
            return ModelDrafter(self, tokens, cache, held, base, scope)
        return ModelDrafter(self, tokens, make_prompt_cache(self.model), [], 0, scope)

    def _count(self, what: str, n: int) -> None:
        setattr(self, what, getattr(self, what) + n)
        if self.counters is not None:
            self.counters.bump(f"draft_{'tokens' if what == 'drafted' else what}", n)

    def put_back(self, cache: list[Any], held: list[int], base: int, scope: str = "") -> None:
        if len(held) > base:
            self.store.put(next(self._keys), (cache, held, base, scope), resident_bytes([cache]))


class ModelDrafter:
    """One request's drafts from the draft model (``extend`` / ``plan`` / ``propose`` /
    ``close``: the verbs of ``NgramDrafter``)."""

    __slots__ = ("owner", "tokens", "cache", "held", "base", "closed", "scope")

    def __init__(self, owner: DraftModel, tokens: list[int], cache: list[Any], held: list[int], base: int,
                 scope: str = "") -> None:
        self.owner = owner
        self.tokens = tokens        # the request's tokens: prompt, then the reply as it is accepted
        self.cache = cache          # the draft model's cache: it holds held[base:] ...
        self.held = held            # ... (may end in drafts not kept; held[:base] was skipped)
        self.base = base
        self.scope = scope
        self.closed = False

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def plan(self, k: int) -> tuple[int, float]:
        """(drafts ``propose(k)`` would return, cost of one in plain decode steps), without running
        the model: it always has ``k``."""
        return (max(0, k) if self.tokens else 0), self.owner.cost

    def _sync(self) -> int:
        """Cut the cache back to its agreement with ``tokens`` (keeping at least one token to feed),
        or start it over on the last ``window`` tokens (no agreement past its skipped context, a
        catch-up longer than the window, a cache that cannot be cut); return where feeding starts."""
        n = len(self.tokens)
        keep = min(lcp(self.held, self.tokens), n - 1)
        window = self.owner.window
        fresh = bool(self.held) and keep <= self.base or window > 0 and n - max(keep, self.base) > window
        extra = len(self.held) - keep
        if not fresh and extra > 0:
            fresh = not (can_trim_prompt_cache(self.cache) and trim_prompt_cache(self.cache, extra) == extra)
            if not fresh:
                del self.held[keep:]
        if fresh:
            self.base = max(0, n - window) if window > 0 else 0
            self.cache, self.held = make_prompt_cache(self.owner.model), self.tokens[:self.base]
        return max(len(self.held), self.base)

    def propose(self, k: int) -> list[int]:
        """``k`` greedy tokens of the draft model after the request's tokens."""
        if k <= 0 or not self.tokens:
            return []
        owner, model = self.owner, self.owner.model
        start = self._sync()
        with mx.stream(generation_stream()):
            pos = start
            while len(self.tokens) - pos > owner.step:          # a long catch-up: chunks, evaluated
                forward(model, mx.array([self.tokens[pos:pos + owner.step]], dtype=mx.int32), self.cache)
                mx.eval([v for layer in self.cache for _, v in tree_flatten(layer.state)])
                pos += owner.step
            x = mx.array([self.tokens[pos:]], dtype=mx.int32)
            drafts = []
            for j in range(k):
                logits = forward(model, x, self.cache)[:, -1, : owner.vocab]
                tok = mx.argmax(logits, axis=-1).astype(mx.int32)
                drafts.append(tok)
                if j + 1 < k:
                    x = tok[None]
            out = mx.concatenate(drafts).tolist()
        owner._count("fed", len(self.tokens) - start)
        owner._count("drafted", k)
        self.held = self.tokens[:] + out[:-1]
        return [int(t) for t in out]

    def close(self) -> None:
        """The request ended: its cache goes back to the store for the next turn."""
        if not self.closed:
            self.closed = True
            self.owner.put_back(self.cache, self.held, self.base, self.scope)
