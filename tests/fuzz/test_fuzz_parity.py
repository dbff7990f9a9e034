"""The differential fuzzer's CI tier: fixed seeds, every cache kind, the combinations that broke
before (tests/fuzz/machine.py). A finding fails with the requests that showed it; the long run is
``scripts/fuzz_parity.py --minutes 30`` (shrinks and writes a ready pytest case)."""
from __future__ import annotations

import pytest

from .harness import Config, Totals
from .machine import model_path, run_machine

pytestmark = pytest.mark.slow  # the fuzzer's CI tier, ~2-3 minutes (docs/testing.md#tiers)

SEED = 20261128
CONFIGS = [
    Config("dense", budget_tokens=120, disk=True),                # spills, parking, restarts from disk
    Config("dense", speculative=False, min_shared=8),
    Config("dense_hd64", kv_bits=8, quant_start=24, disk=True),   # both sides of QUANTIZED_KV_START
    Config("dense_hd64", kv_bits=4, quant_start=0),
    Config("dense_hd64", kv_bits=3, kv_scheme="turboquant", quant_start=24, disk=True),   # codes in RAM and on disk
    Config("hybrid", disk=True),                                  # KV + recurrent state (snapshots)
    Config("gemma3"),                                             # sliding windows
    Config("llama4"),                                             # chunked attention (no batched form)
    Config("mamba2", disk=True),                                  # recurrent only
    Config("lfm2"),                                               # conv state
    Config("gpt_oss"),                                            # harmony, sinks, windows
    Config("embedded", min_shared=32, budget_tokens=600, disk=True),
]


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[c.name() for c in CONFIGS])
def test_concurrent_agent_traffic_answers_as_the_cold_reference(index, tiny_kind_paths, embedded_model_path, tmp_path):
    config, totals = CONFIGS[index], Totals()
    examples, steps = (2, 12) if config.kind == "embedded" else (4, 15)
    run_machine(config, model_path(config.kind, tiny_kind_paths, embedded_model_path), tmp_path, seed=SEED + index,
                examples=examples, steps=steps, reproducer=tmp_path / "test_fuzz_found.py", totals=totals,
                shrink=False)
    print(config.name(), totals.line())
    assert totals.requests >= 12 and totals.compared >= 8, totals.line()   # it served real traffic
