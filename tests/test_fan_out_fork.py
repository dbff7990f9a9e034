"""A shared prefill's fork takes its leader's first tokens whatever form the leader's layers hold
them in (``LiveCache.share`` over the kinds' ``first`` verb; LESSONS 63): a leader checked out
copy-free (a ``PrefixedKVCache`` whose ``keys`` are only its tail) and a leader an earlier fork
converted both hand out their real first tokens, and a root record is only ever a view of them.
Found by the differential fuzzer (tests/fuzz): four requests extending a stored turn by the same
long message answered with another conversation's KV (500s on the embedded model) and left
poisoned entries behind."""
from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxstack.cache.kv_ops import LiveCache, capture, checkout
from mlxstack.cache.layer_kinds import KINDS
from mlxstack.cache.prefixed_kv import PrefixedKVCache
from mlxstack.cache.slab import SlabKVCache, place_own_layers
from mlxstack.scheduler.shared_prefill import _can_reach
from mlxstack.runner.generate import feed
from tests.conftest import build_engine, engine_settings
from tests.fuzz.traffic import block, fan_out
from tests.test_engine import job
from tests.test_shared_prefix import _run

SYSTEM = "You are a careful assistant. Answer briefly and repeat code exactly when asked. " * 3


@pytest.fixture(scope="module")
def engines(tiny_dense_path):
    warm = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=16))
    cold = build_engine(engine_settings(tiny_dense_path, prompt_cache_max_entries_global=0,
                                        shared_prefix_min_tokens=0, speculative="off"))
    return warm, cold


def _both(warm, cold, msgs, session, n=12):
    """The same request on both engines (the cold one keeps the same healing history)."""
    w = warm.run(job(list(msgs), max_tokens=n, session=session)[0])
    c = cold.run(job(list(msgs), max_tokens=n, session=session)[0])
    return w, c


def test_a_fan_out_over_a_turn_checked_out_by_reference_answers_like_cold(engines):
    warm, cold = engines
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain what a KV cache is."}]
    w1, c1 = _both(warm, cold, msgs, "fan", 16)
    assert w1.raw_text == c1.raw_text
    hist = msgs + [{"role": "assistant", "content": w1.text}]
    branches = fan_out(hist, 3, 12)
    outs, sched, shares = _run(warm, [job(list(b), max_tokens=12, session="fan")[0] for b in branches])
    assert sched.shared_prefills == 3 and max(shares) == 4           # the leader was copy-free; all shared
    assert all(o.cached_tokens >= w1.prompt_tokens - 1 for o in outs)
    alone = [cold.run(job(list(b), max_tokens=12, session="fan")[0]) for b in branches]
    assert [o.raw_text for o in outs] == [o.raw_text for o in alone] and all(o.raw_text for o in alone)
    # what they stored is right: the next turn of one branch, alone, is the cold reply
    nxt = branches[1] + [{"role": "assistant", "content": outs[1].text}, {"role": "user", "content": "And line 5?"}]
    w, c = _both(warm, cold, nxt, "fan")
    assert w.raw_text == c.raw_text and w.cached_tokens > outs[1].prompt_tokens // 2


def test_a_deeper_follower_of_a_leader_an_earlier_fork_converted(engines):
    """Three requests, no cache hit: the second shares the system prompt with the first, the third
    shares more. The leader stops at the first depth (the fork converts it to a prefix by reference
    plus a tail) and again at the deeper one, which lies in its tail."""
    warm, cold = engines
    system = {"role": "system", "content": "Sub-agent for the repository. " + block(11, 4)}
    deep = block(12, 6)
    prompts = [[system, {"role": "user", "content": deep + "\nFind the tests."}],
               [system, {"role": "user", "content": "List the modules."}],
               [system, {"role": "user", "content": deep + "\nFind the docs."}]]
    outs, sched, _ = _run(warm, [job(list(p), max_tokens=10, session=f"d{i}")[0] for i, p in enumerate(prompts)])
    assert sched.shared_prefills == 2
    assert outs[2].cached_tokens > outs[1].cached_tokens > 16        # two depths, the second past the first
    alone = [cold.run(job(list(p), max_tokens=10, session=f"d{i}")[0]) for i, p in enumerate(prompts)]
    assert [o.raw_text for o in outs] == [o.raw_text for o in alone]


def _copy_free(engine, stored: int, depth: int, tail: list[int]):
    """A stored state of ``stored`` tokens and a copy-free checkout of its first ``depth`` (the
    prefix by reference) fed ``tail``: (state, live)."""
    base = engine.new_cache()
    feed(engine.loaded.model, base, list(range(100, 100 + stored)), 16)
    state = capture(base)
    live = checkout(state, depth, None, by_reference=8)
    feed(engine.loaded.model, live, tail, 16)
    return state, live


def test_first_tokens_of_every_plain_kv_form(engines):
    state, ref = _copy_free(engines[0], 40, 30, [7, 8, 9, 10, 11])  # a prefix of 30 by reference + 5
    kinds = KINDS["prefixed"], KINDS["kv"]
    for layer, s in zip(ref.layers, state.layers):
        rk, rv, n = kinds[0].first(layer, 20)
        assert rk is s.arrays[0] and rv is s.arrays[1] and n == 20   # within the prefix: the same objects
        k, v, n = kinds[0].first(layer, 33)                          # past it: prefix + tail joined
        assert n == 33 and k.shape[2] == 33
        assert mx.array_equal(k[..., :30, :], s.arrays[0][..., :30, :]).item()
        assert mx.array_equal(k[..., 30:, :], layer.keys[..., :3, :]).item()
        assert mx.array_equal(v[..., 30:, :], layer.values[..., :3, :]).item()
        assert kinds[0].first(layer, 36) is None                     # more than it holds
    plain = checkout(state, 40)
    k, _, n = kinds[1].first(plain.layers[0], 33)
    assert n == 33 and mx.array_equal(k, state.layers[0].arrays[0][..., :33, :]).item()
    assert KINDS["quantized"].first(QuantizedKVCache(), 10) is None  # (packed, scales, biases): never a root


def test_share_records_the_same_root_for_every_follower_and_converts_a_leader_at_that_depth(engines):
    _, live = _copy_free(engines[0], 40, 30, [7, 8, 9])              # a copy-free leader at 33
    first = live.share(33)
    again = live.share(33)
    assert all(a[0] is b[0] and a[2] == 33 for a, b in zip(first, again))      # one root for all
    assert all(type(layer) is PrefixedKVCache and layer.prefix[0] is r[0] and layer.offset == 33
               for layer, r in zip(live.layers, first))
    shallow = live.share(12)                                          # covered by the recorded root
    assert all(s[0] is r[0] and s[2] == 12 for s, r in zip(shallow, first))
    with pytest.raises(ValueError):
        live.share(34)


def test_a_leader_is_followed_only_when_every_layer_can_hand_out_its_prefix():
    kv, quant = KVCache(), QuantizedKVCache()
    follower_of = lambda layers, pos, depth: _can_reach(  # noqa: E731
        SimpleNamespace(start=0, pos=pos, live=LiveCache(layers, max(pos, 0))), depth)
    assert follower_of([kv, kv], -1, 40)                              # will prefill to 40 in plain KV
    assert not follower_of([kv, quant], -1, 40)                       # not yet at the depth: still checked
    assert not follower_of([kv, quant], 50, 40)
    assert follower_of([kv, kv], 30, 40) and follower_of([kv, kv], 50, 40)


def test_a_prefixed_row_keeps_its_prefix_only_where_the_slab_may_share_it(engines):
    _, own = _copy_free(engines[0], 20, 20, [5, 6])
    for min_shared, shares in ((None, False), (64, False), (8, True)):
        slab = [SlabKVCache.empty(2) for _ in own.layers]
        place_own_layers(slab, 0, own.layers, own.roots, min_shared)
        assert all(bool(s.shares[0]) is shares and (s.prefix is not None) is shares for s in slab), min_shared
        assert all(s.row_view(0)[2] == (2 if shares else 22) for s in slab)   # a tail, or the whole row
