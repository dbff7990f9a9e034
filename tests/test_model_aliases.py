"""MODEL_ALIASES: more model names for port 4000, so Claude Code and OpenAI clients run with their own
model names unconfigured. The setting's parsing, LiteLLM's generated config (one backend and several),
the real LiteLLM Router resolving the patterns in that config (its own wildcard routing), and the
MLX server's Anthropic endpoint -- LiteLLM's pass-through hands it the client's name -- accepting the
names aimed at it and refusing others with the list of what it answers to."""
from __future__ import annotations

import json

import pytest

from mlxstack.config.settings import SettingsError, load_settings, model_aliases
from mlxstack.launcher import litellm_config as lc
from mlxstack.launcher.backends import Backend, model_groups
from tests.conftest import http_json

DEFAULTS = (("claude-*opus*", "main"), ("claude-*sonnet*", "main"), ("claude-*haiku*", "main"), ("gpt-*", "main"))


def test_the_setting_parses_and_refuses_what_is_not_pattern_equals_target():
    assert model_aliases(load_settings(env={}).model_aliases) == DEFAULTS
    assert model_aliases(" claude-*=main , ,o-*=small-fast ") == (("claude-*", "main"), ("o-*", "small-fast"))
    assert model_aliases("off") == model_aliases("") == ()
    for bad in ("claude-*", "=main", "a=", "a b=main"):
        with pytest.raises(SettingsError, match="MODEL_ALIASES: .* is not pattern=target"):
            load_settings(env={"MODEL_ALIASES": bad})


def test_one_backend_lists_each_pattern_as_a_name_of_the_served_model():
    cfg = lc.build_config(load_settings(env={"MLX_PORT": "8181"}), "SmolLM2-135M-Instruct", context_window=8192)
    names = [m["model_name"] for m in cfg["model_list"]]
    assert names == ["openai/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", *[p for p, _ in DEFAULTS]]
    assert len({repr(sorted(m["litellm_params"].items())) for m in cfg["model_list"]}) == 1   # one deployment
    assert {m["model_info"]["max_input_tokens"] for m in cfg["model_list"]} == {8192}
    off = lc.build_config(load_settings(env={"MODEL_ALIASES": "off"}), "m")
    assert [m["model_name"] for m in off["model_list"]] == ["openai/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"]
    with pytest.raises(SettingsError, match=r"claude-\*haiku\*=small: no model named 'small' here .*BACKENDS_FILE"):
        lc.build_config(load_settings(env={"MODEL_ALIASES": "claude-*haiku*=small"}), "m")


def _groups():
    backends = [Backend("mlx:1", "http://127.0.0.1:1", True, 0), Backend("remote", "http://r:3", False, 1,
                                                                         aliases=("small-fast",))]
    return model_groups(backends, {"http://127.0.0.1:1": ("big", 4096), "http://r:3": ("small", 2048)})


def test_several_backends_route_each_pattern_to_its_target_group():
    s = load_settings(env={"MODEL_ALIASES": "claude-*haiku*=small-fast,claude-*=main,o-*=big"})
    cfg = lc.build_stack_config(s, _groups())
    rows = [(m["model_name"], m["litellm_params"]["model"]) for m in cfg["model_list"]]
    assert rows == [("openai/big", "hosted_vllm/big"), ("big", "hosted_vllm/big"), ("claude-*", "hosted_vllm/big"),
                    ("o-*", "hosted_vllm/big"), ("openai/small", "hosted_vllm/small"), ("small", "hosted_vllm/small"),
                    ("small-fast", "hosted_vllm/small"), ("claude-*haiku*", "hosted_vllm/small")]
    with pytest.raises(SettingsError, match="targets: big, main, openai/big, openai/small, small, small-fast"):
        lc.build_stack_config(load_settings(env={"MODEL_ALIASES": "x-*=tiny"}), _groups())


def test_the_real_litellm_router_resolves_the_patterns_of_the_generated_config(monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # no network for the price list
    litellm = pytest.importorskip("litellm")
    s = load_settings(env={"MODEL_ALIASES": "claude-*haiku*=small-fast,claude-*opus*=main,claude-*sonnet*=main,gpt-*=main"})
    router = litellm.Router(model_list=lc.build_stack_config(s, _groups())["model_list"])
    resolved = {name: router.get_available_deployment(model=name)["litellm_params"]["model"]
                for name in ("claude-sonnet-4-5-20250929", "claude-opus-4-1", "claude-haiku-4-5", "gpt-4o", "small")}
    assert resolved == {"claude-sonnet-4-5-20250929": "hosted_vllm/big", "claude-opus-4-1": "hosted_vllm/big",
                        "claude-haiku-4-5": "hosted_vllm/small", "gpt-4o": "hosted_vllm/big",
                        "small": "hosted_vllm/small"}
    with pytest.raises(Exception, match="model=llama-x"):
        router.get_available_deployment(model="llama-x")
    assert "claude-*sonnet*" in router.get_model_names()        # what /v1/models lists


def test_the_mlx_servers_anthropic_endpoint_accepts_the_main_patterns(embedded_server):
    base = embedded_server.base
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    status, reply, _ = http_json(base + "/v1/messages", {**body, "model": "claude-sonnet-4-5-20250929"})
    assert status == 200 and reply["type"] == "message", reply
    status, count, _ = http_json(base + "/v1/messages/count_tokens", {**body, "model": "claude-haiku-4-5"})
    assert status == 200 and count["input_tokens"] > 0
    status, reply, _ = http_json(base + "/v1/messages", {**body, "model": "llama-x"})
    assert status == 404 and reply["error"]["message"] == (
        "model 'llama-x' is not served here; available: SmolLM2-135M-Instruct; "
        "aliases: claude-*opus*, claude-*sonnet*, claude-*haiku*, gpt-*")
    # chat and Responses come through LiteLLM's routing, which sends the served name: no patterns there
    status, reply, _ = http_json(base + "/v1/chat/completions", {**body, "model": "claude-sonnet-4-5"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"


def test_the_launcher_refuses_an_alias_naming_no_model(tmp_path):
    from mlxstack.launcher.stack import LaunchError, _config_or_refuse

    bad = load_settings(env={"MODEL_ALIASES": "claude-*=nothing"})
    with pytest.raises(LaunchError, match="MODEL_ALIASES: claude-\\*=nothing: no model named 'nothing'"):
        _config_or_refuse(lambda: lc.write_config(bad, "m", tmp_path / "litellm_config.yaml"))
    assert not (tmp_path / "litellm_config.yaml").exists()


# --- through the real stack (LiteLLM in front of the MLX server) -------------------------------
@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    from tests.test_e2e_stack import Stack

    s = Stack(tmp_path_factory.mktemp("alias_stack"), str(embedded_model_path.parent))
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_clients_own_model_names_work_through_port_4000_unconfigured(stack):
    from tests.test_e2e_stack import KEY

    auth = {"Authorization": f"Bearer {KEY}"}
    status, listed, _ = http_json(stack.base + "/v1/models", headers=auth)
    assert status == 200 and "SmolLM2-135M-Instruct" in {m["id"] for m in listed["data"]}
    status, listed, _ = http_json(stack.base + "/v1/models?return_wildcard_routes=true", headers=auth)
    ids = {m["id"] for m in listed["data"]}
    assert status == 200 and {"SmolLM2-135M-Instruct", "claude-*sonnet*", "gpt-*"} <= ids, ids   # LiteLLM's switch
    chat = {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    status, reply, _ = stack.post("/v1/chat/completions", {**chat, "model": "gpt-4o"})
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
    status, reply, _ = stack.post("/v1/messages", {**chat, "model": "claude-sonnet-4-5-20250929"})   # the pass-through
    assert status == 200 and reply["type"] == "message", reply
    status, reply, _ = stack.post("/v1/messages", {**chat, "model": "llama-9"})
    assert status == 404 and "aliases: claude-*opus*" in reply["error"]["message"], reply
    status, reply, _ = stack.post("/v1/chat/completions", {**chat, "model": "llama-9"})
    assert status == 404 and reply["error"]["code"] == "model_not_found" and "aliases: claude-*opus*" in \
        reply["error"]["message"], reply                                     # the front door's, not LiteLLM's 400
