"""Parity is the proof of a cache: after a hit, greedy tokens equal a cold prefill of the same
tokens exactly, and next-token logits agree within a tight tolerance. Every match type, on the
dense (all KVCache) and hybrid (ArraysCache + KVCache) fixtures."""
from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxstack.cache.counters import CacheCounters
from mlxstack.cache.hashing import namespace_seed
from mlxstack.cache.kv_ops import LiveCache, capture, checkout, state_fingerprint
from mlxstack.cache.prompt_cache import PromptCache, PromptCacheConfig
from mlxstack.runner.generate import SamplingParams, feed, prefill
from tests.fixtures.reference_decode import decode

N_GEN = 12
ATOL = 1e-4


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def model(request, tiny_dense_path, tiny_hybrid_path):
    path = tiny_dense_path if request.param == "dense" else tiny_hybrid_path
    m, _tok = load(str(path))
    m.kind = request.param
    return m


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40000) for _ in range(n)]


def cold(model, toks: list[int]) -> tuple[mx.array, list[int]]:
    cache = LiveCache(make_prompt_cache(model))
    logits = prefill(model, cache, toks, step=7)
    out = list(decode(model, cache, logits, toks, SamplingParams(temperature=0.0, max_tokens=N_GEN)))
    return logits, out


def warm(model, pc: PromptCache, toks: list[int]) -> tuple[mx.array, list[int], object]:
    match = pc.lookup(toks, toks)
    cache = checkout(match.entry.payload, match.depth) if match.hit else LiveCache(make_prompt_cache(model))
    assert cache.depth == match.depth
    logits = prefill(model, cache, toks[match.depth:], step=5)
    out = list(decode(model, cache, logits, toks, SamplingParams(temperature=0.0, max_tokens=N_GEN)))
    return logits, out, match


def store(model, pc: PromptCache, toks: list[int]):
    cache = LiveCache(make_prompt_cache(model))
    feed(model, cache, toks, step=9)
    state = capture(cache)
    assert state.offset == len(toks)
    return pc.insert(toks, toks, state, nbytes=state.nbytes, floor=state.floor)


def new_cache() -> PromptCache:
    return PromptCache(PromptCacheConfig(block_size=16, max_entries=16), namespace_seed("parity"), CacheCounters())


BASE = tokens(70, 1)
CASES = {
    # name: (stored tokens, request tokens, expected dense match, expected hybrid depth)
    "exact": (BASE, BASE, "exact", 0),
    "prefix": (BASE[:40], BASE, "prefix", 40),
    "supersequence": (BASE + tokens(20, 2), BASE, "supersequence", 0),
    "lcp": (BASE[:50] + tokens(15, 3), BASE, "lcp", 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hit_equals_cold(model, case):
    stored, request, dense_type, hybrid_depth = CASES[case]
    pc = new_cache()
    entry = store(model, pc, stored)
    before = state_fingerprint(entry.payload)
    ref_logits, ref_tokens = cold(model, request)
    logits, out, match = warm(model, pc, request)
    if model.kind == "dense":
        assert match.match_type == dense_type and match.depth > 0
    else:  # hybrid: only exact-depth reuse; anything needing a trim must miss
        assert match.depth == hybrid_depth
        if hybrid_depth == 0:
            assert pc.counters.get("hybrid_trim_miss") >= 1
    assert out == ref_tokens
    assert mx.allclose(logits, ref_logits, atol=ATOL).item()
    assert state_fingerprint(entry.payload) == before, "a hit must never mutate the stored entry"
    assert pc.counters.get("exact_key_rejected_by_model_lcp") == 0


def test_secondary_broad_lookup_parity(model):
    """Primary picks among the deepest canonical candidates; the broad (session) lookup verifies
    shallower ones too and finds the deeper model-token match. Both must be exact."""
    pc = new_cache()
    req = BASE
    # Entry A: canonical key equals the request (deep), model tokens diverge at 5.
    a_model = BASE[:5] + tokens(40, 9)
    cache = LiveCache(make_prompt_cache(model))
    feed(model, cache, a_model, step=16)
    sa = capture(cache)
    pc.insert(BASE[:45], a_model, sa, nbytes=sa.nbytes, floor=sa.floor)
    # Entry B: shares one canonical block only, but 48 model tokens.
    b_key = BASE[:16] + tokens(32, 7)
    cache = LiveCache(make_prompt_cache(model))
    feed(model, cache, BASE[:48], step=16)
    sb = capture(cache)
    eb = pc.insert(b_key, BASE[:48], sb, nbytes=sb.nbytes, floor=sb.floor)
    primary = pc.lookup(req, req)
    broad = pc.lookup(req, req, broad=True)
    assert broad.entry.entry_id == eb.entry_id and broad.depth == 48 > primary.depth
    ref_logits, ref_tokens = cold(model, req)
    work = checkout(broad.entry.payload, broad.depth)
    logits = prefill(model, work, req[broad.depth:])
    out = list(decode(model, work, logits, req, SamplingParams(temperature=0.0, max_tokens=N_GEN)))
    assert out == ref_tokens and mx.allclose(logits, ref_logits, atol=ATOL).item()


def test_capture_checkout_round_trip_and_trim(model):
    cache = LiveCache(make_prompt_cache(model))
    feed(model, cache, BASE, step=32)
    state = capture(cache)
    assert state.offset == len(BASE) and state.nbytes > 0
    again = checkout(state)
    assert again.depth == len(BASE) and [type(c) for c in again.layers] == [type(c) for c in cache.layers]
    again.check()
    if state.trimmable:
        shorter = checkout(state, 10)
        assert shorter.depth == 10
        shorter.check()
    else:
        with pytest.raises(ValueError):
            checkout(state, 10)


def test_a_short_rest_is_fed_with_its_last_token_in_one_forward(model):
    """A warm turn's few new tokens (<= FOLD_MAX) are one forward that also yields the first
    token's logits, not a chunk plus a second forward for the last token: the same greedy reply
    and logits as the two-forward path, on a hit exactly as cold."""
    from mlxstack.runner import generate

    toks = tokens(60, 7)
    calls: list[int] = []

    class Counting:
        def __init__(self, m):
            self.m = m

        def __call__(self, x, cache=None):
            calls.append(int(x.shape[1]))
            return self.m(x, cache=cache)

    base = LiveCache(make_prompt_cache(model))
    feed(model, base, toks[:47], step=16)
    entry = capture(base)
    rest = toks[47:]
    assert 1 < len(rest) <= generate.FOLD_MAX
    folded = checkout(entry)
    logits = prefill(Counting(model), folded, rest, step=16)
    assert calls == [len(rest)] and folded.depth == len(toks)
    two = checkout(entry)
    feed(model, two, rest[:-1], step=16)
    ref = generate.last_logits(model, two, rest[-1])
    assert mx.allclose(logits, ref, atol=ATOL).item()
    assert int(mx.argmax(logits).item()) == int(mx.argmax(ref).item())
    out = list(decode(model, folded, logits, toks, SamplingParams(temperature=0.0, max_tokens=N_GEN)))
    ref_out = list(decode(model, two, ref, toks, SamplingParams(temperature=0.0, max_tokens=N_GEN)))
    assert out == ref_out and len(out) == N_GEN
    # a rest longer than FOLD_MAX keeps the separate forward for its last token
    calls.clear()
    prefill(Counting(model), LiveCache(make_prompt_cache(model)), tokens(generate.FOLD_MAX + 1, 8), step=512)
    assert calls == [generate.FOLD_MAX, 1]
