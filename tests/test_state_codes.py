"""RECURRENT_STATE_BITS (cache/state_codes.py): stored recurrent states as TurboQuant codes. LOSSY by
design, so no parity here: what is tested is that the code path is exact (checkout restores the
codes' decoding, bit for bit, from RAM and from disk), the bytes are what the format says, a warm
turn is served from a coded snapshot, attention KV and uncodable arrays stay exact, and no server
restores codes another setting wrote (a miss, never a wrong hit)."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache

from mlxstack.cache import turboquant as tq
from mlxstack.cache.kv_ops import dump_state, load_state
from mlxstack.cache.layer_kinds import KINDS, LayerState
from mlxstack.cache.state_codes import StateCodes, acceptable, codable, code_layer, codings
from tests.conftest import build_engine, engine_settings
from tests.test_disk_cache import disk_settings, run_turns
from tests.test_engine import job
from tests.test_model_families import TURNS

SEED = tq.SEED


def arrays_state(*arrays) -> LayerState:
    return LayerState("arrays", ArraysCache, tuple(arrays), (("size", len(arrays)),), 40, 40)


def rand(shape, dtype=mx.float32, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


# ------------------------------------------------------------------ the code path
# an 8-bit codebook takes ~4 s to build per dimension here (Lloyd's iteration over 256 levels): the
# engine tests run at 4 bits, and the 8-bit code path is in the slow tier
@pytest.mark.parametrize("bits", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_checkout_restores_exactly_what_the_codes_decode_to_and_the_bytes_are_the_formats(bits):
    """Conv state [1, 3, 96] and SSM state [1, 4, 16, 16] (the mamba2 fixture's) coded along the
    last axis, a bfloat16 array coded back to bfloat16; a last dimension of 12 (no power-of-two
    block of 8), a tiny array, an integer array and an unset slot stay what they were."""
    conv, ssm, half = rand((1, 3, 96)), rand((1, 4, 16, 16), seed=1), rand((2, 64), mx.bfloat16, seed=2)
    odd, tiny, ints = rand((1, 3, 12), seed=3), rand((1, 4, 8), seed=4), mx.arange(96).reshape(1, 96)
    s = arrays_state(conv, ssm, half, odd, tiny, ints, None)
    assert [codable(a) for a in s.arrays] == [True, True, True, False, False, False, False]
    coded = code_layer(s, bits)
    p = dict(coded.params)
    assert (p["code_bits"], p["code_seed"], p["size"]) == (bits, SEED, 7) and codings([coded]) == {(bits, SEED)}
    live = KINDS["arrays"].checkout(coded, 40)
    assert type(live) is ArraysCache and len(live.cache) == 7
    for a, got in zip((conv, ssm, half), live.cache):
        book = tq.scheme(bits, a.shape[-1], SEED)
        want = book.decode(*book.encode(a)).astype(a.dtype)
        assert same(got, want)                                      # exactly the codes' decoding
        assert not mx.array_equal(got, a).item()                    # and lossy: not the floats
        rel = float(mx.linalg.norm((got - a).astype(mx.float32)) / mx.linalg.norm(a.astype(mx.float32)))
        assert rel < (0.15 if bits == 4 else 0.01)
    for a, got in zip((odd, tiny, ints), live.cache[3:6]):
        assert same(got, a) and got is not a                        # exact, a new object (LESSONS 2)
    assert live.cache[6] is None
    again = KINDS["arrays"].checkout(coded, 40).cache               # the same floats every time
    assert all(same(x, y) for x, y in zip(again[:6], live.cache[:6]))
    # bytes: d * bits / 8 + 4 a vector of d coordinates; the rest as it was
    per = lambda d: d * bits // 8 + 4  # noqa: E731
    exact = odd.nbytes + tiny.nbytes + ints.nbytes
    assert coded.nbytes == 3 * per(96) + 64 * per(16) + 2 * per(64) + exact
    assert s.nbytes == 3 * 96 * 4 + 64 * 16 * 4 + 2 * 64 * 2 + exact
    assert coded.nbytes == {4: 996, 8: 1716}[bits] + exact          # against 5,504 bytes of floats
    # coding twice changes nothing; a layer with nothing codable is not marked coded
    assert code_layer(coded, bits) is coded
    assert code_layer(arrays_state(odd, tiny), bits).params == (("size", 2),)


def test_the_disk_form_gives_the_same_bytes_back_and_refuses_codes_without_their_params(tmp_path):
    """dump / safetensors file / load (the disk tier's path: records.path_to_state) of a hybrid's
    state -- a coded recurrent layer beside a KV layer the setting never touches."""
    from mlx_lm.models.cache import KVCache

    from mlxstack.cache.kv_ops import KVState

    kv = LayerState("kv", KVCache, (rand((1, 2, 40, 16), seed=5), rand((1, 2, 40, 16), seed=6)), (), 40, 0)
    rec = arrays_state(rand((1, 3, 128), seed=7), rand((1, 4, 16, 16), seed=8))
    layers = StateCodes(4).code_layers([rec, kv])
    assert layers[1] is kv and layers[0].kind == "arrays"
    state = KVState(layers, 40, 40, sum(s.nbytes for s in layers))
    arrays, meta = dump_state(state)
    mx.save_safetensors(str(tmp_path / "e.safetensors"), arrays)
    back = load_state(mx.load(str(tmp_path / "e.safetensors")), meta)
    assert back.nbytes == state.nbytes and [s.params for s in back.layers] == [s.params for s in state.layers]
    for a, b in zip(back.layers[0].arrays, layers[0].arrays):
        assert all(same(x, y) for x, y in zip(a, b))                # (packed uint8, f float32), bit for bit
    got = KINDS["arrays"].checkout(back.layers[0], 40).cache
    assert all(same(x, y) for x, y in zip(got, KINDS["arrays"].checkout(layers[0], 40).cache))
    m = meta["layers"][0]
    for drop in ("code_seed", "dtype1"):
        bad = {**meta, "layers": [{**m, "params": {k: v for k, v in m["params"].items() if k != drop}}, meta["layers"][1]]}
        with pytest.raises(ValueError, match="bits, seed or dtype"):
            load_state(arrays, bad)


def test_only_the_servers_own_codes_are_acceptable():
    s = arrays_state(rand((1, 3, 96)), rand((1, 4, 16, 16), seed=1))
    coded, exact = code_layer(s, 4), s
    assert not acceptable(None, [coded]) and acceptable(None, [exact])
    assert acceptable(StateCodes(4), [coded]) and acceptable(StateCodes(4), [exact])
    assert not acceptable(StateCodes(8), [coded]) and not acceptable(StateCodes(4, seed=SEED + 1), [coded])
    assert StateCodes.of("off", ("arrays",)) is None and StateCodes.of("8", ("kv", "kv")) is None
    assert StateCodes.of("4", ("arrays", "kv")) == StateCodes(4, SEED)


# ------------------------------------------------------------------ through the engine
@pytest.mark.parametrize("kind", ["mamba2", "lfm2"])
def test_a_warm_turn_is_served_from_a_coded_snapshot(tiny_kind_paths, kind):
    from mlxstack.observability.metrics import EngineCollector

    engine = build_engine(engine_settings(tiny_kind_paths(kind), recurrent_state_bits="4"))
    outs, _ = run_turns(engine, TURNS)
    assert all(o.completion_tokens > 0 for o in outs)
    assert [o.cached_tokens > 0 for o in outs] == [False, True, True, True]
    stats = engine.state.stats()
    assert sum(stats["hits"].values()) >= 3 and stats["recurrent_state_codes"] == {"scheme": "turboquant", "bits": 4,
                                                                                     "seed": SEED}
    entries = engine.state.kv.index.entries()
    assert entries
    for e in entries:          # every stored recurrent layer coded; attention KV as it was
        assert {s.kind for s in e.payload.layers} == ({"arrays"} if kind == "mamba2" else {"arrays", "kv"})
        assert codings(e.payload.layers) == {(4, SEED)}
        assert all("code_bits" not in dict(s.params) for s in e.payload.layers if s.kind == "kv")
        assert e.nbytes == e.payload.nbytes
    # /metrics says it too (the scrape-time collector over the engine's state)
    worker = SimpleNamespace(queue_depth=0, busy=False, active_sequences=0, core=None, queued_by_priority=dict)
    app = SimpleNamespace(_status_lock=threading.Lock(), status_counts={}, worker=worker, ready=True,
                          model_id=kind, family="generic", lockstep=None, state=engine.state)
    gauge = {m.name: m for m in EngineCollector(app).collect()}["mlxstack_cache_recurrent_state_bits"]
    assert [s.value for s in gauge.samples] == [4]


def test_a_coded_entry_on_disk_serves_its_own_setting_and_no_other(tiny_kind_paths, tmp_path):
    """On -> restart on: a disk hit whose state is the RAM entry's, byte for byte. Off on the same
    folder: another namespace, a miss. Off -> on likewise. And should an off server ever meet a
    coded file (the namespace is the first guard), the load refuses it: a miss, counted."""
    from mlxstack.cache.disk.backing import DiskBacking
    from mlxstack.cache.disk.tier import DiskTier

    path = tiny_kind_paths("mamba2")
    on = dict(recurrent_state_bits="4")
    first = build_engine(disk_settings(path, tmp_path / "a", **on))
    _, messages = run_turns(first, TURNS[:2])
    first.state.close()
    ram = {tuple(e.model_tokens): e.payload for e in first.state.kv.index.entries()}
    follow = messages + [{"role": "user", "content": TURNS[2]}]

    again = build_engine(disk_settings(path, tmp_path / "a", **on))
    assert again.state.disk.restored >= 1
    warm = again.run(job(follow, max_tokens=8, session="disk")[0])
    assert warm.cached_tokens > 0 and warm.timings["cache_tier"] == "disk"
    loaded = [e for e in again.state.kv.index.entries() if e.payload is not None and e.depth <= warm.cached_tokens]
    assert loaded
    for e in loaded:
        mine = ram[tuple(e.model_tokens)]
        for a, b in zip(e.payload.layers, mine.layers):
            assert a.params == b.params
            assert all(same(x, y) for sa, sb in zip(a.arrays, b.arrays) for x, y in zip(sa, sb))
    namespace = again.state.disk.tier.namespace
    again.state.close()

    off = build_engine(disk_settings(path, tmp_path / "a"))
    assert off.state.disk.tier.namespace != namespace and off.state.disk.restored == 0
    assert off.run(job(follow, max_tokens=8, session="disk")[0]).cached_tokens == 0
    off.state.close()

    plain = build_engine(disk_settings(path, tmp_path / "b"))
    run_turns(plain, TURNS[:2])
    plain.state.close()
    coded = build_engine(disk_settings(path, tmp_path / "b", **on))
    assert coded.state.disk.restored == 0
    assert coded.run(job(follow, max_tokens=8, session="disk")[0]).cached_tokens == 0
    coded.state.close()

    # the second guard: an off server handed the coded namespace's files refuses them on load
    blind = build_engine(disk_settings(path, tmp_path / "c"))
    blind.state.close()
    blind.state.disk = DiskBacking(DiskTier(tmp_path / "a", namespace, 1 << 30), 32)
    assert blind.state.disk.restore(blind.state.kv.index) >= 1
    before = blind.state.counters.snapshot().get("disk_load_failures", 0)
    out = blind.run(job(follow, max_tokens=8, session="disk")[0])
    assert out.cached_tokens == 0 and out.completion_tokens > 0
    assert blind.state.counters.snapshot().get("disk_load_failures", 0) > before
    assert all(not codings(e.payload.layers) for e in blind.state.kv.index.entries() if e.payload is not None)
    blind.state.disk.tier.close()
