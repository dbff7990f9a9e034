"""TurboQuant's host coder (backends/cpu/turboquant_host.py): decode-sized calls coded natively (or in
numpy) by the same rule as MLX's graph, decoded vectors exactly what the codes give back, prefill-sized calls
left to MLX; installed by the CPU backend with the host path and taken out by MLX's; through the
engine a batch of rows coded on the host replies as each request alone."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxstack.backends.cpu import native_build, turboquant_host
from mlxstack.backends.cpu.turboquant_host import HostCoder
from mlxstack.cache import turboquant as tq


@pytest.fixture(scope="module")
def native():
    """The native coder (built with the other kernels, checked against MLX's at load), or a skip."""
    code = turboquant_host.load()
    if code is None:
        pytest.skip(f"no native coder here: {native_build.problem(turboquant_host.NATIVE)}")
    return code


@pytest.mark.parametrize("form", ["native", "numpy"])
@pytest.mark.parametrize("bits", tq.BITS)
@pytest.mark.parametrize("shape", [(8, 3, 1, 64), (1, 3, 5, 64), (2, 2, 16, 128), (3, 1, 2, 96)])
def test_the_host_coder_keeps_the_rule_and_decodes_exactly(request, form, bits, shape):
    rng = np.random.default_rng(bits * 7 + shape[2])
    k = mx.array((rng.standard_normal(shape) * rng.uniform(0.1, 9, (1, 1, 1, shape[3]))).astype(np.float32))
    v = mx.array(rng.standard_normal(shape).astype(np.float32))
    book = tq.scheme(bits, shape[3], tq.SEED)
    coder = HostCoder(request.getfixturevalue("native") if form == "native" else None)
    assert coder.form == form
    got = coder(book, k, v)
    assert coder.calls == 1
    for x, (packed, f, out) in zip((k, v), got):
        assert packed.dtype == mx.uint8 and packed.shape == (*x.shape[:-1], x.shape[-1] * bits // 8)
        assert f.shape == (*x.shape[:-1], 1) and out.shape == x.shape
        # what a stored entry gives back: bit for bit the vectors the live cache attended
        assert mx.array_equal(book.decode(packed, f), out).item()
        want_packed, want_f, _ = book.code(x)
        codes, want = np.asarray(book.unpack(packed)).astype(int), np.asarray(book.unpack(want_packed)).astype(int)
        assert (codes == want).mean() > 0.999              # a coordinate on a boundary may round the other way
        assert np.abs(codes - want).max() <= 1
        np.testing.assert_allclose(np.asarray(f), np.asarray(want_f), rtol=1e-5)


def test_the_native_coder_and_numpy_give_the_same_codes(native):
    """The two host forms on one input: the same codes (sums in another order may move f and the
    decoded vectors by a rounding, never a code here)."""
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((8, 3, 1, 64)).astype(np.float32))
    book = tq.scheme(3, 64, tq.SEED)
    a, b = HostCoder(native)(book, x, x), HostCoder(None)(book, x, x)
    assert all(mx.array_equal(p[0], q[0]).item() for p, q in zip(a, b))
    assert all(np.allclose(np.asarray(p[1]), np.asarray(q[1]), rtol=1e-6) for p, q in zip(a, b))


def test_a_native_coder_that_disagrees_is_not_used():
    """The load check refuses a coder whose decoded vectors are not what its codes decode to, and
    one whose codes are off: the numpy form codes instead."""
    def shifted(t, k, v):
        packed, f, out = turboquant_host.numpy_code(t, k, v)
        return packed, f, out + np.float32(1e-3)

    def wrong_codes(t, k, v):
        packed, f, out = turboquant_host.numpy_code(t, k, v)
        return packed ^ np.uint8(1), f, out

    assert turboquant_host.agrees(turboquant_host.numpy_code)
    assert not turboquant_host.agrees(shifted) and not turboquant_host.agrees(wrong_codes)


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
    coder = tq._coder
    assert isinstance(coder, HostCoder)
    said = backend.report.features["turboquant_coder"]
    if turboquant_host.load() is not None:          # a compiler here: the native call
        assert coder.form == "native" and said == "on (KV_QUANT_SCHEME=turboquant: decode-sized calls native)"
    else:
        assert coder.form == "numpy" and said.startswith("on (KV_QUANT_SCHEME=turboquant: decode-sized calls in numpy; ")
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
