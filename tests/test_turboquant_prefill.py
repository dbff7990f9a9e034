"""KV_QUANT_SCHEME=turboquant through the batched paths a plain-KV model has: short prefills fed in
one right-padded forward (runner/batch_prefill.py) and turns closed together, each row coded from
exactly QUANTIZED_KV_START -- inside that forward when it crosses the start -- so every request
replies, and stores, what it does alone (cache/turboquant_rows.py)."""
from __future__ import annotations

import pytest
from mlx_lm.models.cache import KVCache

from mlxstack.cache import turboquant as tq
from mlxstack.cache.kv_ops import LiveCache
from mlxstack.cache.layer_kinds import KVQuant
from tests.test_batching import run_batched
from tests.test_engine import job
from tests.test_turboquant import tq_engine

PROMPTS = [[{"role": "user", "content": f"list {i} things about {topic}" + " please" * (3 * i)}]
           for i, topic in enumerate(["rivers", "rust", "tea", "maps"])]


def _coded(eng) -> list[tuple[int, int]]:
    """(depth, fp_head) of every stored entry's first layer, in depth order."""
    out = []
    for e in eng.state.prompt_cache.entries():
        layer = e.payload.layers[0]
        assert layer.kind == "turboquant"
        out.append((e.depth, dict(layer.params)["fp_head"]))
    return sorted(out)


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
    heads = {h for d, h in _coded(eng) if d > start}
    assert heads == {start}
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
