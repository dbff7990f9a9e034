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
    Config("llama_hd64", kv_bits=3, kv_scheme="turboquant", quant_start=24, disk=True),   # codes in RAM and on disk
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


@pytest.mark.parametrize("kind", ["hybrid", "mamba2"])
def test_breakpoint_branches_on_exact_depth_models_answer_as_the_cold_reference(kind, tiny_kind_paths,
                                                                                embedded_model_path, tmp_path):
    """Waves the machine draws only sometimes, always here: a conversation, a cache breakpoint on
    its reply (its end, then inside its text), branches from the mark in several scopes, grammar
    rows and echoes among them -- every reply equal to the cold reference, the mark read by every
    branch of its scope and by none of another's."""
    from .harness import Harness
    from .traffic import SYSTEMS, Req, sentence, with_user

    h = Harness(Config(kind, disk=True), model_path(kind, tiny_kind_paths, embedded_model_path), tmp_path)
    try:
        first = h.run([Req("r1", "s", with_user([{"role": "system", "content": SYSTEMS[0]}], sentence(1, 12)),
                           max_tokens=10)])[0]
        convo = [*first.req.messages, {"role": "assistant", "content": first.text}]
        last = len(convo) - 1
        read = 0
        for wave, (chars, ttl) in enumerate(((None, 3600.0), (len(first.text) // 2 or None, 300.0))):
            branches = [Req(f"w{wave}b{i}", f"s.b{i}", with_user(convo, sentence(10 * wave + i, 5)), max_tokens=8,
                            grammar=i == 1, marks=[[last, chars, ttl]], origin="breakpoint") for i in range(4)]
            branches += [Req(f"w{wave}x", "x", with_user(convo, sentence(99, 5)), max_tokens=8, scope=f"other{wave}",
                             fresh_scope=True, marks=[[last, chars, ttl]], origin="scope")]
            served = h.run(branches)
            assert not h.findings, h.findings
            assert all(s.cached > 0 for s in served[1:4]), [s.cached for s in served]
            assert served[-1].cached == 0
            read += h.warm.state.counters.get("hits_snapshot") + h.warm.state.counters.get("hits_disk")
            h.restart()                       # the second wave reads the mark from the disk tier
        assert read > 0
    finally:
        h.close()
