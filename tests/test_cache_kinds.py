"""Every cache kind through the same verbs (cache/layer_kinds.py, cache/kv_ops.py), proved by
parity on a tiny real model per kind: capture -> checkout -> continue gives the greedy tokens of
a cold prefill exactly and next-token logits within 1e-4; the serialisable form round-trips; an
entry is only ever served at depths its layers can serve (``floor``).

Kinds: dense (KVCache), quantized (QuantizedKVCache), gemma3 (RotatingKVCache + KVCache),
gpt_oss (RotatingKVCache + KVCache, attention sinks), llama4 (ChunkedKVCache + KVCache), mamba2
(ArraysCache only), lfm2 (conv ArraysCache + KVCache), hybrid (gated-delta ArraysCache + KVCache).
"""
from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxstack.cache.kv_ops import LiveCache, capture, checkout, dump_state, load_state, state_fingerprint
from mlxstack.cache.layer_kinds import KINDS, class_from_key, kind_of, probe_layout
from mlxstack.runner.generate import SamplingParams, feed, prefill
from tests.fixtures.reference_decode import decode

N_GEN = 10
ATOL = 1e-4
WINDOW = 32  # fixtures' sliding window and attention chunk

LAYOUTS = {
    "dense": ("kv", "kv"),
    "gemma3": ("rotating", "kv", "rotating", "kv"),
    "gpt_oss": ("rotating", "kv", "rotating", "kv"),
    "llama4": ("chunked", "chunked", "chunked", "kv"),
    "mamba2": ("arrays", "arrays"),
    "lfm2": ("arrays", "kv", "arrays", "kv"),
    "hybrid": ("arrays", "kv", "arrays", "kv"),
}


@pytest.fixture(scope="module")
def models(tiny_kind_paths):
    cache: dict[str, object] = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = load(str(tiny_kind_paths(kind)))[0]
        return cache[kind]

    return get


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 40000) for _ in range(n)]


def live(model) -> LiveCache:
    return LiveCache(make_prompt_cache(model))


def run(model, cache: LiveCache, rest: list[int], history: list[int], step: int) -> tuple[mx.array, list[int]]:
    logits = prefill(model, cache, rest, step=step)
    out = list(decode(model, cache, logits, history, SamplingParams(temperature=0.0, max_tokens=N_GEN)))
    return logits, out


def cold(model, prompt: list[int]) -> tuple[mx.array, list[int]]:
    return run(model, live(model), prompt, prompt, step=11)


def same(a: tuple[mx.array, list[int]], b: tuple[mx.array, list[int]]) -> bool:
    return a[1] == b[1] and mx.allclose(a[0], b[0], atol=ATOL).item()


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_layout_probe_names_every_layer(models, kind):
    layout = probe_layout(make_prompt_cache(models(kind)))
    assert layout.kinds == LAYOUTS[kind] and layout.supported
    assert layout.always_trimmable is (kind == "dense")


# ---------------------------------------------------------------------------- capture -> checkout
@pytest.mark.parametrize("kind", list(LAYOUTS))
@pytest.mark.parametrize("n", [20, 150])  # inside the window / far past it (rotated, chunk-trimmed)
def test_capture_checkout_continue_equals_cold(models, kind, n):
    model = models(kind)
    prompt = toks(n + 12, seed=n)
    head, tail = prompt[:n], prompt[n:]
    c = live(model)
    feed(model, c, head, step=7)
    state = capture(c)
    assert (state.depth, [s.kind for s in state.layers]) == (n, list(LAYOUTS[kind]))
    before = state_fingerprint(state)
    warm = checkout(state)
    assert [type(a) for a in warm.layers] == [type(b) for b in c.layers]
    warm.check()
    assert same(run(model, warm, tail, prompt, step=5), cold(model, prompt))
    assert state_fingerprint(state) == before          # a hit never rewrites the stored entry
    # and the same state serves again, identically
    assert same(run(model, checkout(state), tail, prompt, step=3), cold(model, prompt))


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_floor_is_the_shallowest_depth_served_with_parity(models, kind):
    """Cut back to the floor (the shallowest depth the layers still hold) and continue: equal to
    a cold prefill of that prefix. Below the floor checkout refuses."""
    model = models(kind)
    prompt = toks(150, seed=7)
    c = live(model)
    feed(model, c, prompt[:140], step=64)
    state = capture(c)
    expected_floor = {"dense": 0, "mamba2": 140, "lfm2": 140, "hybrid": 140,
                      "gemma3": 140, "gpt_oss": 140,        # concatenating prefill: not a full ring
                      # the forward at 128 dropped the front to start_position 96: chunk [96, 128)
                      # is the earliest whose first token is still held
                      "llama4": 96}[kind]
    assert state.floor == expected_floor
    d = state.floor if state.floor < state.depth else state.depth
    if d:
        assert same(run(model, checkout(state, d), prompt[d:], prompt, step=9), cold(model, prompt))
    if state.floor > 0:
        with pytest.raises(ValueError):
            checkout(state, state.floor - 1)


def test_chunked_floor_follows_the_kept_chunk(models):
    """mlx-lm's ChunkedKVCache.trim clamps silently once the front was dropped; serving a depth
    whose chunk start was dropped would be wrong with no error, so the floor forbids it."""
    model = models("llama4")
    prompt = toks(176, seed=3)
    c = live(model)
    feed(model, c, prompt[:156], step=16)
    for _ in range(20):  # decode-like one-token steps move start_position forward
        feed(model, c, [prompt[c.depth]], 1)
    chunked = c.layers[0]
    assert isinstance(chunked, ChunkedKVCache) and chunked.start_position == 175 - 32
    state = capture(c)
    assert state.floor == 160                        # ceil(143 / 32) * 32: chunk [160, 192) is held
    for d in (160, 170):
        assert same(run(model, checkout(state, d), prompt[d:], prompt, step=8), cold(model, prompt))
    for bad in (159, 144, 128, 100):                 # their chunk starts before token 143
        assert not state.can_serve(bad)


def test_rotated_window_serves_exact_depth_and_one_token_back(models):
    """After decode-style one-token steps the ring is full: exact depth, or one token back (the
    dropped token's slot is the next one written), never further."""
    model = models("gemma3")
    prompt = toks(120, seed=11)
    c = live(model)
    feed(model, c, prompt[:60], step=60)
    for i in range(60, 100):
        feed(model, c, [prompt[i]], 1)
    assert isinstance(c.layers[0], RotatingKVCache) and c.floor == 99
    exact = capture(c)
    assert (exact.depth, exact.floor) == (100, 100)
    assert same(run(model, checkout(exact), prompt[100:], prompt, step=7), cold(model, prompt))
    c.cut(99)                                        # in place, as closing a turn does
    assert c.floor == 99                             # marked: no second cut
    with pytest.raises(ValueError):
        c.cut(98)
    back = capture(c)
    assert (back.depth, back.floor) == (99, 99)
    assert same(run(model, checkout(back), prompt[99:], prompt, step=7), cold(model, prompt))
    assert same(run(model, c, prompt[99:], prompt, step=1), cold(model, prompt))


def test_recurrent_depth_is_counted_not_read(models):
    """mamba2's layers have no .offset: the depth is what was fed, so closing a turn can never
    read 0 and fail ("KV holds -16 generated tokens")."""
    model = models("mamba2")
    c = live(model)
    feed(model, c, toks(33, 1), step=10)
    assert c.depth == 33 and all(kind_of(layer).depth(layer) is None for layer in c.layers)
    with pytest.raises(ValueError):
        c.cut(32)


# ---------------------------------------------------------------------------- serialisable form
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_dump_load_round_trip_is_bit_exact(models, kind):
    model = models(kind)
    prompt = toks(100, seed=5)
    c = live(model)
    feed(model, c, prompt[:90], step=13)
    state = capture(c)
    arrays, meta = dump_state(state)
    # through numpy and back, as the disk tier stores it
    reloaded = load_state({k: mx.array(np.array(v)) for k, v in arrays.items()}, meta)
    again, meta2 = dump_state(reloaded)
    assert meta2 == meta and again.keys() == arrays.keys()
    assert all(np.array_equal(np.array(again[k]), np.array(arrays[k])) for k in arrays)
    assert (reloaded.depth, reloaded.floor, reloaded.nbytes) == (state.depth, state.floor, state.nbytes)
    assert same(run(model, checkout(reloaded), prompt[90:], prompt, step=4), cold(model, prompt))


def test_stored_class_names_are_an_allow_list():
    assert class_from_key("mlx_lm.models.cache:KVCache") is KVCache
    for bad in ("os:system", "mlx_lm.models.cache:make_prompt_cache", "mlx_lm.models.cache:Foo.bar",
                "builtins:object"):
        with pytest.raises(ValueError):
            class_from_key(bad)


# ---------------------------------------------------------------------------- quantized KV
def test_quantized_kv_capture_checkout_trim_parity(models):
    """QuantizedKVCache serves prefix / LCP depths (trim works): a hit at any depth equals a cold
    run that used the same quantised cache from the start."""
    model = models("dense_hd64")
    prompt = toks(140, seed=21)

    def qlive() -> LiveCache:
        return LiveCache([QuantizedKVCache(group_size=64, bits=8) for _ in make_prompt_cache(model)])

    ref = run(model, qlive(), prompt, prompt, step=11)
    c = qlive()
    feed(model, c, prompt[:120], step=17)
    state = capture(c)
    assert [s.kind for s in state.layers] == ["quantized", "quantized"] and state.floor == 0
    for d in (120, 64, 37):
        assert same(run(model, checkout(state, d), prompt[d:], prompt, step=9), ref)
    arrays, meta = dump_state(state)
    assert same(run(model, checkout(load_state(arrays, meta), 50), prompt[50:], prompt, step=9), ref)


def test_cache_list_serves_what_all_members_serve():
    kv, rot = KVCache(), RotatingKVCache(max_size=4)
    x = mx.ones((1, 1, 6, 2))
    kv.update_and_fetch(x, x)
    rot.update_and_fetch(x, x)
    rot.update_and_fetch(x[..., :1, :], x[..., :1, :])   # concat then in-place: rotated
    kv.update_and_fetch(x[..., :1, :], x[..., :1, :])
    layer = CacheList(kv, rot)
    kind = kind_of(layer)
    assert kind is KINDS["list"] and kind.depth(layer) == 7
    assert kind.floor(layer, 7) == 6          # the rotated member decides: a full ring, one token back
    state = kind.capture(layer, 7)
    again = kind.checkout(state, 7)
    assert isinstance(again, CacheList) and [type(c) for c in again.caches] == [KVCache, RotatingKVCache]
    assert again.caches[0].offset == 7 and again.caches[1].offset == 7


def test_unknown_cache_class_is_reported_not_guessed():
    class StrangeCache:
        offset = 0

    layout = probe_layout([KVCache(), StrangeCache()])
    assert not layout.supported and layout.unknown == ("StrangeCache",)
    assert layout.kinds == ("kv", "?StrangeCache")
