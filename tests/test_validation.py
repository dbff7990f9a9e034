"""server/common/validation.py as pure functions: every field to its real domain, every refusal a 400 that
names the field (issue 10, items 8 and 9), plus property-based tests (hypothesis) that no body,
however malformed, gets anything but a ChatRequest or an APIError(400)."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings as hyp_settings, strategies as st

from mlxstack.server.http.errors import APIError
from mlxstack.server.common.validation import (
    MAX_JSON_DEPTH,
    find_lone_surrogate,
    json_depth_exceeds,
    parse_chat_request,
    parse_json,
)
from mlxstack.config.settings import load_settings

S = load_settings(env={})
Q = [{"role": "user", "content": "hi"}]
VOCAB = 49152


def refused(body: dict, vocab: int | None = VOCAB) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_request(body, S, vocab_size=vocab)
    assert info.value.status == 400
    return info.value


def raw_refused(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_json(raw)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------------------- JSON layer
@pytest.mark.parametrize("raw, fragment", [
    (b'{"messages": [], "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"min_p": Infinity}', "Infinity is not a JSON number"),
    (b'{"min_p": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"top_p": 1e999}', "out of range for a 64-bit float"),
    (b'{"seed": ' + b"9" * 5000 + b"}", "number that cannot be parsed"),
    (b"[" * 100_000 + b"]" * 100_000, "deeper than 64 levels"),
    (b'{"a":' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1), "deeper than 64 levels"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content holds an unpaired"),
    (b"\xff\xfe", "not valid UTF-8"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
])
def test_malformed_json_is_400(raw, fragment):
    assert fragment in raw_refused(raw).message


def test_depth_limit_is_exact():
    ok = b'{"a":' * (MAX_JSON_DEPTH - 1) + b"1" + b"}" * (MAX_JSON_DEPTH - 1)
    assert isinstance(parse_json(ok), dict)  # 63 nested objects inside the body object = depth 64
    assert json_depth_exceeds([[[]]], 3) is False and json_depth_exceeds([[[[]]]], 3) is True
    assert json_depth_exceeds({"a": [1, {"b": 2}]}, 3) is False and json_depth_exceeds({"a": [1, {"b": []}]}, 3)


def test_surrogate_paths():
    assert find_lone_surrogate({"a": ["ok", {"b": "x\ud83dy"}]}) == "a[1].b"
    assert find_lone_surrogate({"a": "\U0001F600 paired emoji is fine"}) is None


# ---------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("field, value, fragment", [
    ("temperature", float("nan"), "finite"),
    ("temperature", float("inf"), "finite"),
    ("temperature", -0.1, "between 0 and 5"),
    ("temperature", 5.5, "between 0 and 5"),
    ("top_p", 1.01, "between 0 and 1"),
    ("min_p", float("nan"), "finite"),
    ("min_p", -1, "between 0 and 1"),
    ("top_k", -1, "at least 0"),
    ("top_k", 2.5, "an integer"),
    ("top_k", VOCAB + 1, f"vocabulary size {VOCAB}"),
    ("repetition_penalty", 11, "between 0 and 10"),
    ("repetition_context_size", 0, "positive"),
    ("repetition_context_size", 2**31, "between 1 and"),
    ("max_tokens", 0, "positive"),
    ("max_tokens", 2**40, "between 1 and 2147483647"),
    ("max_tokens", True, "an integer"),
    ("presence_penalty", 2.5, "between -2 and 2"),
    ("frequency_penalty", -3, "between -2 and 2"),
    ("frequency_penalty", "1", "a number"),
])
def test_sampling_numbers_out_of_domain(field, value, fragment):
    err = refused({"messages": Q, field: value})
    assert fragment in err.message and err.param == field


@pytest.mark.parametrize("seed", [-1, 2**64, 2**64 + 5, 1.5, "7", True])
def test_seed_domain(seed):
    err = refused({"messages": Q, "seed": seed})
    assert err.param == "seed" and "0 to 2**64-1" in err.message


@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_seed_edges_accepted(seed):
    assert parse_chat_request({"messages": Q, "seed": seed}, S, vocab_size=VOCAB).seed == seed


def test_top_k_vocab_edge():
    # top_k == vocab keeps every token: the same as off (mlx-lm's sampler refuses k == vocab).
    assert parse_chat_request({"messages": Q, "top_k": VOCAB}, S, vocab_size=VOCAB).top_k == 0
    assert parse_chat_request({"messages": Q, "top_k": VOCAB - 1}, S, vocab_size=VOCAB).top_k == VOCAB - 1
    assert parse_chat_request({"messages": Q, "top_k": 0}, S, vocab_size=VOCAB).top_k == 0
    assert parse_chat_request({"messages": Q, "top_k": 7.0}, S, vocab_size=VOCAB).top_k == 7
    assert parse_chat_request({"messages": Q}, S, vocab_size=VOCAB).top_k == S.default_top_k


def test_defaults_and_carried_fields():
    req = parse_chat_request({"messages": Q}, S, vocab_size=VOCAB)
    assert (req.n, req.logprobs, req.top_logprobs, req.presence_penalty, req.frequency_penalty, req.logit_bias,
            req.tool_choice, req.response_format) == (1, False, None, 0.0, 0.0, None, None, None)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    req = parse_chat_request({
        "messages": Q, "n": 1, "logprobs": True, "top_logprobs": 20, "presence_penalty": -2, "frequency_penalty": 1.5,
        "logit_bias": {"0": -100, "49151": 100, "17": 2.5}, "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "get_time", "extra": 1}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    }, S, vocab_size=VOCAB)
    assert req.logprobs is True and req.top_logprobs == 20
    assert req.presence_penalty == -2.0 and req.frequency_penalty == 1.5
    assert req.logit_bias == {0: -100.0, 49151: 100.0, 17: 2.5}
    assert req.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    assert req.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    for choice in ("none", "auto", "required"):
        assert parse_chat_request({"messages": Q, "tools": tools, "tool_choice": choice}, S).tool_choice == choice
    assert parse_chat_request({"messages": Q, "response_format": {"type": "json_object"}}, S).response_format == {
        "type": "json_object"}


# ---------------------------------------------------------------------------- unsupported / malformed fields
@pytest.mark.parametrize("body, param, fragment", [
    ({"n": 2}, "n", "'n' = 2 is not supported"),
    ({"n": 0}, "n", "positive"),
    ({"logprobs": "yes"}, "logprobs", "boolean"),
    ({"top_logprobs": 3}, "top_logprobs", "requires 'logprobs': true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "between 0 and 20"),
    ({"logit_bias": []}, "logit_bias", "must be an object"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {str(VOCAB): 1}}, f"logit_bias.{VOCAB}", "outside the model's vocabulary"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", "between -100 and 100"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias.5", "finite"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be one of none, auto, required"),
    ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name", "not in 'tools'"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "must be 'none'"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "one of text, json_object, json_schema"),
    ({"response_format": "json"}, "response_format.type", "one of"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "response_format.json_schema.schema", "an object"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ({"tools": {"a": 1}}, "tools", "list"),
    ({"stop": ["", "x"]}, "stop", "non-empty"),
    ({"stream_options": {"include_usage": "yes"}}, "include_usage", "boolean"),
    ({"model": 5}, "model", "string"),
])
def test_unsupported_or_malformed_fields_are_refused(body, param, fragment):
    err = refused({"messages": Q, **body})
    assert err.param == param and fragment in err.message, err.message


@pytest.mark.parametrize("part, where", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "messages[1].content[1].type"),
    ({"type": "file", "file": {"file_id": "f"}}, "messages[1].content[1].type"),
    ({"type": "video_url", "video_url": {"url": "x"}}, "messages[1].content[1].type"),
    ({"text": "no type"}, "messages[1].content[1].type"),
    ({"type": "text", "text": 5}, "messages[1].content[1].text"),
    (7, "messages[1].content[1]"),
])
def test_unknown_content_parts_are_named(part, where):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}, part]}]
    err = refused({"messages": msgs})
    assert err.param == where and where in err.message


def test_known_content_parts_pass():
    parts = ["plain", {"type": "text", "text": "a"}, {"type": "input_text", "text": "b"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
             {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, {"image_url": {"url": "x"}}]
    req = parse_chat_request({"messages": [{"role": "user", "content": parts}]}, S)
    assert req.messages[0]["content"] == parts


# ---------------------------------------------------------------------------- properties
JSON_LEAVES = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
JSON_VALUES = st.recursive(JSON_LEAVES, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                           max_leaves=20)
FIELDS = ["messages", "temperature", "top_p", "top_k", "min_p", "seed", "n", "max_tokens", "stop", "stream",
          "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs", "logit_bias", "presence_penalty",
          "frequency_penalty", "response_format", "repetition_penalty", "repetition_context_size", "model",
          "thinking", "enable_thinking", "reasoning_effort", "cache_salt"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]),
                                 "content": JSON_VALUES})


@hyp_settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=8), st.lists(MESSAGE, max_size=3))
def test_any_body_is_a_request_or_a_400(fields, messages):
    body = {"messages": messages, **fields} if "messages" not in fields else fields
    try:
        req = parse_chat_request(body, S, vocab_size=VOCAB)
    except APIError as err:
        assert err.status == 400 and err.message and set(err.body()["error"]) == {"message", "type", "param", "code"}
        return
    # Whatever passes is inside the domains the sampler and engine can take.
    for value in (req.temperature, req.top_p, req.min_p, req.repetition_penalty, req.presence_penalty,
                  req.frequency_penalty):
        assert isinstance(value, float) and math.isfinite(value)
    assert 0 <= req.temperature <= 5 and 0 <= req.top_p <= 1 and 0 <= req.min_p <= 1
    assert isinstance(req.top_k, int) and 0 <= req.top_k < VOCAB
    assert req.seed is None or (type(req.seed) is int and 0 <= req.seed < 2**64)
    assert req.n == 1 and 1 <= req.max_tokens <= 2**31 - 1 and 1 <= req.repetition_context_size <= 2**31 - 1
    assert all(0 <= k < VOCAB and -100 <= v <= 100 for k, v in (req.logit_bias or {}).items())
    assert isinstance(req.messages, list) and req.messages


@hyp_settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_parse_to_an_object_or_a_400(raw):
    try:
        body = parse_json(raw)
    except APIError as err:
        assert err.status == 400
        return
    assert isinstance(body, dict)
