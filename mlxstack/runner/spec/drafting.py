"""Draft tokens for speculative decoding: prompt lookup, and how many drafts a row should try.

Pure (no MLX, no I/O). A drafter proposes up to ``k`` tokens that plain decoding is likely to
produce next; the target model scores them all in one forward (runner/spec/speculation.py) and keeps
the longest prefix it agrees with, so a wrong draft costs compute, never a different reply.

    d = NgramDrafter(prompt_tokens)        # indexes every n-gram of the prompt
    d.extend(reply_tokens)                 # the reply so far, as tokens are accepted
    d.propose(4)                           # -> up to 4 ids that followed the current suffix before

Prompt lookup (llama.cpp's ``lookup``, vLLM's n-gram proposer): find the most recent earlier
occurrence of the last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) in the prompt and the
reply so far, and propose what followed it -- continued periodically when it reaches the end (a
reply repeating itself). Agents re-emit text they have seen -- a file rewritten
with one change, a patch quoting its context, a path in a tool call -- and those tokens come out of
the lookup. An agent conversation's earlier turns are in its prompt already, so the prompt is the
session's history too.

``DraftControl`` is the per-row switch that keeps speculation from ever costing more than it
saves: the draft length grows while drafts are accepted, stays when some are, and shrinks when
none are; a row whose
drafts keep failing (free text, a high temperature, a grammar that rejects them) stops drafting for
a while that doubles each time it fails again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .step_costs import prior_step_cost

__all__ = ["NgramDrafter", "Chained", "DraftControl", "accepted_prefix", "expected_accepted", "best_width"]


def accepted_prefix(targets: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts the target accepts under greedy decoding: ``targets[j]`` is the model's
    token after the j-th fed position, ``drafts[j]`` the draft fed at position j + 1."""
    n = 0
    for t, d in zip(targets, drafts):
        if t != d:
            break
        n += 1
    return n


def expected_accepted(rate: float, k: int) -> float:
    """Accepted drafts expected from ``k`` drafts when each is accepted with probability ``rate``
    given the ones before it were: rate + rate^2 + ... + rate^k."""
    total, term = 0.0, 1.0
    for _ in range(max(0, k)):
        term *= rate
        total += term
    return total


def best_width(rows: Sequence[tuple], cost: float | Callable[[int], float]) -> int:
    """The forward width (1 + drafts per row) that maximises expected tokens per unit of step
    time for a batch whose rows could draft ``k`` tokens with acceptance ``rate`` each
    (``rows``: one (k, rate) or (k, rate, draft_cost) per row; rows that cannot draft count with
    k = 0). A step of width w costs ``cost(w)`` plain steps (measured: runner/spec/step_costs.py), or,
    with a number, ``1 + cost * B * (w - 1)`` (each extra position one more token per row through
    the model), plus, for a row whose drafts come from a draft model, ``draft_cost`` plain steps
    per draft token. 1 means a plain step is best."""
    b = len(rows)
    if not b:
        return 1
    step_cost = cost if callable(cost) else (lambda w: prior_step_cost(cost, b, w))
    best, best_gain = 1, 1.0
    for w in range(2, max((r[0] for r in rows), default=0) + 2):
        tokens = b + sum(expected_accepted(r[1], min(r[0], w - 1)) for r in rows)
        drafting = sum(r[2] * min(r[0], w - 1) for r in rows if len(r) > 2)
        gain = tokens / b / (step_cost(w) + drafting)
        if gain > best_gain * 1.02:          # a clear win only: a speculative step is not pipelined
            best, best_gain = w, gain
    return best


class NgramDrafter:
    """Prompt-lookup drafts over one request's tokens (prompt + reply so far).

    For each ``n`` the index maps an n-gram to where its continuation starts, for its most recent
    occurrence whose continuation is known (the n-gram ending at the last token is indexed only
    once the next token arrives, so a lookup never finds the suffix itself)."""

    __slots__ = ("tokens", "max_n", "min_n", "_index", "_indexed")

    def __init__(self, tokens: Iterable[int] = (), max_n: int = 4, min_n: int = 2) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.tokens: list[int] = []
        self.max_n, self.min_n = int(max_n), int(min_n)
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self._indexed = 0           # continuations known up to (exclusive) this position
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks = self.tokens
        toks.extend(int(t) for t in tokens)
        # an n-gram ending at position e - 1 is followed by the token at e: index it once e exists
        for e in range(max(self._indexed, 1), len(toks)):
            for n, table in self._index.items():
                if e >= n:
                    table[tuple(toks[e - n:e])] = e
        self._indexed = max(self._indexed, len(toks))

    def plan(self, k: int) -> tuple[int, float]:
        """(drafts ``propose(k)`` would return, cost of one in plain decode steps): a lookup is free."""
        return len(self.propose(k)), 0.0

    def close(self) -> None:
        """Nothing to give back (the verbs every drafter answers)."""

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest recent match of the current suffix. A match
        whose continuation runs into the end of the tokens is a repetition with period ``p`` (the
        distance from the match to the end): the continuation repeats it, so a reply that loops
        on itself -- a repeated line, a list, the same call again -- drafts ``k`` tokens, not the
        ``p`` that are written so far."""
        toks = self.tokens
        if k <= 0 or not toks:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) < n:
                continue
            start = self._index[n].get(tuple(toks[-n:]))
            if start is not None:
                out = toks[start:start + k]
                period = len(toks) - start
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []


class Chained:
    """Drafts from ``first`` when it has any, else from ``then`` (prompt lookup first, the draft
    model where the lookup finds nothing): the same verbs as each of them."""

    __slots__ = ("first", "then")

    def __init__(self, first: "NgramDrafter", then: object) -> None:
        self.first, self.then = first, then

    def __len__(self) -> int:
        return len(self.first)

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        self.first.extend(tokens)
        self.then.extend(tokens)            # type: ignore[attr-defined]

    def plan(self, k: int) -> tuple[int, float]:
        n, cost = self.first.plan(k)
        return (n, cost) if n else self.then.plan(k)     # type: ignore[attr-defined]

    def propose(self, k: int) -> list[int]:
        return self.first.propose(k) or self.then.propose(k)     # type: ignore[attr-defined]

    def close(self) -> None:
        self.first.close()
        self.then.close()                   # type: ignore[attr-defined]


@dataclass(slots=True)
class DraftControl:
    """How many drafts one row tries next (0: none this step), from what its drafts did so far."""
    max_draft: int
    k: int = 0                  # the current draft length (starts at max_draft)
    misses: int = 0             # consecutive steps whose drafts were all rejected
    pause: int = 0              # steps left without drafting
    proposed: int = 0           # totals for this row (request log, metrics)
    accepted: int = 0
    steps: int = 0              # speculative steps this row took part in with drafts
    rate: float = 0.6           # running estimate of the chance that one draft token is accepted

    def __post_init__(self) -> None:
        self.max_draft = max(0, int(self.max_draft))
        self.k = self.max_draft if self.k <= 0 else min(self.k, self.max_draft)

    def budget(self) -> int:
        """Drafts this row may try in the next step (counts down a pause)."""
        if self.max_draft <= 0:
            return 0
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def record(self, proposed: int, accepted: int) -> None:
        """What one step did with this row's drafts."""
        if proposed <= 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        # a drafts accepted out of k: a successes, then one failure unless all were accepted
        tried = accepted + (0 if accepted >= proposed else 1)
        self.rate = 0.7 * self.rate + 0.3 * (accepted / tried)
        if accepted >= proposed:
            self.misses = 0
            self.k = min(self.max_draft, max(self.k, 1) * 2)
        elif accepted == 0:
            self.misses += 1
            self.k = max(1, self.k // 2)
            if self.misses >= 2:            # wrong twice in a row: stop for 4, 8, 16 ... 256 steps
                self.pause = min(256, 2 ** self.misses)
        else:
            # some kept: the length stays. A lookup's next draft comes from a new match (the one
            # the kept tokens and the model's own next token make), not from the one that went
            # wrong here: shrinking to what this one got cost copying a third of its gain
            self.misses = 0
