"""Admission by memory: may a started request take a row now, or must it wait for KV bytes?

The row count (MAX_CONCURRENT_SEQUENCES) is a ceiling; the KV byte budget decides below it. The
engine core measures (the KV held in flight, the model's bytes per token); this module only adds.
"""
from __future__ import annotations


def need_bytes(per_token: int, per_seq: int, uncached: int, growth: int) -> int:
    """KV bytes a request adds while in flight: its uncached prompt and up to ``growth`` generated
    tokens at ``per_token`` bytes each, plus its fixed ``per_seq`` part (the reused prefix is held
    by reference: a rooted checkout, the slab's shared prefix)."""
    return per_token * (uncached + growth) + per_seq


def committed_bytes(held: int, per_token: int, ahead_tokens: int) -> int:
    """KV held in flight (measured) plus what the requests in flight will still add."""
    return held + per_token * ahead_tokens


def applies(budget: int, others_in_flight: bool, replicated: bool) -> bool:
    """Whether admission by memory decides at all: not without a budget, not with several ranks
    (their live bytes differ and they must decide alike), not for a request alone (it always
    runs)."""
    return bool(budget) and not replicated and others_in_flight


def room(budget: int, committed: int, need: int) -> int:
    """Bytes the budget leaves once the request is in flight beside the others (negative: it
    would pass the budget)."""
    return budget - committed - need
