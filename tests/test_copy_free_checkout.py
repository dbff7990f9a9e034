"""Copy-free warm turns: a hit of at least SHARED_PREFIX_MIN_TOKENS reused tokens is checked out as
a PrefixedKVCache holding the stored arrays by reference (cache/kv_ops.py ``checkout(...,
by_reference)``), so the first append writes a short tail instead of copying the whole reuse.
Replies equal a cold run token for token (alone, batched, with speculation's rollbacks, from the
disk tier); the next entry is rooted on the very arrays reused; layouts that cannot (a hybrid
model's recurrent layers, quantised KV, the feature off) keep the plain copy."""
from __future__ import annotations

import pytest
from mlx_lm.models.cache import KVCache

from mlxstack.cache import kv_ops
from mlxstack.cache.prefixed_kv import PrefixedKVCache
from tests.conftest import build_engine, engine_settings
from tests.test_batching import run_batched
from tests.test_engine import job

pytestmark = pytest.mark.slow  # warm turns on the embedded model and tiny kinds, alone, batched and from disk (docs/testing.md#tiers)

SYSTEM = "You are a careful assistant. Answer briefly and repeat code exactly when asked. " * 3
TURNS = ["Explain what a KV cache is.", "Repeat this exactly: def f(x): return x * 2 + 1; def g(y): return y - 3",
         "And why does reuse matter?", "Summarise in one line."]


@pytest.fixture
def checkouts(monkeypatch):
    """The layer types of every hit's checkout, in order."""
    seen: list[set[str]] = []
    real = kv_ops.checkout

    def spy(state, depth=None, quant=None, by_reference=0):
        live = real(state, depth, quant, by_reference)
        seen.append({type(layer).__name__ for layer in live.layers})
        return live

    monkeypatch.setattr("mlxstack.cache.manager.checkout", spy)
    return seen


def conversation(engine, turns=TURNS, session="s"):
    messages = [{"role": "system", "content": SYSTEM}]
    outs = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        out = engine.run(job(list(messages), max_tokens=24, session=session)[0])
        outs.append(out)
        messages.append({"role": "assistant", "content": out.text})
    return outs


def test_a_hit_is_checked_out_by_reference_and_replies_equal_cold(tiny_dense_path, checkouts):
    warm = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=8))
    cold = build_engine(engine_settings(tiny_dense_path, prompt_cache_max_entries_global=0))
    w, c = conversation(warm), conversation(cold)
    assert [o.raw_text for o in w] == [o.raw_text for o in c] and all(o.raw_text for o in w)
    # at least the previous turn's prompt is reused (the tiny model's reply may re-tokenise otherwise)
    assert all(o.cached_tokens >= prev.prompt_tokens - 1 for prev, o in zip(w, w[1:]))
    assert checkouts == [{"PrefixedKVCache"}] * 3                    # every warm turn, every layer
    # the entry a warm turn stores is rooted on the arrays it reused: nothing reused was copied
    held = [payload for _, payload in warm.state.kv.index.held()]
    deepest = max(held, key=lambda p: p.depth)
    assert all(len(layer.arrays) == 4 for layer in deepest.layers)   # (tail k, tail v, root k, root v)


def test_the_first_append_leaves_the_reused_arrays_as_they_are(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=8))
    model = eng.loaded.model
    live = eng.new_cache()
    from mlxstack.runner.generate import feed

    feed(model, live, list(range(100, 140)), 16)
    state = kv_ops.capture(live)
    out = kv_ops.checkout(state, 30, None, by_reference=8)
    assert all(type(layer) is PrefixedKVCache and layer.prefix[0] is s.arrays[0] and layer.offset == 30
               for layer, s in zip(out.layers, state.layers))
    feed(model, out, [7, 8, 9], 16)
    assert all(layer.prefix[0] is s.arrays[0] and layer.prefix[2] == 30 and layer.offset == 33
               and layer.keys.shape[2] == PrefixedKVCache.step for layer, s in zip(out.layers, state.layers))
    plain = kv_ops.checkout(state, 30)                               # the feature off: a plain copy
    assert all(type(layer) is KVCache for layer in plain.layers)
    below = kv_ops.checkout(state, 5, None, by_reference=8)          # a reuse shorter than the minimum
    assert all(type(layer) is KVCache for layer in below.layers)


def test_layouts_that_cannot_keep_the_plain_copy(tiny_hybrid_path, tiny_dense_path, tiny_dense_hd64_path, checkouts):
    hybrid = build_engine(engine_settings(tiny_hybrid_path, shared_prefix_min_tokens=8))
    cold = build_engine(engine_settings(tiny_hybrid_path, prompt_cache_max_entries_global=0))
    assert [o.raw_text for o in conversation(hybrid, TURNS[:3])] == [o.raw_text for o in conversation(cold, TURNS[:3])]
    assert checkouts and all("PrefixedKVCache" not in kinds for kinds in checkouts)
    checkouts.clear()
    quant = build_engine(engine_settings(tiny_dense_hd64_path, shared_prefix_min_tokens=8, kv_bits="8",
                                         quantized_kv_start=0))
    assert quant.state.kv_quant is not None
    conversation(quant, TURNS[:2])
    assert checkouts and all("PrefixedKVCache" not in kinds for kinds in checkouts)
    checkouts.clear()
    off = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=0))
    conversation(off, TURNS[:2])
    assert checkouts == [{"KVCache"}]


def test_by_reference_rows_decode_together_like_alone(embedded_model_path, checkouts):
    """Two sessions whose warm turns were checked out by reference, batched (their rows join a
    slab: the prefix each holds is its own root) with speculation on: the replies of each alone."""
    eng = build_engine(engine_settings(embedded_model_path, shared_prefix_min_tokens=16))
    cold = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    histories = []
    for i, user in enumerate(("Name three colours.", "Name three animals.")):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        out = eng.run(job(list(msgs), max_tokens=12, session=f"b{i}")[0])
        histories.append(msgs + [{"role": "assistant", "content": out.text},
                                 {"role": "user", "content": "Repeat them exactly, twice."}])
    checkouts.clear()
    batched, _ = run_batched(eng, [job(list(h), max_tokens=20, session=f"b{i}")[0] for i, h in enumerate(histories)])
    assert checkouts == [{"PrefixedKVCache"}] * 2
    alone = [cold.run(job(list(h), max_tokens=20, session=f"c{i}")[0]) for i, h in enumerate(histories)]
    assert [o.raw_text for o in batched] == [o.raw_text for o in alone] and all(o.raw_text for o in alone)
    assert all(o.cached_tokens > 0 for o in batched)


def test_a_restart_hit_from_disk_is_checked_out_by_reference(tiny_dense_path, tmp_path, checkouts):
    first = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=8, disk_cache_dir=str(tmp_path),
                                         disk_cache_min_tokens=8))
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    o1 = first.run(job(list(msgs), max_tokens=16, session="d")[0])
    first.state.close()
    follow = msgs + [{"role": "assistant", "content": o1.text}, {"role": "user", "content": TURNS[1]}]
    again = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=8, disk_cache_dir=str(tmp_path),
                                         disk_cache_min_tokens=8))
    checkouts.clear()
    warm = again.run(job(list(follow), max_tokens=16, session="d")[0])
    assert warm.timings["cache_tier"] == "disk" and warm.cached_tokens > 0
    assert checkouts == [{"PrefixedKVCache"}]
    cold = build_engine(engine_settings(tiny_dense_path, prompt_cache_max_entries_global=0))
    cold.run(job(list(msgs), max_tokens=16, session="d")[0])
    assert warm.raw_text == cold.run(job(list(follow), max_tokens=16, session="d")[0]).raw_text


def test_the_load_time_check_runs_a_by_reference_checkout_with_a_tail(tiny_dense_path, monkeypatch):
    """A model that attends the slab's shared prefix but not a copy-free checkout's (here: the
    prefixed layer's prefix hidden from the attention hook) is refused at load: the check feeds a
    by-reference checkout several-token chunks and compares them with a plain copy."""
    from mlxstack.runner.shared_prefix import _check

    eng = build_engine(engine_settings(tiny_dense_path, shared_prefix_min_tokens=8))
    assert _check(eng.runner)
    monkeypatch.setattr(PrefixedKVCache, "shared_prefix", lambda self: None)
    assert not _check(eng.runner)
