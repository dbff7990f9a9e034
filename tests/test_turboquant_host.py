"""TurboQuant's host coder (backends/cpu/turboquant_host.py): decode-sized calls coded in numpy by
the same rule as MLX's graph, decoded vectors exactly what the codes give back, prefill-sized calls
left to MLX; installed by the CPU backend with the host path and taken out by MLX's; through the
engine a batch of rows coded on the host replies as each request alone."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxstack.backends.cpu.turboquant_host import HostCoder
from mlxstack.cache import turboquant as tq


@pytest.mark.parametrize("bits", tq.BITS)
@pytest.mark.parametrize("shape", [(8, 3, 1, 64), (1, 3, 5, 64), (2, 2, 16, 128)])
def test_the_host_coder_keeps_the_rule_and_decodes_exactly(bits, shape):
    rng = np.random.default_rng(bits * 7 + shape[2])
    k = mx.array((rng.standard_normal(shape) * rng.uniform(0.1, 9, (1, 1, 1, shape[3]))).astype(np.float32))
    v = mx.array(rng.standard_normal(shape).astype(np.float32))
    book = tq.scheme(bits, shape[3], tq.SEED)
    coder = HostCoder()
    got = coder(book, k, v)
    assert coder.calls == 1
    for x, (codes, f, out) in zip((k, v), got):
        assert codes.dtype == mx.uint8 and codes.shape == x.shape and f.shape == (*x.shape[:-1], 1)
        # what a stored entry gives back: bit for bit the vectors the live cache attended
        assert mx.array_equal(book.decode(book.pack(codes), f), out).item()
        want_codes, want_f, _ = book.code_unpacked(x)
        same = np.asarray(codes) == np.asarray(want_codes)
        assert same.mean() > 0.999                       # a coordinate on a boundary may round the other way
        assert np.abs(np.asarray(codes).astype(int) - np.asarray(want_codes).astype(int)).max() <= 1
        np.testing.assert_allclose(np.asarray(f), np.asarray(want_f), rtol=1e-5)


def test_prefill_sized_and_other_dtypes_are_left_to_mlx():
    book, coder = tq.scheme(4, 64, tq.SEED), HostCoder()
    long = mx.zeros((1, 3, 17, 64))
    assert coder(book, long, long) is None
    half = mx.zeros((1, 3, 1, 64), dtype=mx.float16)
    assert coder(book, half, half) is None and coder.calls == 0


def test_the_coder_goes_through_code_pair_only_while_installed():
    book, coder = tq.scheme(3, 64, tq.SEED), HostCoder()
    k = mx.array(np.random.default_rng(1).standard_normal((4, 2, 1, 64)).astype(np.float32))
    try:
        tq.use_coder(coder)
        book.code_pair(k, k)
        book.code_pair(mx.zeros((1, 2, 40, 64)), mx.zeros((1, 2, 40, 64)))      # MLX's
        assert coder.calls == 1
    finally:
        tq.use_coder(None)
    book.code_pair(k, k)
    assert coder.calls == 1


def test_host_coded_rows_batched_reply_as_each_request_alone(embedded_model_path):
    """The embedded model (a float32 Llama: the host path) with KV_QUANT_SCHEME=turboquant: the CPU
    backend reports the host coder, four requests decoded together reply as each alone, and a warm
    turn on one of them equals a cold run."""
    from mlx_lm.models import llama

    from mlxstack.runner.forward import backend_of
    from tests.conftest import build_engine, engine_settings
    from tests.test_batching import run_batched
    from tests.test_engine import job

    def engine(cache=True):
        extra = {} if cache else {"prompt_cache_max_entries_global": 0}
        return build_engine(engine_settings(embedded_model_path, kv_bits="4", kv_quant_scheme="turboquant",
                                            quantized_kv_start=0, **extra))

    eng = engine()
    backend = backend_of(eng.loaded.model)
    if type(eng.loaded.model) is not llama.Model or not backend.report.features.get("host_forward", "").startswith("on"):
        pytest.skip(f"no host path here: {backend.report.line()}")
    assert backend.report.features["turboquant_coder"] == "on (KV_QUANT_SCHEME=turboquant: decode-sized calls in numpy)"
    coder = tq._coder
    assert isinstance(coder, HostCoder)
    prompts = [[{"role": "user", "content": f"Name {i + 2} {topic}."}] for i, topic in enumerate(["rivers", "teas", "maps", "birds"])]
    outs, sizes = run_batched(eng, [job(p, max_tokens=12, session=f"h{i}")[0] for i, p in enumerate(prompts)])
    assert max(sizes) == 4 and coder.calls > 0
    alone = engine(cache=False)
    refs = [alone.run(job(p, max_tokens=12, session=f"r{i}")[0]) for i, p in enumerate(prompts)]
    assert [o.raw_text for o in outs] == [r.raw_text for r in refs]
    follow = prompts[0] + [{"role": "assistant", "content": outs[0].text}, {"role": "user", "content": "More."}]
    warm = eng.run(job(follow, max_tokens=10, session="h0")[0])
    cold = alone.run(job(follow, max_tokens=10, session="c0")[0])
    assert warm.cached_tokens > 0 and warm.raw_text == cold.raw_text
