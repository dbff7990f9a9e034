"""One request's constraint: consumes the tokens it generates, says which tokens may come next.

    row = grammar.new_row(stop_ids={2}, width=logits_width)
    words = row.mask_words()        # int32 bitmask [ceil(width / 32)] for the next token, or None (free)
    row.consume(token)              # after the token is known
    row.finished / row.dead_end     # the grammar is complete / nothing can continue it

States, in order: *dormant* while a stage waits for its trigger text (``mask_words`` is None, or a
fixed mask without the stop tokens when the stage requires the grammar), *engaged* once the last
trigger appeared (llguidance computes the mask), *finished* when the grammar is complete (only the
stop tokens remain), *dead end* when the matcher errs or allows no token (only the stop tokens, so
the reply ends cleanly; ``error`` says why). Nothing here raises on a model's token.

Bit ``i`` of the mask is token id ``i`` (little-endian words, llguidance's layout). Ids at or past
the tokenizer's vocabulary (the logits can be wider) are never allowed. Whenever the grammar allows
end-of-sequence (it is complete), every one of the request's stop tokens is allowed; a stop token
the grammar itself writes (harmony's ``<|call|>``) is allowed only where the grammar has it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

if TYPE_CHECKING:
    from .compiler import CompiledGrammar
    from .grammars import Stage

__all__ = ["RowConstraint", "words_for"]

DORMANT, ENGAGED, FINISHED, DEAD_END = "dormant", "engaged", "finished", "dead_end"


def words_for(width: int) -> int:
    return (int(width) + 31) // 32


def _set_bits(words: np.ndarray, ids: Iterable[int]) -> None:
    for i in ids:
        words[i >> 5] |= np.int32(np.uint32(1 << (i & 31)).view(np.int32))


def _clear_bits(words: np.ndarray, ids: Iterable[int]) -> None:
    for i in ids:
        words[i >> 5] &= np.int32(np.uint32(~(1 << (i & 31)) & 0xFFFFFFFF).view(np.int32))


class RowConstraint:
    def __init__(self, grammar: "CompiledGrammar", stop_ids: Iterable[int], width: int,
                 stages: Iterable["Stage"] | None = None) -> None:
        self.grammar = grammar
        self.tok = grammar.tokenizer
        self.width = int(width)
        self.vocab = min(self.tok.vocab_size, self.width)          # ids that may ever be allowed
        self.nwords = words_for(self.width)
        self.stop_ids = sorted({int(i) for i in stop_ids if 0 <= int(i) < self.vocab})
        self.eos_ids = [i for i in self.tok.eos_tokens if 0 <= i < self.vocab]
        self.stages = list(grammar.stages if stages is None else stages)
        self.matcher = None if self.stages else grammar.new_matcher()
        self.state = DORMANT if self.stages else ENGAGED
        self.error = ""
        self.consumed = 0
        self._tail = b""                       # recent bytes, while dormant
        self._buf = np.zeros((max(self.nwords, words_for(self.tok.vocab_size)),), dtype=np.int32)
        self._valid = self._valid_words()      # ids < vocab
        self._stop_only: np.ndarray | None = None
        self._no_stop: np.ndarray | None = None
        # no reasoning stage before an answer that may start with whitespace: its first token is not
        # whitespace only (the room is for "</think>\n\n"; see GrammarSpec.lead_ws)
        self._trim_lead = grammar.ws_words is not None and not self.stages

    # ------------------------------------------------------------------ state
    @property
    def engaged(self) -> bool:
        return self.state == ENGAGED

    @property
    def finished(self) -> bool:
        return self.state == FINISHED

    @property
    def dead_end(self) -> bool:
        return self.state == DEAD_END

    @property
    def ended(self) -> bool:
        return self.state in (FINISHED, DEAD_END)

    def _die(self, why: str) -> None:
        if not self.ended:
            self.state, self.error = DEAD_END, why

    # ------------------------------------------------------------------ tokens in
    def consume(self, token: int) -> None:
        """Advance past ``token`` (a generated token, or one the engine forced into the prompt)."""
        token = int(token)
        self.consumed += 1
        if self.ended:
            return
        if self.state == DORMANT:
            self._watch(self.tok.decode_bytes([token]))
            return
        if token in self.stop_ids and token not in self.eos_ids:
            token = self.eos_ids[0] if self.eos_ids else token   # our stop set may be wider than llguidance's
        self._trim_lead = False
        if not self.matcher.consume_token(token):
            self._die(self.matcher.get_error().split("\n<state>")[0] or f"token {token} does not fit the grammar")
        elif self.matcher.is_stopped():
            self.state = FINISHED

    def consume_prefix(self, tokens: Iterable[int]) -> None:
        """Tokens the engine wrote for the model at the start of the reply (e.g. ``{``)."""
        for t in tokens:
            self.consume(t)

    def _watch(self, piece: bytes) -> None:
        """Dormant: look for the current stage's trigger in the generated bytes."""
        buf = self._tail + piece
        while self.stages:
            trigger = self.stages[0].trigger.encode("utf-8")
            at = buf.find(trigger)
            if at < 0:
                self._tail = buf[-(len(trigger) - 1):] if len(trigger) > 1 else b""
                return
            buf = buf[at + len(trigger):]
            self.stages.pop(0)
        self._engage(buf)

    def _engage(self, rest: bytes) -> None:
        """The last trigger appeared: the grammar starts, fed what followed it in the same token."""
        self.state, self._tail = ENGAGED, b""
        self.matcher = self.grammar.new_matcher()
        if rest:
            ids = self.tok.tokenize_bytes(rest)
            if not self.matcher.consume_tokens(ids):
                self._die(f"text after the trigger does not fit the grammar: {rest!r}")
        if self.state == ENGAGED and self.matcher.is_stopped():
            self.state = FINISHED

    # ------------------------------------------------------------------ drafts (speculative decoding)
    def fits(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar would take from here, consuming nothing: drafts
        past that are cut before the forward (they could only be rejected). Dormant: the stop
        tokens a required stage forbids end them; ended: none fit."""
        tokens = [int(t) for t in tokens]
        if self.ended or not tokens:
            return 0
        if self.state == DORMANT:
            if self.stages[0].require:
                banned = set(self.stop_ids) | set(self.eos_ids)
                return next((i for i, t in enumerate(tokens) if t in banned), len(tokens))
            return len(tokens)
        if any(t >= self.vocab for t in tokens):
            tokens = tokens[:next(i for i, t in enumerate(tokens) if t >= self.vocab)]
        stops = [i for i, t in enumerate(tokens) if t in self.stop_ids]
        if stops:                       # a stop token ends the reply: verification decides it alone
            tokens = tokens[:stops[0]]
        return int(self.matcher.validate_tokens(tokens)) if tokens else 0

    def forced(self, k: int) -> list[int]:
        """Up to ``k`` tokens of the text the grammar forces next (``{"name": "`` of a schema, a
        tool call's fixed keys): drafts the model is all but bound to accept (verification still
        decides: it may prefer another tokenisation of the same text)."""
        if k <= 0 or self.state != ENGAGED or self._trim_lead:
            return []
        return [int(t) for t in self.matcher.compute_ff_tokens()[:k] if int(t) < self.vocab]

    # ------------------------------------------------------------------ mask out
    def mask_words(self) -> np.ndarray | None:
        """The bitmask for the next token (int32, ``ceil(width / 32)`` words), or None when every
        token is allowed. The array may be reused by the next call: consume it first."""
        fixed = self.fixed_mask()
        if fixed is not False:
            return fixed
        n = words_for(self.tok.vocab_size)
        self.matcher.unsafe_compute_mask_ptr(self._buf.ctypes.data, n * 4)
        return self.finish_mask(self._buf)

    def fixed_mask(self) -> np.ndarray | None | bool:
        """The mask when no matcher work is needed (None: free; an array: dormant-required or
        ended), else False: the matcher computes it (``finish_mask`` then completes it)."""
        if self.state == DORMANT:
            return self._without_stops() if self.stages[0].require else None
        if self.ended:
            return self._stops()
        return False

    def finish_mask(self, raw: np.ndarray) -> np.ndarray:
        """Complete the matcher's mask ``raw`` (llguidance's words, written in place and returned
        cut to ``ceil(width / 32)`` words): ids past the vocabulary off, stop tokens with EOS, and
        the dead-end check."""
        if self.matcher.is_error():
            self._die(self.matcher.get_error().split("\n<state>")[0])
            return self._stops()
        n = words_for(self.tok.vocab_size)
        if len(raw) < self.nwords:
            raw = np.concatenate([raw, np.zeros((self.nwords - len(raw),), dtype=np.int32)])
        raw[n:] = 0                            # words past the tokenizer's vocabulary (wider logits)
        out = raw[:self.nwords]
        out &= self._valid
        if self.matcher.is_accepting():         # the reply may end here: with any stop token
            _set_bits(out, self.stop_ids)
        if self._trim_lead:
            ws = self.grammar.ws_words[:self.nwords]
            trimmed = out.copy()
            trimmed[:len(ws)] &= ~ws
            if trimmed.any():
                out[:] = trimmed
        if not out.any():
            self._die("no token can continue the grammar")
            return self._stops()
        return out

    def _valid_words(self) -> np.ndarray:
        valid = np.zeros((self.nwords,), dtype=np.int32)
        full = self.vocab >> 5
        valid[:full] = -1
        if self.vocab & 31:
            valid[full] = np.uint32((1 << (self.vocab & 31)) - 1).view(np.int32)
        return valid

    def _stops(self) -> np.ndarray:
        if self._stop_only is None:
            self._stop_only = np.zeros((self.nwords,), dtype=np.int32)
            _set_bits(self._stop_only, self.stop_ids or self.eos_ids or [0])
        return self._stop_only

    def _without_stops(self) -> np.ndarray:
        if self._no_stop is None:
            self._no_stop = self._valid.copy()
            _clear_bits(self._no_stop, set(self.stop_ids) | set(self.eos_ids))
        return self._no_stop

    def allowed(self) -> np.ndarray | None:
        """Allowed token ids for the next step (tests and debugging; None = all)."""
        words = self.mask_words()
        if words is None:
            return None
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.width]
        return np.nonzero(bits)[0]
