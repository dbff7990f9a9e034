"""The fan-out over a stored turn, through the MLX server's HTTP door (its worker, its arrival
window, its scheduler) on the tiny model of every cache kind: four requests at once extending a
stored conversation by the same pasted file plus each its own question all answer 200 with what a
cold server (cache off, one request at a time, no speculation) answers to each alone, and the next
turn of one branch too (LESSONS 63; the embedded model through LiteLLM: tests/test_e2e_stack.py)."""
from __future__ import annotations

import pytest

from tests.conftest import LiveServer, engine_settings, http_json
from tests.fuzz.traffic import at_once, fan_out

pytestmark = pytest.mark.slow  # fan-outs through 8080 on every tiny kind (docs/testing.md#tiers)

KINDS = ["dense", "hybrid", "gemma3", "llama4", "mamba2", "lfm2", "gpt_oss"]
SYSTEM = "You are a careful assistant. Answer briefly and repeat code exactly when asked. " * 2


def _asker(server):
    model = http_json(server.base + "/v1/models")[1]["data"][0]["id"]

    def ask(msgs):
        status, body, _ = http_json(server.base + "/v1/chat/completions", {
            "model": model, "messages": msgs, "max_tokens": 10, "temperature": 0, "session_id": "fan"}, timeout=120)
        assert status == 200, body
        m = body["choices"][0]["message"]
        return m.get("reasoning_content") or "", m.get("content") or "", body["usage"]["completion_tokens"]

    return ask


@pytest.mark.parametrize("kind", KINDS)
def test_a_fan_out_over_a_stored_turn_answers_like_a_cold_server_through_8080(kind, tiny_kind_paths):
    path = tiny_kind_paths(kind)
    warm = LiveServer(engine_settings(path, shared_prefix_min_tokens=16))
    cold = LiveServer(engine_settings(path, prompt_cache_max_entries_global=0, shared_prefix_min_tokens=0,
                                      speculative="off", max_concurrent_sequences=1))
    try:
        ask, alone = _asker(warm), _asker(cold)
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain what a KV cache is."}]
        first = ask(msgs)
        assert first == alone(msgs)
        hist = msgs + [{"role": "assistant", "content": first[1]}]
        branches = fan_out(hist, 9, 8)
        got = at_once(ask, branches, 120)
        assert sorted(got) == [0, 1, 2, 3], "a request of the fan-out did not answer 200"
        assert [got[i] for i in range(4)] == [alone(b) for b in branches]
        nxt = branches[2] + [{"role": "assistant", "content": got[2][1]}, {"role": "user", "content": "And line 5?"}]
        assert ask(nxt) == alone(nxt)
        stats = http_json(warm.base + "/v1/cache/stats")[1]
        assert stats["counters"].get("cached_tokens", 0) > 0
        # (hybrid_trim_miss may count here: a branch's stored entry a recurrent layer cannot cut back
        # is reuse lost, never wrong reuse -- TASKS, snapshot policy)
        assert stats["correctness"]["exact_key_rejected_by_model_lcp"] == stats["correctness"]["vlm_retreat"] == 0
    finally:
        warm.close()
        cold.close()
