"""The native loop for the host path's weight products (backends/cpu/native_products.py): x @ w.T within
float rounding of a float64 reference for every tail of the blocking, a row's result the same
bits alone or in any batch, both threads, nothing built without a compiler, and the host path's
forward with it equal to mlx-lm's within rounding -- replies token for token on the embedded model."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxstack.backends.cpu import host_forward as hf
from mlxstack.backends.cpu import native_products
from tests.test_host_forward import close, host, mlx_forward, needs_blas, ours, tiny_llama

products = native_products.load()
needs_kernel = pytest.mark.skipif(products is None, reason="no C compiler here: the loop is not built")


def _ref(x, w):
    return x.astype(np.float64) @ w.astype(np.float64).T


@needs_kernel
@pytest.mark.parametrize("M", [1, 3, 4, 5, 8, 13, 16, 33, 64, 128])
@pytest.mark.parametrize("N,K", [(1, 16), (7, 5), (64, 576), (130, 77), (576, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_products_match_a_float64_reference(M, N, K, threads):
    bound = native_products.binding(native_products.build(), threads=threads)
    rng = np.random.default_rng(M * 1000 + N + K)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    got = bound(x, w)
    assert got.shape == (M, N) and got.dtype == np.float32
    np.testing.assert_allclose(got, _ref(x, w), rtol=1e-4, atol=1e-4 * np.sqrt(K))


@needs_kernel
def test_a_row_is_the_same_bits_alone_or_batched_on_one_or_two_threads():
    one = native_products.binding(native_products.build(), threads=1)
    two = native_products.binding(native_products.build(), threads=2)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((1536, 576), dtype=np.float32)
    x = rng.standard_normal((16, 576), dtype=np.float32)
    batch = two(x, w)
    for r in range(16):
        assert np.array_equal(one(x[r:r + 1], w)[0], batch[r])
        assert np.array_equal(two(x[r:r + 1], w)[0], batch[r])
    assert np.array_equal(two(x[3:11], w), batch[3:11])             # another grouping of the rows
    assert np.array_equal(two(x[::2], w), batch[::2])                # a strided view is copied, same bits


@needs_kernel
def test_many_calls_back_to_back_and_after_the_helper_slept():
    """The helper thread takes every second half: back-to-back calls (it spins) and calls after a
    pause (it slept) all complete with the right result."""
    import time

    rng = np.random.default_rng(9)
    w = rng.standard_normal((256, 96), dtype=np.float32)
    x = rng.standard_normal((8, 96), dtype=np.float32)
    want = products(x, w)
    for i in range(300):
        assert np.array_equal(products(x, w), want)
        if i % 100 == 0:
            time.sleep(0.01)                                         # past the helper's spin


def test_no_compiler_no_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSTACK_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native_products.build() is None and native_products.load() is None
    assert list(tmp_path.iterdir()) == []
    saved = hf._products
    try:
        assert hf.use_native_products(True) is False and not hf.native_products_on()
    finally:
        hf._products = saved


def test_auto_keeps_the_loop_only_where_it_beats_sgemm(monkeypatch):
    """NATIVE_PRODUCTS=auto: correct is not enough -- the loop is timed against OpenBLAS's sgemm at
    load and dropped where it is slower (a CPU without vector FMA, a starved core). A fake clock that
    the fake products advance makes the verdict exact."""
    now = [0.0]
    clock = lambda: now[0]                                    # noqa: E731

    def costs(seconds):
        def run(x, w):
            now[0] += seconds * x.shape[0] ** 0.5
            return x @ w.T
        return run
    shape = (64, 32)
    wins, ratios = native_products.faster(costs(1.0), costs(2.0), shape=shape, clock=clock)
    assert wins and ratios == pytest.approx({1: 0.5, 8: 0.5})
    wins, ratios = native_products.faster(costs(3.0), costs(2.0), shape=shape, clock=clock)
    assert not wins and ratios == pytest.approx({1: 1.5, 8: 1.5})
    if hf.blas() is None:
        pytest.skip("no preloaded OpenBLAS: the host path is off")
    saved = hf._products
    try:
        monkeypatch.setattr(native_products, "faster", lambda p, r: (False, {1: 1.4, 8: 1.2}))
        assert hf.use_native_products(True, timed=True) is False and not hf.native_products_on()
        monkeypatch.setattr(native_products, "faster", lambda p, r: (True, {1: 0.6, 8: 0.7}))
        assert hf.use_native_products(True, timed=True) is True
        assert hf.use_native_products(True) is True             # NATIVE_PRODUCTS given, not auto: no timing
    finally:
        hf._products = saved


def test_a_wrong_loop_is_refused():
    assert native_products.agrees(lambda x, w: (x @ w.T) * np.float32(1.001)) is False
    # right values, but a row depends on the batch it came in
    assert native_products.agrees(lambda x, w: (x @ w.T) * np.float32(1 + 1e-6 * (x.shape[0] > 1))) is False


@pytest.fixture
def native_on():
    saved = hf._products
    hf._products = products
    yield
    hf._products = saved


@needs_kernel
@needs_blas
def test_host_forward_with_the_loop_matches_mlx_lm(native_on):
    model = tiny_llama(4, tie_word_embeddings=False)
    assert host(model)
    prompt = mx.array([[5, 17, 3, 88, 41, 9]])
    mine, theirs = [KVCache() for _ in range(3)], [KVCache() for _ in range(3)]
    close(ours(model, prompt, mine), mlx_forward(model, prompt, theirs))
    for tok in (12, 60, 2):
        close(ours(model, mx.array([[tok]]), mine), mlx_forward(model, mx.array([[tok]]), theirs))
    rows = mx.array([[3, 9, 4, 6], [8, 1, 2, 3], [70, 71, 72, 73]])
    a, b = [BatchKVCache([1, 0, 2]) for _ in range(3)], [BatchKVCache([1, 0, 2]) for _ in range(3)]
    close(ours(model, rows, a), mlx_forward(model, rows, b))
    close(ours(model, mx.array([[4], [5], [6]]), a), mlx_forward(model, mx.array([[4], [5], [6]]), b))


@pytest.mark.slow
@needs_kernel
@needs_blas
def test_embedded_model_replies_are_the_same_with_the_loop_and_sgemm(embedded_model_path):
    """4 agents decoding together on the embedded model: the same replies with the host path's
    products in the native loop, through OpenBLAS's sgemm, and through mlx-lm's forward."""
    from tests.conftest import build_engine, engine_settings
    from tests.test_batching import run_batched
    from tests.test_engine import job

    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    convos = [[system, {"role": "user", "content": f"Tell me about the number {n}."}] for n in (3, 17, 42, 99)]
    eng = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    model = eng.loaded.model
    assert hf.enabled(model) and hf.native_products_on()       # the CPU backend chose it (NATIVE_PRODUCTS=auto)
    plan = hf._plan_of(model)
    calls = []
    loop = hf._products

    def counted(x, w):
        calls.append(x.shape[0])
        return loop(x, w)

    def replies(tag):
        jobs = [job(m, max_tokens=12, session=f"{tag}{i}")[0] for i, m in enumerate(convos)]
        return [o.text for o in run_batched(eng, jobs, budget=512)[0]]

    try:
        hf._products = counted
        native = replies("native")
        hf._products = None
        sgemm = replies("sgemm")
        hf._set_plan(model, None)
        mlx = replies("mlx")
    finally:
        hf._products = loop
        hf._set_plan(model, plan)
    assert 4 in calls                                            # the 4-row decode steps went through it
    assert native == sgemm == mlx and all(native)
