"""Preemption beside the other mechanisms, against the cold reference (tests/fuzz/harness.py): waves
of less urgent requests decoding -- greedy, seeded, under a grammar, one hanging up -- into which an
urgent request arrives a few steps in, so rows leave the batch with their KV and resume (LESSONS
85); every reply, the urgent one's included, must equal its run alone on a cold engine, on plain
KV, under speculation, under TurboQuant codes, with shared prefixes and the disk tier. The
harness admits as the worker does (``pick_next`` / ``room_for``) with one less urgent row beside.
"""
from __future__ import annotations

import pytest

from tests.fuzz.harness import Config, Harness
from tests.fuzz.machine import model_path
from tests.fuzz.traffic import SYSTEMS, Req, block

pytestmark = pytest.mark.slow

CONFIGS = [
    Config(kind="dense", min_shared=16, speculative=False, max_sequences=4),
    Config(kind="dense", min_shared=16, speculative=True, max_sequences=4, disk=True),
    Config(kind="llama_hd64", min_shared=16, speculative=False, kv_bits=4, quant_start=0, kv_scheme="turboquant",
           max_sequences=4),
    Config(kind="hybrid", min_shared=16, speculative=False, max_sequences=4),
]


def wave(tag: str) -> list[Req]:
    system = SYSTEMS[1] + "\nRepository map:\n" + block(3, 4)
    bg = [Req(f"{tag}b{i}", f"{tag}-sub{i}", [{"role": "system", "content": system},
                                              {"role": "user", "content": f"task {i}: report on part {i}."}],
              max_tokens=20, priority=1, origin="subagent") for i in range(5)]
    bg[1].temperature, bg[1].seed = 0.8, 11               # a seeded row keeps its own stream
    bg[2].grammar = True                                  # a row under a grammar keeps its matcher
    bg[3].hang_up, bg[3].extends = ("decode", 6), False   # hangs up, possibly while preempted
    urgent = Req(f"{tag}u", f"{tag}-main", [{"role": "system", "content": SYSTEMS[0]},
                                            {"role": "user", "content": "quick: which test runs first?"}],
                 max_tokens=12, priority=0, arrive=4, origin="urgent")
    return [*bg, urgent]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name() for c in CONFIGS])
def test_preempted_rows_answer_as_the_cold_reference(config, tiny_kind_paths, embedded_model_path, tmp_path):
    h = Harness(config, model_path(config.kind, tiny_kind_paths, embedded_model_path), tmp_path)
    try:
        for tag in ("a", "b", "c"):     # the later waves reuse what the first stored; the rows beside
            h.run(wave(tag))           # the urgent one go 1, 2, 0 (0: the rest of the batch set aside whole)
        assert [str(f) for f in h.findings] == []
        assert h.stats.preemptions >= 2 and "preempted" in h.stats.features
        assert "paused-whole" in h.stats.features
        assert h.stats.compared >= 15
    finally:
        h.close()
