"""Token sampling with per-request state: its own PRNG key, penalties, bias, logprobs.

Every request owns a ``Sampler``. It never touches MLX's global random state (a failure inside
a sampler cannot poison later requests, and concurrent sequences keep independent streams).
The draw for the reply's n-th token uses a key of its own, a function of the request's seed (or
8 bytes of ``os.urandom`` when there is none) and n alone: the token is
``argmax(filtered logits / T + Gumbel noise(key_n))`` (the Gumbel-max form of the categorical
draw). So the token at a position depends only on the logits there and the position, never on how
many draws came before in some other order: a speculative step verifies a sampled row exactly as a
greedy one -- it computes the token plain decoding would draw at each drafted position and keeps
the drafts up to the first that differs (``targets`` / ``skip``). The reply is token for token the
one plain decoding gives with the same seed, with or without speculation, and a draft is kept
with probability p(draft), as the rejection rule would keep it.

    s = Sampler(params, history=prompt_tokens, vocab_size=V)
    tok = s.sample(logits)        # lazy mx scalar; nothing is evaluated here
    s.accept(tok)                 # penalty window / counts see the token (still lazy)

Order of operations on the logits (float32, shape [V]): logit_bias -> repetition penalty ->
presence/frequency penalties -> grammar mask -> (logprobs are read here) -> greedy argmax when
temperature is 0, else top-k -> min-p -> top-p -> temperature -> categorical draw.

A request with ``params.grammar`` (a constraints.CompiledGrammar: JSON schema, tool calls) gets
its own ``RowConstraint`` (``self.constraint``). The mask for token n+1 depends on token n, which
decode loops still hold as a lazy array when they build step n+1 (the forward of token n, then
``sample``). So ``accept`` only queues the token, and ``sample`` first starts the forward
(``mx.async_eval(logits)``), then reads the queued token (already computed by the previous step),
advances the grammar and computes the mask while that forward runs: the mask stays off the critical
path as long as it is cheaper than a forward. Rows without a grammar never read a token early.
When the grammar is complete, or can no longer continue (``constraint.dead_end``), only the stop
tokens are allowed: the reply ends cleanly, never with an exception in the batch.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from ..constraints.masking import apply_mask

NEG_INF = -math.inf


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 256
    repetition_scope: str = "reply"   # the penalty's window: the reply's tokens, or "all" (prompt too)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int = 256
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Any = None        # constraints.CompiledGrammar: the reply must match it (None: free)


_MASK64 = 2**64 - 1


def request_seed(seed: int | None) -> int:
    """The request's stream: its seed (0 <= seed < 2**64), else 8 bytes from the OS."""
    return (int.from_bytes(os.urandom(8), "little") if seed is None else seed) & _MASK64


def position_key(seed: int, position: int) -> mx.array:
    """The PRNG key of the draw for the reply's ``position``-th token (splitmix64 of the seed and
    the position: neighbouring positions and seeds get unrelated keys)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return mx.random.key(z ^ (z >> 31))


@dataclass(slots=True)
class TokenLogprobs:
    """Lazy arrays for one sampled token (read after the token itself is read)."""
    logprob: mx.array
    top_ids: mx.array | None
    top_logprobs: mx.array | None


class Sampler:
    def __init__(self, params: SamplingParams, history: Sequence[int], vocab_size: int,
                 constraint: Any = None) -> None:
        """``constraint``: a RowConstraint to use; by default one from ``params.grammar``."""
        self.p = params
        self.vocab = int(vocab_size)
        self.seed = request_seed(params.seed)
        self.position = 0          # the reply's tokens drawn so far: the next draw's key
        self.greedy = params.temperature <= 0
        ctx = max(1, int(params.repetition_context_size))
        self.ctx = ctx
        self.rep = params.repetition_penalty if params.repetition_penalty and params.repetition_penalty != 1.0 else None
        seen = list(history[-ctx:]) if params.repetition_scope == "all" else []
        self.window = mx.array(seen, dtype=mx.int32) if self.rep is not None else None
        self.counting = bool(params.presence_penalty or params.frequency_penalty)
        self.counts = mx.zeros((self.vocab,), dtype=mx.float32) if self.counting else None
        self.bias = None
        if params.logit_bias:
            ids = mx.array(list(params.logit_bias.keys()), dtype=mx.int32)
            vals = mx.array(list(params.logit_bias.values()), dtype=mx.float32)
            self.bias = mx.zeros((self.vocab,), dtype=mx.float32).at[ids].add(vals)
        self.top_k = int(params.top_k) if 0 < int(params.top_k) < self.vocab else 0
        # One entry per sampled token, in order (decode runs a step ahead of its reader).
        self.logprobs: list[TokenLogprobs] = []
        if constraint is None and params.grammar is not None:
            constraint = params.grammar.new_row(params.stop_token_ids, self.vocab)
        self.constraint = constraint
        self._unread: list[mx.array] = []      # accepted tokens the constraint has not seen yet

    # ------------------------------------------------------------------ logits processing
    def _process(self, logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32).reshape(-1)[: self.vocab]
        if self.bias is not None:
            logits = logits + self.bias
        if self.rep is not None and self.window is not None and self.window.size:
            picked = logits[self.window]
            # Scatter-assign (duplicates in the window write the same value once, as mlx-lm does).
            logits[self.window] = mx.where(picked < 0, picked * self.rep, picked / self.rep)
        if self.counts is not None:
            logits = logits - self.p.frequency_penalty * self.counts - self.p.presence_penalty * (self.counts > 0)
        return logits

    def _logprobs(self, logits: mx.array) -> mx.array:
        """Processed, masked and normalised log-probabilities (what logprobs report)."""
        logits = self._process(logits)
        if self.constraint is not None:
            logits = self._constrain(logits)
        return logits - mx.logsumexp(logits, keepdims=True)

    def sample(self, logits: mx.array) -> mx.array:
        """The next token for ``logits`` (lazy int32 scalar)."""
        self.position += 1
        if self.greedy and not self.p.logprobs:
            # the argmax of the processed (and masked) logits: normalising them first subtracts one
            # number from every entry -- ~50k exps a row for nothing when no logprob is reported
            logits = self._process(logits)
            if self.constraint is not None:
                logits = self._constrain(logits)
            return mx.argmax(logits).astype(mx.int32)
        logprobs = self._logprobs(logits)
        if self.greedy:
            tok = mx.argmax(logprobs).astype(mx.int32)
        else:
            tok = self._draw(logprobs, self.position - 1)
        if self.p.logprobs:
            self._record_logprobs(logprobs, tok)
        return tok

    def _record_logprobs(self, logprobs: mx.array, tok: mx.array) -> None:
        top_ids = top_vals = None
        if self.p.top_logprobs > 0:
            k = min(self.p.top_logprobs, self.vocab)
            top_ids = mx.argpartition(-logprobs, kth=k - 1)[:k]
            top_vals = logprobs[top_ids]
            order = mx.argsort(-top_vals)
            top_ids, top_vals = top_ids[order], top_vals[order]
        self.logprobs.append(TokenLogprobs(logprobs[tok], top_ids, top_vals))

    def _draw(self, logprobs: mx.array, position: int) -> mx.array:
        noise = mx.random.gumbel(logprobs.shape, key=position_key(self.seed, position))
        return mx.argmax(self._filtered(logprobs) + noise).astype(mx.int32)

    def targets(self, logits: mx.array) -> mx.array:
        """The tokens plain decoding would produce at each of ``logits``' positions ([n, V], n >= 1),
        given that every earlier position produced the token fed after it (lazy int32 [n]): what a
        speculative step compares its drafts with, in one evaluation. Only for a row without
        per-position state (no repetition / frequency penalty window, grammar or logprobs: those
        go position by position through ``sample``). Draws nothing: ``skip`` the tokens kept."""
        proc = logits[:, : self.vocab].astype(mx.float32)
        if self.bias is not None:
            proc = proc + self.bias
        if self.greedy:
            return mx.argmax(proc, axis=-1).astype(mx.int32)
        return mx.stack([self._draw(row - mx.logsumexp(row, keepdims=True), self.position + j)
                         for j, row in enumerate(proc)])

    def skip(self, n: int) -> None:
        """``n`` tokens of ``targets`` were kept: the next draw is the reply's next position."""
        self.position += n

    def _filtered(self, logprobs: mx.array) -> mx.array:
        """The logits the draw samples from: top-k, min-p, top-p, then temperature."""
        masked = logprobs
        if self.top_k:
            kth = mx.sort(logprobs)[-self.top_k]
            masked = mx.where(masked < kth, NEG_INF, masked)
        if self.p.min_p > 0:
            threshold = mx.max(masked) + math.log(self.p.min_p)
            masked = mx.where(masked < threshold, NEG_INF, masked)
        if 0 < self.p.top_p < 1:
            order = mx.argsort(-masked)
            sorted_lp = masked[order]
            probs = mx.exp(sorted_lp - mx.logsumexp(sorted_lp))
            before = mx.cumsum(probs) - probs          # mass strictly above each token
            keep_sorted = before < self.p.top_p        # always keeps the most likely token
            masked = mx.where(keep_sorted[mx.argsort(order)], masked, NEG_INF)
        return masked * (1.0 / self.p.temperature)

    def accept(self, tok: mx.array) -> None:
        """Let the penalties see ``tok`` (lazy: the next step can be built before it is read)."""
        t = tok.reshape(-1).astype(mx.int32)
        if self.window is not None:
            self.window = mx.concatenate([self.window, t])[-self.ctx:]
        if self.counts is not None:
            self.counts = self.counts.at[t].add(1.0)
        if self.constraint is not None:
            self._unread.append(t)

    # ------------------------------------------------------------------ grammar
    def caught_up(self) -> Any:
        """The constraint, past every accepted token (they are consumed lazily, at the next mask):
        what drafts are checked against. None without a grammar."""
        if self.constraint is not None and self._unread:
            for t in self._unread:
                for tid in t.tolist():
                    self.constraint.consume(tid)
            self._unread.clear()
        return self.constraint

    def _constrain(self, logits: mx.array) -> mx.array:
        """Advance the constraint past the accepted tokens, then mask ``logits``."""
        if self._unread:
            mx.async_eval(logits)            # the forward runs while we read the token and mask
            self.caught_up()
        return apply_mask(logits, self.constraint.mask_words())
