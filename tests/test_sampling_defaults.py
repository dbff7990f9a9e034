"""Sampling defaults (issue 41, LESSONS 64): a request's own fields, then the model's
generation_config.json, then the settings; temperature 0 is the argmax with only the penalties the
request names; a configured repetition penalty looks at the reply's tokens unless
REPETITION_PENALTY_SCOPE=all. Exact values and exact origins, through parse_chat_request, the
Sampler and a live server's /v1/cache/stats and request log."""
from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from mlxstack.server.common.validation import parse_chat_request
from mlxstack.config.settings import load_settings
from mlxstack.runner.sampling import Sampler, SamplingParams
from mlxstack.runner.sampling_defaults import SamplingDefaults, from_generation_config
from tests.conftest import LiveServer, engine_settings, http_json

Q = [{"role": "user", "content": "hi"}]
S = load_settings(env={})        # the shipped defaults: temperature 0.1, top_p 0.9, top_k 40, min_p 0.05, penalty 1.08
HF = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "bos_token_id": 1}


def test_the_model_file_gives_what_it_ships_in_range():
    assert from_generation_config(HF) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert from_generation_config({"temperature": 7, "top_p": "0.9", "top_k": 2.5, "min_p": True,
                                   "repetition_penalty": 1.1}) == {"repetition_penalty": 1.1}
    assert from_generation_config({"temperature": 0.7, "do_sample": False}) == {"temperature": 0.0}
    assert from_generation_config(None) == {} and from_generation_config([1]) == {}


def test_request_then_model_file_then_settings():
    d = SamplingDefaults.resolve(S, HF)
    assert dict(d.values) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.08}
    assert dict(d.origin) == {"temperature": "generation_config", "top_p": "generation_config",
                              "top_k": "generation_config", "min_p": "settings", "repetition_penalty": "settings"}
    req = parse_chat_request({"messages": Q, "top_p": 0.5}, S, defaults=d)
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.repetition_penalty) == (0.6, 0.5, 20, 0.05, 1.08)
    assert req.sampling_origin["top_p"] == "request" and req.sampling_origin["temperature"] == "generation_config"
    off = SamplingDefaults.resolve(load_settings(env={"GENERATION_CONFIG": "off"}), HF)
    assert dict(off.values) == {"temperature": 0.1, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.08}
    assert set(off.origin.values()) == {"settings"} and off.describe()["generation_config"] == {}


@pytest.mark.parametrize("body, settings_env, penalty, origin", [
    ({"temperature": 0}, {}, 1.0, "greedy"),                                   # the settings' 1.08 not applied
    ({"temperature": 0, "repetition_penalty": 1.2}, {}, 1.2, "request"),       # asked for: applied
    ({}, {"DEFAULT_TEMPERATURE": "0"}, 1.0, "greedy"),                         # greedy by default: the same
    ({"temperature": 0.7}, {}, 1.08, "settings"),                              # sampled: the default applies
    ({"temperature": 0, "repetition_penalty": 1.0}, {}, 1.0, "request"),
])
def test_greedy_gets_only_the_penalties_it_names(body, settings_env, penalty, origin):
    req = parse_chat_request({"messages": Q, **body}, load_settings(env=settings_env))
    assert req.repetition_penalty == penalty and req.sampling_origin["repetition_penalty"] == origin


def test_a_model_files_penalty_is_not_applied_to_greedy_either():
    d = SamplingDefaults.resolve(S, {"repetition_penalty": 1.3})
    req = parse_chat_request({"messages": Q, "temperature": 0}, S, defaults=d)
    assert req.repetition_penalty == 1.0 and req.sampling_origin["repetition_penalty"] == "greedy"
    req = parse_chat_request({"messages": Q, "temperature": 0.5}, S, defaults=d)
    assert req.repetition_penalty == 1.3 and req.sampling_origin["repetition_penalty"] == "generation_config"


def test_the_penalty_looks_at_the_reply_unless_the_scope_says_all():
    assert parse_chat_request({"messages": Q}, S).repetition_scope == "reply"
    assert parse_chat_request({"messages": Q}, load_settings(env={"REPETITION_PENALTY_SCOPE": "all"})).repetition_scope == "all"
    logits = mx.array([2.0, 1.9, -1.0, 0.5])
    for scope, first in (("reply", 0), ("all", 1)):
        # token 0 is in the prompt: with scope "all" its logit 2.0 / 1.5 falls below token 1's 1.9
        s = Sampler(SamplingParams(repetition_penalty=1.5, repetition_scope=scope), history=[0, 0, 3], vocab_size=4)
        assert int(s.sample(logits).item()) == first
        s.accept(mx.array(0, dtype=mx.int32))
        assert int(s.sample(logits).item()) == 1                 # a token of the reply is penalised either way
    # frequency / presence (OpenAI's): over generated tokens only, never the prompt
    s = Sampler(SamplingParams(frequency_penalty=0.2), history=[0, 0, 0], vocab_size=4)
    assert int(s.sample(logits).item()) == 0
    s.accept(mx.array(0, dtype=mx.int32))
    assert int(s.sample(logits).item()) == 1                     # 2.0 - 0.2 = 1.8 < 1.9


def test_a_live_server_says_which_defaults_it_used(tiny_dense_path, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_dense_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.2}))
    server = LiveServer(engine_settings(folder, enable_request_logging="true", log_root=str(tmp_path / "logs"),
                                        default_temperature="0.8", default_repetition_penalty="1.0"))
    try:
        stats = http_json(server.base + "/v1/cache/stats")[1]["sampling"]
        assert stats["defaults"] == {"temperature": {"value": 0.0, "from": "generation_config"},
                                     "top_p": {"value": 0.9, "from": "settings"},
                                     "top_k": {"value": 5, "from": "generation_config"},
                                     "min_p": {"value": 0.05, "from": "settings"},
                                     "repetition_penalty": {"value": 1.2, "from": "generation_config"}}
        assert stats["repetition_penalty_scope"] == "reply"
        for body in ({}, {"temperature": 0.5, "seed": 3}):
            status, out, _ = http_json(server.base + "/v1/chat/completions",
                                       {"messages": Q, "max_tokens": 3, "user": "defaults", **body})
            assert status == 200, out
        assert server.app.state.request_logger.flush(10)
        from mlxstack.observability.request_log import log_files, read_records

        recs = [r for f in log_files(tmp_path / "logs") for r in read_records(f)]
        assert [r["sampling"]["temperature"] for r in recs] == [{"value": 0.0, "from": "generation_config"},
                                                                 {"value": 0.5, "from": "request"}]
        assert [r["sampling"]["repetition_penalty"] for r in recs] == [{"value": 1.0, "from": "greedy"},
                                                                        {"value": 1.2, "from": "generation_config"}]
        assert recs[1]["sampling"]["top_k"] == {"value": 5, "from": "generation_config"}
        assert recs[0]["sampling"]["frequency_penalty"] == {"value": 0.0, "from": "off"}
    finally:
        server.close()
