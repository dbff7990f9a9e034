"""Incremental tokenisation: an agent resends the same history every turn, so tokenise it once.

HF tokenizers split the input on added tokens (``<|im_start|>``, ``<|im_end|>``, ``<think>`` …)
before normalising and pre-tokenising each piece on its own. Encoding each piece separately and
concatenating therefore gives the same ids as encoding the whole text -- and every piece that
did not change since the last turn (whole messages, in practice) comes from an LRU cache.

That equivalence depends on the tokenizer (added tokens with lstrip/rstrip, normalizers), so it
is *checked*, not assumed: the first requests and then every ``verify_every``-th one are also
encoded the plain way; one mismatch turns the fast path off for good (logged).

    enc = SegmentedEncoder(tokenizer)
    ids = enc.encode(text)      # == tokenizer.encode(text, add_special_tokens=False)
"""
from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)


def _inner(tokenizer: Any) -> Any:
    return getattr(tokenizer, "_tokenizer", tokenizer)


class SegmentedEncoder:
    def __init__(self, tokenizer: Any, max_pieces: int = 8192, verify_first: int = 8, verify_every: int = 64,
                 max_bytes: int = 64 * 1024 * 1024, max_piece_chars: int = 256 * 1024) -> None:
        self.tokenizer = tokenizer
        inner = _inner(tokenizer)
        added = dict(inner.get_added_vocab()) if hasattr(inner, "get_added_vocab") else {}
        self.added_ids = {tok: int(i) for tok, i in added.items() if tok}
        self.pattern = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(self.added_ids, key=len, reverse=True)) + ")")
            if self.added_ids else None
        )
        self.max_pieces = max_pieces
        self.max_bytes = max_bytes
        self.max_piece_chars = max_piece_chars   # longer pieces are encoded, never cached
        self._bytes = 0
        self.verify_first = verify_first
        self.verify_every = verify_every
        self._pieces: "OrderedDict[str, list[int]]" = OrderedDict()
        self._lock = threading.Lock()
        self.calls = 0
        self.enabled = self.pattern is not None
        self.piece_hits = 0

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _piece(self, text: str) -> list[int]:
        with self._lock:
            ids = self._pieces.get(text)
            if ids is not None:
                self._pieces.move_to_end(text)
                self.piece_hits += 1
                return ids
        ids = self._plain(text)
        if len(text) > self.max_piece_chars:
            return ids
        with self._lock:
            if text not in self._pieces:
                self._pieces[text] = ids
                self._bytes += self._cost(text, ids)
            while len(self._pieces) > self.max_pieces or self._bytes > self.max_bytes:
                old, old_ids = self._pieces.popitem(last=False)
                self._bytes -= self._cost(old, old_ids)
        return ids

    @staticmethod
    def _cost(text: str, ids: list[int]) -> int:
        return 4 * len(text) + 8 * len(ids)   # UCS-4 worst case + int64 ids: a bound, not an estimate

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _segmented(self, text: str) -> list[int]:
        out: list[int] = []
        for part in self.pattern.split(text):
            if not part:
                continue
            special = self.added_ids.get(part)
            if special is not None:
                out.append(special)
            else:
                out.extend(self._piece(part))
        return out

    def encode(self, text: str) -> list[int]:
        if not self.enabled:
            return self._plain(text)
        self.calls += 1
        ids = self._segmented(text)
        if self.calls <= self.verify_first or self.calls % self.verify_every == 0:
            plain = self._plain(text)
            if plain != ids:
                self.enabled = False
                log.warning("segmented tokenisation differs from plain encode for this tokenizer; "
                            "using plain encode from now on")
                return plain
        return ids


_ENCODERS: dict[int, tuple[Any, SegmentedEncoder]] = {}


def encoder_for(tokenizer: Any) -> SegmentedEncoder:
    held = _ENCODERS.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        held = (tokenizer, SegmentedEncoder(tokenizer))
        _ENCODERS[id(tokenizer)] = held
    return held[1]
