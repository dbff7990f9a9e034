"""The VLM and hybrid paths through the real stack (LiteLLM on the proxy port -> MLX server),
on the tiny fixtures: an image request with a cache hit on the repeat, and a multi-turn hybrid
session served from snapshots."""
from __future__ import annotations

import base64
import io

import pytest

from tests.test_e2e_stack import Stack

pytestmark = pytest.mark.e2e  # real stacks on the VLM and hybrid fixtures (docs/testing.md#tiers)


def _png(color: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm_stack(tmp_path_factory, embedded_model_path, tiny_vlm_path):
    s = Stack(tmp_path_factory.mktemp("vlm-stack"), str(embedded_model_path.parent), MODEL_PATH=str(tiny_vlm_path),
              DEFAULT_THINKING="false", DEFAULT_REPETITION_PENALTY="1.0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hybrid_stack(tmp_path_factory, embedded_model_path, tiny_hybrid_path):
    s = Stack(tmp_path_factory.mktemp("hybrid-stack"), str(embedded_model_path.parent),
              MODEL_PATH=str(tiny_hybrid_path), DEFAULT_THINKING="false", DEFAULT_REPETITION_PENALTY="1.0")
    yield s
    s.stop()


def test_image_through_litellm_hits_on_repeat_and_refuses_local_files(vlm_stack):
    from tests.conftest import http_json

    served = http_json(vlm_stack.mlx + "/v1/models")[1]["data"][0]["id"]
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png((200, 30, 30))}},
                                         {"type": "text", "text": "Describe the image."}]}]
    first = vlm_stack.post("/v1/chat/completions", {"model": served, "messages": msgs, "max_tokens": 6})
    second = vlm_stack.post("/v1/chat/completions", {"model": served, "messages": msgs, "max_tokens": 6})
    assert first[0] == 200 and second[0] == 200, (first, second)
    assert second[1]["choices"][0]["message"]["content"] == first[1]["choices"][0]["message"]["content"]
    assert second[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= second[1]["usage"]["prompt_tokens"] - 1
    swapped = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png((30, 30, 200))}},
                                            {"type": "text", "text": "Describe the image."}]}]
    third = vlm_stack.post("/v1/chat/completions", {"model": served, "messages": swapped, "max_tokens": 6})
    assert third[0] == 200
    assert third[1]["usage"]["prompt_tokens_details"]["cached_tokens"] < third[1]["usage"]["prompt_tokens"] // 2
    local = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                                          {"type": "text", "text": "hi"}]}]
    refused = vlm_stack.post("/v1/chat/completions", {"model": served, "messages": local, "max_tokens": 2})
    assert refused[0] == 400
    stats = http_json(vlm_stack.mlx + "/v1/cache/stats")[1]
    assert stats["correctness"]["vlm_retreat"] == 0


def test_hybrid_multi_turn_through_litellm_uses_snapshots(hybrid_stack):
    from tests.conftest import http_json

    served = http_json(hybrid_stack.mlx + "/v1/models")[1]["data"][0]["id"]
    msgs = [{"role": "system", "content": "You are a careful agent. " * 12}]
    cached = []
    for turn in ("First question?", "Second question?", "Third question?"):
        msgs.append({"role": "user", "content": turn})
        status, body, _ = hybrid_stack.post("/v1/chat/completions", {"model": served, "messages": msgs,
                                                                     "max_tokens": 8, "session_id": "hyb"})
        assert status == 200, body
        cached.append((body["usage"]["prompt_tokens_details"]["cached_tokens"], body["usage"]["prompt_tokens"]))
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert cached[0][0] == 0
    assert all(c > 0.8 * p for c, p in cached[1:]), cached
    rows = hybrid_stack.recent()[-2:]
    # Recurrent state is reused only at an entry's exact depth: the closed previous turn (its
    # model tokens are a prefix of this prompt) or a history-end snapshot; never cut back.
    assert {r["match_type"] for r in rows} <= {"prefix", "snapshot"}, rows
    stats = http_json(hybrid_stack.mlx + "/v1/cache/stats")[1]
    assert stats["correctness"]["hybrid_trim_miss"] == 0 and stats["snapshot_entries"] >= 1
