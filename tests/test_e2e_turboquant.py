"""Issue 44's done-when, from outside: a stack started with KV_QUANT_SCHEME=turboquant KV_BITS=4
QUANTIZED_KV_START=0 serves through 4000 (real LiteLLM, the embedded model); warm turns reuse the
stored prompt with the replies a cold engine of the same settings gives; after a restart the disk
tier restores the session's codes and the next turn is warm and the same."""
from __future__ import annotations

import pytest

from mlxstack.config.settings import load_settings
from tests.conftest import build_engine, http_json
from tests.test_e2e_stack import MODEL, Stack
from tests.test_engine import job

pytestmark = pytest.mark.e2e  # a real stack with TurboQuant KV (docs/testing.md#tiers)

TQ_ENV = {"KV_QUANT_SCHEME": "turboquant", "KV_BITS": "4", "QUANTIZED_KV_START": "0"}
TURNS = ["You are reviewing a pull request that renames the config loader. List three risks, briefly.",
         "Which of those would a test catch first?", "Write that test's name only."]


def test_turboquant_stack_serves_warm_turns_like_a_cold_run_and_restores_from_disk(tmp_path, embedded_model_path):
    cache_dir = str(embedded_model_path.parent)
    disk = {"DISK_CACHE_DIR": str(tmp_path / "kv"), "DISK_CACHE_MIN_TOKENS": "16"}
    cold = build_engine(load_settings(env={
        "MODEL_PATH": "", "MODEL_CACHE_DIR": cache_dir, "DEFAULT_TEMPERATURE": "0", "DEFAULT_MAX_TOKENS": "24",
        "PROMPT_CACHE_MAX_ENTRIES_GLOBAL": "0", "DISK_CACHE_DIR": "off", "ENABLE_REQUEST_LOGGING": "false",
        "MLX_PORT": "0", **TQ_ENV}))
    messages: list[dict] = []
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    stack = Stack(tmp_path / "one", cache_dir, **TQ_ENV, **disk)
    try:
        for i, turn in enumerate(TURNS[:2]):
            messages.append({"role": "user", "content": turn})
            status, reply, _ = stack.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                                   "max_tokens": 24, "user": "tq"})
            assert status == 200, reply
            text = reply["choices"][0]["message"]["content"]
            assert text == cold.run(job(list(messages), max_tokens=24, session="tq")[0]).text, i
            cached = reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
            assert (cached > 0) == (i > 0), (i, cached)
            messages.append({"role": "assistant", "content": text})
        stats = http_json(stack.mlx + "/v1/cache/stats")[1]
        assert stats["kv_quant"]["scheme"] == "turboquant" and stats["kv_quant"]["bits"] == 4
        assert stats["quantized_bytes"] > 0
    finally:
        stack.stop()
    again = Stack(tmp_path / "two", cache_dir, **TQ_ENV, **disk)
    try:
        messages.append({"role": "user", "content": TURNS[2]})
        status, reply, _ = again.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                               "max_tokens": 24, "user": "tq"})
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"] == cold.run(job(list(messages), max_tokens=24, session="tq")[0]).text
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 50
        assert again.recent()[-1]["cache_tier"] == "disk"
    finally:
        again.stop()
