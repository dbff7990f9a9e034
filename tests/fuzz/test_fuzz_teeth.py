"""The fuzzer has teeth: with the fork as it was before LESSONS 63 put back (a copy-free leader's
tail taken as its whole prefix), a fixed seed finds the defect by itself, the case it writes is a
ready pytest file, and that case passes on the fixed code."""
from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.models.cache import KVCache

from mlxstack.cache.kv_ops import LiveCache
from mlxstack.cache.prefixed_kv import PrefixedKVCache

from .harness import Config
from .machine import model_path, run_machine
from .replay import replay

pytestmark = pytest.mark.slow  # a fuzzer run that must find the old fork bug (docs/testing.md#tiers)


def _fork_before_the_fix(follower: Any, kv: Any) -> None:
    """engine/shared_prefill.py ``fork`` at 600fc6e (now engine/core.py) (the defect, kept here as the fuzzer's target)."""
    leader, depth = follower.follows
    roots, layers = [], []
    for i, layer in enumerate(leader.live.layers):
        held = leader.live.roots[i]
        if held is not None and held[2] >= depth:
            rk, rv = held[0], held[1]
        else:
            rk, rv = layer.keys[..., :depth, :], layer.values[..., :depth, :]
            leader.live.roots[i] = (rk, rv, depth)
            if type(layer) is KVCache and layer.offset == depth:
                leader.live.layers[i] = PrefixedKVCache((rk, rv, depth))
        roots.append((rk, rv, depth))
        layers.append(PrefixedKVCache((rk, rv, depth)))
    follower.live = LiveCache(layers, depth, kv.quant, roots)
    follower.shared_prefill = depth - follower.start
    follower.start = depth
    follower.pos = depth
    follower.follows = None


def _reach_before_the_fix(leader: Any, depth: int) -> bool:
    at = leader.start if leader.pos < 0 else leader.pos
    return at <= depth or all(type(layer) is KVCache or type(layer) is PrefixedKVCache and layer.n_prefix >= depth
                              for layer in leader.live.layers)


def test_a_fixed_seed_finds_the_fork_of_a_copy_free_leader(tiny_kind_paths, embedded_model_path, tmp_path, monkeypatch):
    config = Config("dense")
    path = model_path("dense", tiny_kind_paths, embedded_model_path)
    case = tmp_path / "test_found.py"
    monkeypatch.setattr("mlxstack.engine.core.fork", _fork_before_the_fix)
    monkeypatch.setattr("mlxstack.scheduler.shared_prefill._can_reach", _reach_before_the_fix)
    with pytest.raises(AssertionError, match="differential fuzzer: mismatch"):
        run_machine(config, path, tmp_path / "run", seed=1, examples=6, steps=15, reproducer=case, shrink=False)
    ns: dict[str, Any] = {}
    exec(compile(case.read_text(), str(case), "exec"), ns)              # a ready pytest file
    assert callable(ns["test_replay"]) and ns["CONFIG"] == config
    found = replay(ns["CONFIG"], ns["ORDER"], ns["WAVES"], tiny_kind_paths, embedded_model_path, tmp_path / "again")
    assert any(f.startswith("mismatch") for f in found)                 # it replays the defect
    monkeypatch.undo()
    assert replay(ns["CONFIG"], ns["ORDER"], ns["WAVES"], tiny_kind_paths, embedded_model_path, tmp_path / "fixed") == []


def test_a_fixed_seed_finds_a_cache_without_scopes(tiny_kind_paths, embedded_model_path, tmp_path, monkeypatch):
    """With every request's scope dropped at the engine's door (one cache for every tenant and
    salt, as before scopes), the first request of a new scope reuses another's prompt: a finding."""
    from mlxstack.engine.chat import ChatEngine

    real = ChatEngine.start

    def start_unscoped(self, job):
        job.scope = ""
        return real(self, job)

    monkeypatch.setattr(ChatEngine, "start", start_unscoped)
    with pytest.raises(AssertionError, match="differential fuzzer: scope"):
        run_machine(Config("dense"), model_path("dense", tiny_kind_paths, embedded_model_path), tmp_path / "run",
                    seed=1, examples=6, steps=15, shrink=False)
