"""DISK_KEEP_ON_EXIT beside the other mechanisms, against the cold reference (tests/fuzz/harness.py):
nothing is written through (DISK_CACHE_MIN_TOKENS above every prompt), so what the restarted engine
finds on disk is only what the stopped one kept at its shutdown -- a model server the router
(MODELS_ON_DEMAND) unloads. Waves of greedy, seeded, grammar and hanging-up rows with an urgent
request preempting them, a restart, then the same conversations again: every reply equals its run
alone on a cold engine, and the second wave is served from disk.
"""
from __future__ import annotations

import pytest

from tests.fuzz.harness import Config, Harness
from tests.fuzz.machine import model_path
from tests.fuzz.test_fuzz_preemption import wave

pytestmark = pytest.mark.slow

CONFIGS = [
    Config(kind="dense", min_shared=16, speculative=True, max_sequences=4, disk=True, keep_on_exit=True),
    Config(kind="llama_hd64", min_shared=16, speculative=False, kv_bits=4, quant_start=0, kv_scheme="turboquant",
           max_sequences=4, disk=True, keep_on_exit=True),
    Config(kind="hybrid", min_shared=16, speculative=False, max_sequences=4, disk=True, keep_on_exit=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name() for c in CONFIGS])
def test_entries_kept_at_exit_serve_the_next_start_as_the_cold_reference(config, tiny_kind_paths,
                                                                          embedded_model_path, tmp_path):
    h = Harness(config, model_path(config.kind, tiny_kind_paths, embedded_model_path), tmp_path)
    try:
        h.run(wave("a"))
        assert h.warm.state.disk.write_throughs == 0          # nothing on disk before the shutdown
        in_ram = len(h.warm.state.kv.index.entries())
        indexed = len(h.warm.state.kv.index.entries(include_disk=True))    # RAM + spilled ones
        h.restart()
        assert in_ram > 0 and h.warm.state.disk.restored == indexed          # every entry came back from disk
        h.run(wave("a"))                                      # the same conversations, after the restart
        assert [str(f) for f in h.findings] == []
        assert "hits_disk" in h.stats.features and h.stats.restarts == 1
        assert h.stats.compared >= 10
    finally:
        h.close()
