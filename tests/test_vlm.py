"""VLM path on the tiny qwen2_5_vl fixture: image-safe cache keys, parity with a cold run, HTTP errors.

Parity = greedy output with the prompt cache equals output with the cache disabled; the cold
path itself is checked against mlx-vlm's own forward pass and generate().
"""
from __future__ import annotations

import base64
import io

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlxstack.cache.kv_ops import checkout
from mlxstack.engine.chat import ChatJob
from mlxstack.runner.generate import SamplingParams
from tests.conftest import LiveServer, build_engine, engine_settings, http_json

SYSTEM = {"role": "system", "content": "You are a careful assistant. Look at every picture closely before you answer, "
                                       "and say what you see in plain words."}


def image_url(seed: int, size: tuple[int, int] = (80, 64)) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(text: str, *images: str, style: str = "image_url") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} if style == "image_url"
             else {"type": "input_image", "image_url": u} for u in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def job(messages: list[dict], max_tokens: int = 10) -> ChatJob:
    return ChatJob(request_id="vlm-test", messages=messages, tools=None, enable_thinking=False,
                   params=SamplingParams(max_tokens=max_tokens), stop=[], body={}, headers={}, emit=lambda _t: None)


@pytest.fixture
def engines(tiny_vlm_path):
    """(warm engine with the prompt cache, cold engine without), fresh per test.

    The healing store is off in both: it rewrites echoed assistant turns from the warm engine's
    history, so the cold engine would see a different prompt (healing has its own parity test).
    """
    warm = build_engine(engine_settings(tiny_vlm_path, healing_store=False))
    cold = build_engine(engine_settings(tiny_vlm_path, prompt_cache_max_entries_global=0, healing_store=False))
    yield warm, cold
    # Clean traffic never cuts inside an image.
    assert warm.state.counters.get("vlm_retreat") == 0


def run_both(engines, messages, max_tokens=10):
    warm, cold = engines
    w = warm.run(job(messages, max_tokens))
    c = cold.run(job(messages, max_tokens))
    assert w.raw_text == c.raw_text, (w.cached_tokens, w.match_type)
    assert w.completion_tokens == c.completion_tokens
    return w, warm.prepare(job(messages))


def span_of(prep, k=0):
    return prep.extras["spans"][k]


# ---------------------------------------------------------------------------- correctness of the cold path
def test_engine_is_vlm_and_prefill_matches_mlx_vlm_forward(engines):
    from mlx_vlm import generate
    from mlx_vlm.utils import prepare_inputs

    _, cold = engines
    assert type(cold).__name__ == "VLMChatEngine" and cold.loaded.is_vlm
    messages = [SYSTEM, user("Describe both.", image_url(0), image_url(1, (120, 90)))]
    prep = cold.prepare(job(messages))
    logits = cold.prefill(cold.new_cache(), prep, 0, lambda _c: None, [])
    model, processor = cold.loaded.model, cold.loaded.processor
    images = [im.image for im in prep.extras["images"]]
    inputs = prepare_inputs(processor, images=images, prompts=prep.model_text)
    assert inputs["input_ids"][0].tolist() == prep.model_tokens
    ref = model(inputs["input_ids"], pixel_values=inputs["pixel_values"], mask=inputs["attention_mask"],
                image_grid_thw=inputs["image_grid_thw"]).logits[0, -1]
    assert mx.allclose(logits, ref.astype(mx.float32), atol=1e-4)
    # Decode positions continue mlx-vlm's rope stream: same greedy tokens as mlx_vlm.generate.
    ours = cold.run(job(messages, 12))
    theirs = generate(model, processor, prep.model_text, image=images, max_tokens=12, temperature=0.0, verbose=False)
    assert ours.raw_text == theirs.text


def lookup(engine, prep, j):
    """The KV manager's match for ``prep`` (cache/manager.py: the image rules included)."""
    _, stable = engine.stable_prefix(prep, "s", j)
    return engine.state.kv.match(engine.lookup_of(prep, "s", stable, j.scope))


def test_warm_prefill_from_offset_matches_cold_logits(engines):
    warm, cold = engines
    first = [SYSTEM, user("Describe it.", image_url(0))]
    out = warm.run(job(first))
    follow = first + [{"role": "assistant", "content": out.raw_text}, user("And the colours?", image_url(5))]
    prep = warm.prepare(job(follow))
    match = lookup(warm, prep, job(follow))
    assert match.hit and match.depth >= span_of(prep, 0)[1]        # image 1 reused
    assert match.depth <= span_of(prep, 1)[0]                        # image 2 prefilled
    hot = warm.prefill(checkout(match.entry.payload, match.depth), prep, match.depth, lambda _c: None, [])
    ref = cold.prefill(cold.new_cache(), cold.prepare(job(follow)), 0, lambda _c: None, [])
    assert mx.allclose(hot, ref, atol=1e-4)


# ---------------------------------------------------------------------------- cache behaviour with parity
def test_same_image_twice_hits_with_parity(engines):
    messages = [SYSTEM, user("Describe it.", image_url(0))]
    first, _ = run_both(engines, messages)
    assert first.cached_tokens == 0
    second, prep = run_both(engines, messages)
    assert second.cached_tokens >= span_of(prep)[1]                  # the hit covers the whole image
    assert second.cached_tokens == len(prep.model_tokens) - 1


@pytest.mark.parametrize("size", [(80, 64), (120, 90)], ids=["same-size", "other-size"])
def test_swapped_image_misses_from_that_image_on(engines, size):
    warm, _ = engines
    run_both(engines, [SYSTEM, user("Describe it.", image_url(0))])
    swapped = [SYSTEM, user("Describe it.", image_url(1, size))]
    out, prep = run_both(engines, swapped)
    start, _ = span_of(prep)
    assert 0 < out.cached_tokens <= start                            # text before the image still reused
    # The keys differ from the image on, the model tokens may not (same size -> same pad count).
    a = warm.prepare(job([SYSTEM, user("Describe it.", image_url(0))]))
    diff = next(i for i, (x, y) in enumerate(zip(a.key_tokens, prep.key_tokens)) if x != y)
    assert start < diff <= span_of(prep)[1]
    if size == (80, 64):
        assert a.model_tokens == prep.model_tokens


def test_image_turn_then_text_only_followups_hit_the_image(engines):
    messages = [SYSTEM, user("Describe it.", image_url(0), style="input_image")]
    out, _ = run_both(engines, messages)
    for text in ("Tell me more.", "And one more thing?"):
        messages = messages + [{"role": "assistant", "content": out.raw_text}, {"role": "user", "content": text}]
        out, prep = run_both(engines, messages)
        assert out.cached_tokens >= span_of(prep)[1]
        assert out.match_type != "miss"


def test_two_images_in_one_message_both_processed(engines):
    warm, _ = engines
    a, b = image_url(0), image_url(1, (120, 90))
    messages = [SYSTEM, user("Compare them.", a, b)]
    out, prep = run_both(engines, messages)
    assert len(prep.extras["spans"]) == 2
    assert [e - s for s, e in prep.extras["spans"]] == [6, 12]
    # Each image matters: dropping or swapping either changes the cold output's prompt.
    only_a = warm.prepare(job([SYSTEM, user("Compare them.", a)]))
    assert len(only_a.model_tokens) < len(prep.model_tokens)
    again, prep2 = run_both(engines, messages)
    assert again.cached_tokens >= span_of(prep2, 1)[1]
    swap_second, prep3 = run_both(engines, [SYSTEM, user("Compare them.", a, image_url(2, (120, 90)))])
    assert span_of(prep3, 0)[1] <= swap_second.cached_tokens <= span_of(prep3, 1)[0]


def test_text_only_requests_to_a_vlm(engines):
    messages = [SYSTEM, {"role": "user", "content": "Hello there."}]
    out, prep = run_both(engines, messages)
    assert prep.extras["spans"] == []
    follow = messages + [{"role": "assistant", "content": out.raw_text}, {"role": "user", "content": "Again."}]
    out2, _ = run_both(engines, follow)
    assert out2.cached_tokens > 0


def test_image_identity_off_never_reuses_an_image(tiny_vlm_path):
    warm = build_engine(engine_settings(tiny_vlm_path, cache_vlm_image_identity=False))
    messages = [SYSTEM, user("Describe it.", image_url(0))]
    warm.run(job(messages))
    prep = warm.prepare(job(messages))
    assert not any(t < 0 for t in prep.key_tokens)
    out = warm.run(job(messages))
    assert 0 < out.cached_tokens <= span_of(prep)[0]                  # unverifiable image: not reused


# ---------------------------------------------------------------------------- partial-image safety net
def test_cut_inside_an_image_retreats_and_evicts(engines):
    warm, _ = engines
    messages = [SYSTEM, user("Describe it.", image_url(0))]
    warm.run(job(messages))
    prep = warm.prepare(job(messages))
    query = warm.lookup_of(prep, "s", 0)
    match = lookup(warm, prep, job(messages))
    start, end = span_of(prep)
    at_start = warm.state.kv.within_images(query, match._replace(depth=start))
    assert at_start.depth == start                                    # a cut at the image's start is clean
    assert warm.state.counters.get("vlm_retreat") == 0
    inside = warm.state.kv.within_images(query, match._replace(depth=start + 2))
    assert not inside.hit
    assert warm.state.counters.get("vlm_retreat") == 1
    assert warm.state.kv.index.get(match.entry.entry_id) is None
    out = warm.run(job(messages))                                     # fresh prefill, still correct
    assert out.cached_tokens == 0
    warm.state.counters.bump("vlm_retreat", -1)                       # the fixture asserts clean traffic


# ---------------------------------------------------------------------------- HTTP
def chat(server, messages, max_tokens=4):
    return http_json(server.base + "/v1/chat/completions",
                     {"messages": messages, "max_tokens": max_tokens, "temperature": 0})


def test_text_only_model_refuses_images_with_400(tiny_dense_path):
    server = LiveServer(engine_settings(tiny_dense_path))
    try:
        status, body, _ = chat(server, [user("What is this?", image_url(0))])
        assert status == 400
        assert "does not accept images" in body["error"]["message"]
        assert server.app.model_id in body["error"]["message"]
        status, _, _ = chat(server, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
        assert status == 200
    finally:
        server.close()


def test_vlm_over_http(tiny_vlm_path):
    server = LiveServer(engine_settings(tiny_vlm_path))
    try:
        status, body, _ = chat(server, [SYSTEM, user("Describe it.", image_url(0))])
        assert status == 200, body
        status, body, _ = chat(server, [SYSTEM, user("Describe it.", image_url(0))])
        assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, body
        status, body, _ = chat(server, [user("x", "data:image/png;base64,!!notbase64!!")])
        assert status == 400 and "base64" in body["error"]["message"], body
        status, body, _ = chat(server, [user("x", "file:///etc/passwd")])
        assert status == 400 and "file://" in body["error"]["message"], body
        status, body, _ = chat(server, [user("x", "https://example.com/cat.png")])
        assert status == 400 and "ALLOW_REMOTE_IMAGE_URLS" in body["error"]["message"], body
        status, body, _ = chat(server, [user("x", "data:image/png;base64," + base64.b64encode(b"junk").decode())])
        assert status == 400 and "format not accepted" in body["error"]["message"], body
        status, body, _ = chat(server, [SYSTEM, user("Describe it.", image_url(0))])
        assert status == 200                                          # errors left the server healthy
        assert server.app.state.counters.get("vlm_retreat") == 0
    finally:
        server.close()


# ---------------------------------------------------------------------------- key helpers
def test_key_prefix_keeps_markers_of_covered_images(engines):
    warm, _ = engines
    prep = warm.prepare(job([SYSTEM, user("Compare.", image_url(0), image_url(1))]))
    (s0, e0), (s1, e1) = prep.extras["spans"]
    (m0, m1) = prep.extras["markers"]
    assert warm.key_prefix(prep, s0) == prep.key_tokens[:s0]
    assert warm.key_prefix(prep, e0)[-2:] == list(m0)
    assert warm.key_prefix(prep, e1)[-2:] == list(m1)
    assert warm.key_prefix(prep, len(prep.model_tokens)) == prep.key_tokens


def test_implicit_session_ids_differ_by_opening_image(engines):
    warm, _ = engines
    a = [SYSTEM, user("Describe it.", image_url(0))]
    b = [SYSTEM, user("Describe it.", image_url(1))]
    ka = warm.session_of(warm.prepare(job(a)), job(a))
    kb = warm.session_of(warm.prepare(job(b)), job(b))
    assert ka.source == kb.source == "message-prefix" and ka.session_id != kb.session_id
    # The id covers the opening through its first reply (two conversations that open alike part
    # there): stable as the conversation grows past it, another image in a later turn included,
    # and still apart by the opening image.
    longer = a + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    k2 = warm.session_of(warm.prepare(job(longer)), job(longer))
    assert k2.source == "message-prefix" and k2.session_id not in (ka.session_id, kb.session_id)
    later_image = a + [{"role": "assistant", "content": "ok"}, user("And this?", image_url(1))]
    assert warm.session_of(warm.prepare(job(later_image)), job(later_image)) == k2
    further = longer + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    assert warm.session_of(warm.prepare(job(further)), job(further)) == k2
    b_longer = b + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert warm.session_of(warm.prepare(job(b_longer)), job(b_longer)).session_id != k2.session_id
