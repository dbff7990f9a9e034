"""KV_QUANT_SCHEME=turboquant through the batched paths a plain-KV model has: short prefills fed in
one right-padded forward (runner/batch_prefill.py) and turns closed together, each row coded from
exactly QUANTIZED_KV_START -- inside that forward when it crosses the start -- so every request
replies, and stores, what it does alone (cache/turboquant_rows.py)."""
from __future__ import annotations

import pytest
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxstack.cache import turboquant as tq
from mlxstack.runner import prefill as prefill_module
from mlxstack.cache.kv_ops import LiveCache
from mlxstack.cache.layer_kinds import KVQuant
from tests.test_batching import run_batched
from tests.test_engine import job
from tests.test_turboquant import tq_engine

PROMPTS = [[{"role": "user", "content": f"list {i} things about {topic}" + " please" * (3 * i)}]
           for i, topic in enumerate(["rivers", "rust", "tea", "maps"])]


def _coded(eng, start: int) -> set[int]:
    """The full-precision heads of every stored entry deeper than ``start`` (each must be coded)."""
    heads = set()
    for e in eng.state.kv.index.entries():
        layer = e.payload.layers[0]
        if e.depth > start:
            assert layer.kind == "turboquant", (e.depth, layer.kind)
            heads.add(dict(layer.params)["fp_head"])
        else:
            assert layer.kind == "kv", (e.depth, layer.kind)
    return heads


@pytest.mark.parametrize("start", [0, 23])
def test_turboquant_prompts_prefill_and_close_together_as_each_alone(tiny_dense_hd64_path, start):
    """Four cold prompts (19 to 28 tokens; with start 23 two cross it inside the batched forward,
    one stays below) prefill in one forward, decode together, close together: each reply equals a
    lone cold run's, every stored entry is coded from exactly the start, and a warm turn equals cold."""
    eng = tq_engine(tiny_dense_hd64_path, "4", start)
    jobs = [job(p, max_tokens=10, session=f"tq{i}")[0] for i, p in enumerate(PROMPTS)]
    outs, sizes = run_batched(eng, jobs, budget=128)
    sched = run_batched.sched
    assert sched.group.prefills_together
    assert sched.short_batches >= 1 and max(sizes) == 4
    alone = tq_engine(tiny_dense_hd64_path, "4", start, cache=False)
    refs = [alone.run(job(p, max_tokens=10, session=f"r{i}")[0]) for i, p in enumerate(PROMPTS)]
    assert [o.raw_text for o in outs] == [r.raw_text for r in refs]
    lengths = [o.prompt_tokens for o in outs]
    if start:
        assert min(lengths) < start < max(lengths)           # the start falls inside some prompts
    assert _coded(eng, start) == {start}
    follow = PROMPTS[2] + [{"role": "assistant", "content": outs[2].text}, {"role": "user", "content": "more"}]
    warm = eng.run(job(follow, max_tokens=10, session="tq2")[0])
    cold = alone.run(job(follow, max_tokens=10, session="c2")[0])
    assert warm.cached_tokens > start and warm.raw_text == cold.raw_text


def test_a_batched_row_never_drafts_across_the_start():
    """A slab row below QUANTIZED_KV_START verifies at most up to it (the lone rule, ``LiveCache.room``):
    so the next forward codes from exactly the start, batched or alone."""
    from types import SimpleNamespace

    from mlxstack.runner.spec.speculation import _row_limit

    quant = KVQuant(4, 64, 30, "turboquant", tq.SEED)
    group = SimpleNamespace(slab=[object()])
    row = lambda depth: SimpleNamespace(params=SimpleNamespace(max_tokens=100), produced=0,  # noqa: E731
                                        live=LiveCache([KVCache()], depth, quant))
    assert [_row_limit(group, row(d), 8) for d in (20, 25, 29, 30, 31)] == [8, 4, 0, 8, 8]
    lone = row(25)
    group.slab = None
    assert _row_limit(group, lone, 8) == 4 == lone.live.room() - 1


@pytest.mark.parametrize("start", [0, 100, "tail", 1000])
def test_turboquant_requests_arriving_together_prefill_the_common_prompt_once(tiny_dense_hd64_path, start,
                                                                              monkeypatch):
    """Three requests under one long system prompt: the first prefills it, the others take a copy
    of its KV (floats and codes: cache/manager.py fork) and its roots, so the decode slab holds the
    common floats once for all three (each row its own codes) -- with the start at 0, inside the
    shared prompt, in the followers' own remainders ("tail") and past the prompts -- and each reply
    equals a lone cold run's; every stored entry past the start is coded from exactly it. The
    leader's prefill is not cut at the shared depth (LESSONS 78): its chunks, and so its codes, are
    the ones it computes with nobody following."""
    from tests.test_shared_prefix import _messages, _run

    if start == "tail":
        probe = tq_engine(tiny_dense_hd64_path, "4", 0, cache=False)
        start = probe.run(job(_messages(1), max_tokens=1, session="p")[0]).prompt_tokens - 5
    eng = tq_engine(tiny_dense_hd64_path, "4", start)
    jobs = [job(_messages(i), max_tokens=8, session=f"s{i}")[0] for i in range(3)]
    cuts = []
    real_feed = prefill_module.feed   # the one prefill path (runner/prefill.py)

    def feed(model, live, tokens, step, *a, **k):
        cuts.append((live.depth, len(tokens)))
        return real_feed(model, live, tokens, step, *a, **k)

    monkeypatch.setattr(prefill_module, "feed", feed)
    outs, sched, shares = _run(eng, jobs)
    fed_with_followers, cuts[:] = list(cuts), []
    lone, _, _ = _run(tq_engine(tiny_dense_hd64_path, "4", start), jobs[:1])
    fed_alone = list(cuts)
    assert fed_alone and fed_with_followers, "the prefill did not go through runner/prefill.py feed"
    assert sched.group.min_shared == 256 and max(shares) == 3           # every row held the prefix once
    assert sched.shared_prefills == 2
    shared = eng.state.counters.snapshot()["shared_prefill_tokens"]
    n = outs[0].prompt_tokens
    assert [o.cached_tokens for o in outs[1:]] == [shared // 2] * 2 and n - 20 <= shared // 2 < n
    assert start != 100 or 0 < start < shared // 2                      # the start inside the shared prompt
    # the leader's prefill: the same chunks as alone (the followers' own rests come after)
    assert fed_with_followers[:len(fed_alone)] == fed_alone and all(d >= shared // 2 for d, _ in
                                                                     fed_with_followers[len(fed_alone):])
    assert lone[0].raw_text == outs[0].raw_text
    alone = tq_engine(tiny_dense_hd64_path, "4", start, cache=False)
    solo = [alone.run(job(_messages(i), max_tokens=8, session=f"a{i}")[0]) for i in range(3)]
    assert [o.raw_text for o in outs] == [o.raw_text for o in solo]
    assert _coded(eng, start) == ({start} if start < n else set())


def codes_of(snap: tuple, row: int) -> list:
    """The arrays of row ``row``'s first (joined) chunk in a RowCodes snapshot."""
    return list(snap[2][row][0][0])


def test_bytes_in_flight_count_a_forwards_codes_once_however_many_rows_hold_them():
    """The gauge's walk (runner/kv_bytes.py) over a coded slab: each array of the rows' codes once --
    a forward's codes are shared by every row's chunk of it, and a short log keeps the walk cheap."""
    import mlx.core as mx
    import numpy as np

    from mlxstack.cache.slab import SlabKVCache
    from mlxstack.cache.turboquant_rows import CONSOLIDATE
    from mlxstack.runner.kv_bytes import resident_arrays

    slab = SlabKVCache.empty(4, KVQuant(4, 64, 0, "turboquant", tq.SEED))
    rng = np.random.default_rng(5)
    for _ in range(CONSOLIDATE + 3):
        k = mx.array(rng.standard_normal((4, 2, 1, 64)).astype(np.float32))
        slab.update_and_fetch(k, k)
    codes = slab.codes
    assert all(len(chunks) == 4 for chunks in codes.log)     # joined once at CONSOLIDATE, three since
    arrays = {id(a): a for chunks in codes.log for chunk in chunks for a in chunk[0]}
    assert len(arrays) == 4 * 4 + 4 * 3                       # each row's joined chunk + three shared forwards
    seen = resident_arrays([slab])
    assert seen[id(codes)] == codes.nbytes == sum(a.nbytes for a in arrays.values())
    assert set(seen) == {id(codes), id(slab.keys), id(slab.values), id(slab.offset), id(slab.left_padding)}
    snap = codes.snapshot()
    slab.rewind(1, 1)                                         # a chunk cut short: the same arrays
    slab.settle([0, 1, 2, 3])
    assert codes.nbytes == sum(a.nbytes for a in arrays.values())
    codes.placed(2, 0)                                        # row 2 leaves: its joined chunk goes
    assert codes.nbytes == sum(a.nbytes for i, a in arrays.items() if all(i != id(x) for x in codes_of(snap, 2)))
    codes.restore(snap)
    assert codes.nbytes == sum(a.nbytes for a in arrays.values())


def test_a_prefix_held_once_under_turboquant_but_not_under_uniform(tiny_dense_hd64_path):
    """Cascade attention is a property of the model's attention over floats: TurboQuant rows attend
    floats (their decoded vectors), so the check passes under it; uniform KV quantisation (mlx-lm's
    quantised layout, no slab) keeps rows whole."""
    from mlxstack.runner.shared_prefix import shared_prefix_ok
    from tests.conftest import build_engine, engine_settings

    assert shared_prefix_ok(tq_engine(tiny_dense_hd64_path, "4", 0))
    assert not shared_prefix_ok(build_engine(engine_settings(tiny_dense_hd64_path, kv_bits="4", quantized_kv_start=0)))


def test_a_coded_row_sharing_the_slab_prefix_leaves_as_one_turboquant_layer(tiny_dense_hd64_path):
    """Two followers' layers on a TurboQuant slab holding their leader's floats once: each row's
    columns are its tail only, and taking a row gives one TurboQuant layer -- the floats whole (the
    prefix in front), the codes of every position from its head -- equal to the layer it joined
    with, floats and codes, after the same step."""
    from mlxstack.cache.slab import SlabKVCache
    from mlxstack.runner.generate import feed

    eng = tq_engine(tiny_dense_hd64_path, "4", 0)
    model = eng.loaded.model
    leader = eng.new_cache()
    feed(model, leader, list(range(100, 140)), 16)
    lives = []
    for tail in ([1, 2, 3], [4, 5, 6, 7, 8]):
        live = eng.state.kv.fork(leader, 40)                          # a copy, with the leader's roots
        assert live.roots[0] is not None and live.roots[0][0] is leader.roots[0][0]
        feed(model, live, tail, 16)
        lives.append(live)
    assert type(leader.layers[0]) is tq.TurboQuantKVCache           # still a coded layer (never prefixed)
    quant = leader.quant
    slab = SlabKVCache.empty(2, quant)
    for r, live in enumerate(lives):
        own = live.layers[0]
        slab.place(r, own.keys, own.values, own.offset, live.roots[0], 16)
        slab.adopt_codes(r, own)
    assert slab.shares == [True, True] and slab.prefix[2] == 40 and slab._idx == 5
    for r, live in enumerate(lives):
        got, own = slab.take(r), live.layers[0]
        assert type(got) is tq.TurboQuantKVCache and got.offset == own.offset and got.fp_head == own.fp_head == 0
        assert mx.array_equal(got.keys[..., :got.offset, :], own.keys[..., :own.offset, :]).item()
        for a, b in zip(got.coded(got.offset), own.coded(own.offset)):
            assert mx.array_equal(a, b).item()


def test_on_a_batch_invariant_backend_every_stored_code_is_a_cold_runs(embedded_model_path):
    """The embedded Llama on the CPU backend (host path, native products and attention): under
    TurboQuant prompts are fed in calls of its exact size, so three requests under one system
    prompt -- the leader's prefill taken by two followers, decoded together in a slab holding the
    common floats once -- store codes equal, byte for byte, to a cold feed of the same tokens, reply
    included (decode-computed positions are prefill-computed ones: LESSONS 79); replies equal lone
    cold runs. Without the exact size the same entries differ from a cold feed in thousands of codes."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxstack.cache.kv_ops import checkout
    from mlxstack.runner.forward import exact_positions
    from mlxstack.runner.generate import feed
    from tests.conftest import build_engine, engine_settings
    from tests.test_shared_prefix import _messages, _run

    kw = dict(kv_bits="3", kv_quant_scheme="turboquant", quantized_kv_start="0", shared_prefix_min_tokens="16")
    eng = build_engine(engine_settings(embedded_model_path, **kw))
    model = eng.loaded.model
    if exact_positions(model, eng.state.kv_quant) is None:
        pytest.skip("no batch-invariant path here (no C compiler: the native kernels are not built)")
    outs, sched, shares = _run(eng, [job(_messages(i), max_tokens=12, session=f"s{i}")[0] for i in range(3)])
    assert sched.shared_prefills == 2 and max(shares) == 3
    entries = eng.state.kv.index.entries()
    assert len(entries) == 3 and all(e.depth > outs[0].prompt_tokens for e in entries)
    for e in entries:
        cold = LiveCache(make_prompt_cache(model), 0, eng.state.kv_quant)
        feed(model, cold, [int(t) for t in e.model_tokens], 512)
        hit = checkout(e.payload, e.depth, eng.state.kv_quant)
        for a, b in zip(hit.layers, cold.layers):
            for x, y in zip(a.coded(e.depth), b.coded(e.depth)):
                assert mx.array_equal(x, y).item(), e.depth
    alone = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0, **kw))
    solo = [alone.run(job(_messages(i), max_tokens=12, session=f"a{i}")[0]) for i in range(3)]
    assert [o.raw_text for o in outs] == [o.raw_text for o in solo]


def test_rows_longer_than_a_batch_invariant_call_are_not_fed_together(embedded_model_path):
    """Turns closed together under TurboQuant on the exact path: rows of at most its size are fed
    together; a longer one is declined with nothing fed (the caller closes each alone, in exact
    calls) -- never fed half, which the caller would take for not fed at all."""
    from mlxstack.runner.batch_prefill import feed_together
    from mlxstack.runner.forward import exact_positions
    from mlxstack.runner.generate import feed
    from tests.conftest import build_engine, engine_settings

    eng = build_engine(engine_settings(embedded_model_path, kv_bits="4", kv_quant_scheme="turboquant",
                                       quantized_kv_start="0"))
    model = eng.loaded.model
    exact = exact_positions(model, eng.state.kv_quant)
    if exact is None:
        pytest.skip("no batch-invariant path here (no C compiler: the native kernels are not built)")
    lives = [eng.state.kv.new() for _ in range(2)]
    for i, lv in enumerate(lives):
        feed(model, lv, list(range(100 + i, 140 + i)), 512)
    assert not feed_together(model, lives, [[7] * (exact + 1), [8, 9]])
    assert [lv.depth for lv in lives] == [40, 40] and all(lv.layers[0].offset == 40 for lv in lives)
    assert feed_together(model, lives, [[7] * exact, [8, 9]])
    assert [lv.depth for lv in lives] == [40 + exact, 42]
