"""Tiny random-weight fixtures: they load, have the right cache kinds, vary their
greedy output, render the Qwen3-style template, and the incremental cache gives the
same tokens and logits as a one-shot prefill (the baseline every cache test builds on)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as lm_load
from mlx_lm.models.cache import ArraysCache, KVCache, can_trim_prompt_cache, make_prompt_cache

from tests.fixtures.parity import greedy_tokens, next_token_logits, prefill
from tests.fixtures.tiny_models import QWEN_ADDED_TOKENS

LONG_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France? Answer in one sentence, "
    "then list three rivers that flow through the country.<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n"
)


@pytest.fixture(scope="module")
def dense(tiny_dense_path):
    return lm_load(str(tiny_dense_path))


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_path):
    return lm_load(str(tiny_hybrid_path))


@pytest.fixture(params=["dense", "hybrid"])
def text_model(request):
    return request.getfixturevalue(request.param)


# --- loading and cache kinds ------------------------------------------------


def test_dense_config(tiny_dense_path, dense):
    config = json.loads((tiny_dense_path / "config.json").read_text())
    model, tokenizer = dense
    assert config["model_type"] == "qwen3"
    assert len(model.layers) == 2
    assert config["vocab_size"] == len(tokenizer._tokenizer)
    assert model.args.tie_word_embeddings


def test_dense_cache_is_trimmable_kv(dense):
    model, _ = dense
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [KVCache, KVCache]
    assert can_trim_prompt_cache(cache)


def test_hybrid_cache_mixes_arrays_and_kv(hybrid):
    model, _ = hybrid
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [ArraysCache, KVCache, ArraysCache, KVCache]
    assert not can_trim_prompt_cache(cache)


def test_weights_are_float32_and_deterministic(tiny_dense_path, tmp_path, embedded_model_path):
    from tests.fixtures.tiny_models import build_tiny_dense

    again = build_tiny_dense(tmp_path / "again", embedded_model_path)
    a = mx.load(str(tiny_dense_path / "model.safetensors"))
    b = mx.load(str(again / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == mx.float32, name
        assert mx.array_equal(a[name], b[name]), name


# --- tokenizer and template -------------------------------------------------


def test_tokenizer_has_qwen_tokens(dense):
    _, tokenizer = dense
    for text, _special in QWEN_ADDED_TOKENS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == 1, (text, ids)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id in tokenizer.eos_token_ids


def _render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_template_roles_and_thinking_switch(dense):
    _, tokenizer = dense
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    base = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello.<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n"
    )
    on = _render(tokenizer, messages, add_generation_prompt=True)
    off = _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
    assert on == base + "<|im_start|>assistant\n<think>\n"
    assert off == base + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert _render(tokenizer, messages) == base


def test_template_tools_and_tool_loop(dense):
    _, tokenizer = dense
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    messages = [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
    ]
    text = _render(tokenizer, messages, tools=[tool], add_generation_prompt=True, enable_thinking=False)
    assert text.startswith("<|im_start|>system\nSys.\n\n# Tools\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrainy\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# --- greedy output varies -----------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [LONG_PROMPT, "The capital of France is", "1 2 3 4 5"],
)
def test_greedy_output_varies(text_model, prompt):
    model, tokenizer = text_model
    tokens = greedy_tokens(model, tokenizer.encode(prompt), 20)
    assert len(tokens) == 20
    assert len(set(tokens)) >= 5, tokens


# --- baseline parity: incremental cache == one-shot prefill -------------------


@pytest.mark.parametrize("split", [1, 17, -1])
def test_incremental_prefill_parity(text_model, split):
    model, tokenizer = text_model
    prompt = tokenizer.encode(LONG_PROMPT)
    k = split % len(prompt)

    cold_tokens = greedy_tokens(model, prompt, 20)
    cold_logits = next_token_logits(model, prompt)

    cache, _ = prefill(model, prompt[:k])
    warm_logits = next_token_logits(model, prompt[k:], cache)
    assert mx.allclose(warm_logits, cold_logits, atol=1e-4), mx.abs(warm_logits - cold_logits).max()

    cache, _ = prefill(model, prompt[:k])
    assert greedy_tokens(model, prompt[k:], 20, cache=cache) == cold_tokens


def test_multi_turn_cache_extension_parity(text_model):
    """Turn 2 prefilled on top of turn 1's cache (prompt + completion) == cold."""
    model, tokenizer = text_model
    turn1 = tokenizer.encode(LONG_PROMPT)
    cache = make_prompt_cache(model)
    completion = greedy_tokens(model, turn1, 8, cache=cache)
    # generate_step runs one step ahead: the cache now covers turn1 + completion.
    assert cache[-1].offset == len(turn1) + len(completion)
    turn2 = tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd Italy?<|im_end|>\n<|im_start|>assistant\n")
    full = turn1 + completion + turn2

    warm = greedy_tokens(model, turn2, 12, cache=cache)
    assert warm == greedy_tokens(model, full, 12)


def test_chunked_prefill_matches_one_shot(text_model):
    model, tokenizer = text_model
    prompt = tokenizer.encode(LONG_PROMPT)
    _, one_shot = prefill(model, prompt)
    _, chunked = prefill(model, prompt, step=5)
    assert mx.allclose(one_shot, chunked, atol=1e-4)


# --- VLM ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(tiny_vlm_path):
    from mlx_vlm import load as vlm_load

    return vlm_load(str(tiny_vlm_path))


def _image(seed, size=(80, 64)):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _vlm_prompt(processor):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    return processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def _vlm_logits(model, processor, image):
    from mlx_vlm.utils import prepare_inputs

    inputs = prepare_inputs(processor, images=[image], prompts=_vlm_prompt(processor))
    out = model(
        inputs["input_ids"],
        pixel_values=inputs["pixel_values"],
        mask=inputs["attention_mask"],
        image_grid_thw=inputs["image_grid_thw"],
    )
    return inputs, out.logits[0, -1]


def test_vlm_prompt_expands_image_tokens(vlm, tiny_vlm_path):
    model, processor = vlm
    config = json.loads((tiny_vlm_path / "config.json").read_text())
    inputs, _ = _vlm_logits(model, processor, _image(0))
    ids = inputs["input_ids"][0].tolist()
    # 80x64 -> resized to 84x56 -> 6x4 patches -> 2x2 merge -> 6 image tokens.
    assert ids.count(config["image_token_id"]) == 6
    assert ids.count(config["vision_start_token_id"]) == 1
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]


def test_vlm_generate_produces_tokens(vlm):
    from mlx_vlm import generate

    model, processor = vlm
    result = generate(
        model, processor, _vlm_prompt(processor), image=[_image(0)], max_tokens=8, temperature=0.0, verbose=False
    )
    assert result.generation_tokens == 8
    assert len(set(result.token_ids)) >= 3, result.token_ids


def test_vlm_different_images_give_different_logits(vlm):
    model, processor = vlm
    _, a = _vlm_logits(model, processor, _image(0))
    _, a_again = _vlm_logits(model, processor, _image(0))
    _, b = _vlm_logits(model, processor, _image(1))
    assert mx.allclose(a, a_again, atol=1e-5)
    assert not mx.allclose(a, b, atol=1e-3)
