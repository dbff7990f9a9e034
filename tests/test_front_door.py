"""The front door of port 4000 (mlxstack/routing/front_door.py): a wrong key is 401, malformed
bodies are 400, OpenAI-shaped (Anthropic-shaped on /v1/messages), where LiteLLM 1.106.2 alone
answers 400 "No connected db." and 500. Pure checks, the ASGI layer with a fake app, the config
shim, and the real stack driven by the official openai and anthropic SDKs.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from mlxstack.launcher import litellm_config as lc
from mlxstack.routing.front_door import FrontDoor, check_request, install, route_kind

KEY = "sk-front-door"
AUTH = [(b"authorization", f"Bearer {KEY}".encode())]
CHAT = "/v1/chat/completions"


def refused(path, body, headers=AUTH, method="POST"):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return check_request(method, path, headers, raw, KEY)


# ------------------------------------------------------------------ pure checks
def test_keys_wrong_missing_and_right():
    wrong = refused(CHAT, {"messages": []}, [(b"authorization", b"Bearer sk-nope")])
    assert wrong.status == 401 and wrong.body["error"]["type"] == "authentication_error"
    assert refused(CHAT, {"messages": []}, []).status == 401
    assert refused("/v1/messages", {}, [(b"x-api-key", b"sk-nope")]).body == {
        "type": "error", "error": {"type": "authentication_error", "message": refused(
            "/v1/messages", {}, [(b"x-api-key", b"sk-nope")]).body["error"]["message"]}}
    assert refused("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
                   [(b"x-api-key", KEY.encode())]) is None
    assert check_request("GET", "/v1/models", [(b"authorization", b"Bearer x")], None, KEY).status == 401
    assert check_request("GET", "/v1/models", AUTH, None, KEY) is None
    assert check_request("GET", "/health/liveliness", [], None, KEY) is None      # not ours
    assert check_request("POST", CHAT, [], b"[]", "") is not None                  # no master key: shapes only


@pytest.mark.parametrize("body, param", [
    (b"[1, 2]", "body"),
    (b'{"model": ', "body"),
    (b"", "body"),
    (b'{"x": ' + b"[" * 20000 + b"]" * 20000 + b"}", "body"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": "hello"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [7]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
    ({"model": "m", "messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages[0].tool_calls"),
    ({"model": 5, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}, "tools"),
])
def test_chat_bodies_litellm_cannot_take_are_400(body, param):
    r = refused(CHAT, body)
    assert r.status == 400 and r.body["error"]["type"] == "invalid_request_error" and r.body["error"]["param"] == param


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]},
                                {"role": "user", "content": [{"type": "text", "text": "q"},
                                                             {"type": "image_url", "image_url": {"url": "data:x"}}]},
                                {"role": "assistant", "content": None, "tool_calls": [
                                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                                {"role": "tool", "tool_call_id": "c", "content": "ok"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
])
def test_valid_chat_bodies_pass(body):
    assert refused(CHAT, body) is None


def test_responses_and_messages_shapes():
    assert refused("/v1/responses", {"model": "m", "input": "hi"}) is None
    assert refused("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}]}, {"type": "function_call_output", "call_id": "c", "output": "x"}]}) is None
    assert refused("/v1/responses", {"model": "m", "input": 7}).body["error"]["param"] == "input"
    assert refused("/v1/responses", b"[1]").status == 400
    ok = {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s"}],
          "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert refused("/v1/messages", ok) is None
    bad = refused("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]})
    assert bad.status == 400 and bad.body["type"] == "error" and bad.body["error"]["type"] == "invalid_request_error"
    assert refused("/v1/messages", b"[1]").body["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------ the ASGI layer
def test_asgi_layer_answers_refusals_and_replays_accepted_bodies():
    seen = []

    async def app(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    door = FrontDoor(app, master_key=KEY)

    def call(body: bytes, headers=AUTH, path=CHAT):
        parts = [body[:5], body[5:]]
        inbox = [{"type": "http.request", "body": p, "more_body": i == 0} for i, p in enumerate(parts)]
        out = []

        async def receive():
            return inbox.pop(0)

        async def send(m):
            out.append(m)
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        asyncio.run(door(scope, receive, send))
        return out[0]["status"], b"".join(m.get("body", b"") for m in out[1:])

    good = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert call(good) == (200, b"ok") and seen == [good]                     # body replayed intact
    status, body = call(b"[1]")
    assert status == 400 and json.loads(body)["error"]["param"] == "body" and len(seen) == 1
    assert call(good, headers=[(b"authorization", b"Bearer wrong")])[0] == 401
    assert call(b"[1]", path="/health")[0] == 200                             # unwatched path: untouched


def test_install_wraps_a_built_stack_or_the_build_once():
    class App:
        middleware_stack = None

        def build_middleware_stack(self):
            return "inner"
    app = App()
    assert install(app) and not install(app)
    assert isinstance(app.build_middleware_stack(), FrontDoor)
    built = App()
    built.middleware_stack = "running"
    install(built)
    assert isinstance(built.middleware_stack, FrontDoor) and built.middleware_stack.app == "running"


def test_config_names_the_front_door_and_its_shim_imports_without_the_repo_on_the_path(tmp_path):
    from mlxstack.config.settings import load_settings

    s = load_settings(env={})
    assert lc.build_config(s, "m")["litellm_settings"]["callbacks"] == [f"{lc.FRONT_DOOR_SHIM}.front_door"]
    path = lc.write_config(s, "m", tmp_path / "cfg.yaml")
    shim = path.parent / f"{lc.FRONT_DOOR_SHIM}.py"
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('x', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); print(type(m.front_door).__name__)")
    out = subprocess.run([sys.executable, "-c", code, str(shim)], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.stdout.strip() == "FrontDoorHook", out.stderr[-2000:]


# ------------------------------------------------------------------ the real stack
ALIASES = {
    "chat": ["/v1/chat/completions", "/chat/completions", "/openai/v1/chat/completions", "/openai/chat/completions",
             "/engines/m/chat/completions", "/openai/deployments/m/chat/completions", "/v1/chat/completions/",
             # {model:path}: a model id with a "/" (openai/<name>, the first id /v1/models lists)
             "/engines/openai/m/chat/completions", "/openai/deployments/openai/m/chat/completions",
             "/engines/a/b/c/chat/completions"],
    "responses": ["/v1/responses", "/responses", "/openai/v1/responses"],
    "messages": ["/v1/messages", "/v1/messages/count_tokens", "/anthropic/v1/messages"],
    "completions": ["/v1/completions", "/completions", "/openai/v1/completions", "/engines/m/completions",
                    "/engines/openai/m/completions", "/openai/deployments/m/completions"],
    "keyed": ["/openai/deployments/m/embeddings", "/v1/models",
              "/models/m", "/v1/responses/resp_1", "/model/info",
              "/openai/deployments/openai/m/embeddings", "/engines/openai/m/embeddings"],
    None: ["/health", "/health/liveliness", "/", "/v1/chat", "/ui/", "/engines/m/other", "/engines/openai/m/other"],
}


def test_every_alias_litellm_serves_gets_the_same_checks():
    """LiteLLM 1.106.2 serves chat under /engines/{m}/..., /openai/deployments/{m}/..., /openai/v1/...
    and without /v1: they were not watched, so a bad body reached LiteLLM (500) and a wrong key its
    "No connected db." 400."""
    for kind, paths in ALIASES.items():
        assert [route_kind(p) for p in paths] == [kind] * len(paths), kind
    bad = {"model": "m", "messages": [{"role": "user", "content": 7}]}
    for path in ALIASES["chat"]:
        assert refused(path, bad).status == 400 and refused(path, bad).body["error"]["param"] == "messages[0].content"
        assert refused(path, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}) is None
    for path in ALIASES["chat"] + ALIASES["responses"] + ALIASES["completions"] + ALIASES["keyed"]:
        assert refused(path, {}, headers=[(b"authorization", b"Bearer wrong")]).status == 401, path
    assert refused("/openai/v1/responses", {"model": "m", "input": 5}).body["error"]["param"] == "input"
    assert refused("/anthropic/v1/messages", [1]).body["type"] == "error"


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),                                      # LiteLLM: 500
    ([{"role": "system", "content": None}, {"role": "user", "content": "hi"}], "messages[0].content"),
    ([{"role": "tool", "tool_call_id": "c1", "content": "42"}], "messages[0]"),        # an orphan result
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content[1].type"),                                                   # a part type not taken
    ([{"role": "user", "content": [{"type": "video", "url": "x"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}], "messages[1]"),
    ([{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "c2", "content": "42"}], "messages[1].tool_call_id"),
])
def test_bodies_the_openai_api_rejects_are_400_at_both_doors(messages, param):
    from mlxstack.server.http.errors import APIError
    from mlxstack.server.common.validation import parse_chat_request
    from mlxstack.config.settings import load_settings

    assert refused(CHAT, {"model": "m", "messages": messages}).body["error"]["param"] == param
    with pytest.raises(APIError) as err:                                               # the MLX server (8080)
        parse_chat_request({"messages": messages}, load_settings(env={}))
    assert err.value.status == 400 and err.value.param == param


def test_answered_tool_calls_pass_both_doors():
    from mlxstack.server.common.validation import parse_chat_request
    from mlxstack.config.settings import load_settings

    call = lambda i: {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}  # noqa: E731
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call(1), call(2)]},
                {"role": "tool", "tool_call_id": "c2", "content": "b"}, {"role": "tool", "tool_call_id": "c1", "content": "a"},
                {"role": "user", "content": "thanks"}]
    assert refused(CHAT, {"model": "m", "messages": messages}) is None
    assert len(parse_chat_request({"messages": messages}, load_settings(env={})).messages) == 5


def test_the_banner_names_the_port_litellm_was_told_to_bind():
    """The start-up banner named port 4000 whatever PROXY_PORT was: the port LiteLLM's command line
    resolves (``--port``, then ``PORT``, then its default), as the launcher passes it."""
    from mlxstack.routing.front_door import proxy_port

    assert proxy_port(["litellm", "--config", "c.yaml", "--host", "127.0.0.1", "--port", "41234"], {}) == "41234"
    assert proxy_port(["litellm", "--port=41235"], {"PORT": "9"}) == "41235"
    assert proxy_port(["litellm", "--config", "c.yaml"], {"PORT": "41236"}) == "41236"
    assert proxy_port(["litellm"], {}) == "4000"


def test_a_pass_through_is_logged_under_the_deployments_provider():
    """LiteLLM's /messages pass-through logging prices the reply's model through the provider on the
    request's logging object, which a config pass-through cannot name: the pre-call hook names the
    provider every deployment of the generated config has, and leaves one already named alone."""
    from mlxstack.config.settings import load_settings
    from mlxstack.routing.front_door import PASS_THROUGH_PROVIDER, front_door

    class LoggingObj:
        def __init__(self, details):
            self.model_call_details = details

    named, unnamed = LoggingObj({"custom_llm_provider": "anthropic"}), LoggingObj({"model": "m"})
    for obj in (named, unnamed):
        data = {"model": "m", "messages": [], "litellm_logging_obj": obj}
        assert asyncio.run(front_door.async_pre_call_hook(None, None, data, "pass_through_endpoint")) is data
    assert named.model_call_details == {"custom_llm_provider": "anthropic"}
    assert unnamed.model_call_details == {"model": "m", "custom_llm_provider": PASS_THROUGH_PROVIDER}
    other = LoggingObj({})
    asyncio.run(front_door.async_pre_call_hook(None, None, {"litellm_logging_obj": other}, "acompletion"))
    assert other.model_call_details == {}                                   # LiteLLM's router names it there
    config = lc.build_config(load_settings(env={}), "m")
    assert {d["litellm_params"]["model"] for d in config["model_list"]} == {f"{PASS_THROUGH_PROVIDER}/m"}


def test_a_strangers_body_is_never_read():
    """The key is checked from the headers before the first body byte: an unauthenticated 200 MB
    upload is answered 401 without a single receive() (it used to buffer up to 256 MiB first)."""
    reads = []

    async def app(scope, receive, send):
        raise AssertionError("LiteLLM must not see it")

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"x" * (1 << 20), "more_body": True}

    out = []

    async def send(m):
        out.append(m)
    door = FrontDoor(app, master_key=KEY)
    for headers in ([], [(b"authorization", b"Bearer wrong")], [(b"x-api-key", b"nope")]):
        out.clear()
        scope = {"type": "http", "method": "POST", "path": "/engines/m/chat/completions",
                 "headers": headers + [(b"content-length", str(200 << 20).encode())]}
        asyncio.run(door(scope, receive, send))
        assert out[0]["status"] == 401 and reads == []


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    from tests.test_e2e_stack import Stack

    s = Stack(tmp_path_factory.mktemp("front_door"), str(embedded_model_path.parent))
    yield s
    s.stop()


def raw_post(stack, path, data: bytes, key):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}", "x-api-key": key}
    req = urllib.request.Request(stack.base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_openai_sdk_gets_typed_errors_through_4000(stack):
    import openai

    from tests.test_e2e_stack import KEY as STACK_KEY, MODEL

    good = openai.OpenAI(base_url=stack.base + "/v1", api_key=STACK_KEY, max_retries=0)
    reply = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
    assert reply.choices[0].message.content
    chunks = list(good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                               max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=stack.base + "/v1", api_key="sk-wrong", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 401
    for messages, param in (([{"role": "user", "content": 7}], "messages[0].content"), ("hello", "messages")):
        with pytest.raises(openai.BadRequestError) as err:
            good.chat.completions.create(model=MODEL, messages=messages)
        assert err.value.body["param"] == param
    status, body = raw_post(stack, "/v1/chat/completions", b'[{"model": "x"}]', STACK_KEY)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = raw_post(stack, "/v1/responses", b"[1]", STACK_KEY)
    assert status == 400 and "error" in body
    for path in ("/engines/x/chat/completions", "/openai/deployments/x/chat/completions", "/chat/completions"):
        for messages, param in (([{"role": "user"}], "messages[0].content"),
                                ([{"role": "tool", "tool_call_id": "c", "content": "1"}], "messages[0]")):
            status, body = raw_post(stack, path, json.dumps({"model": MODEL, "messages": messages}).encode(), STACK_KEY)
            assert (status, body["error"]["param"]) == (400, param), (path, body)
        assert raw_post(stack, path, b"{}", "sk-wrong")[0] == 401


def test_every_chat_alias_litellm_serves_answers_a_list_body_400(stack):
    """A JSON list on /engines/openai/<m>/chat/completions (or /openai/deployments/...) was a 500:
    the front door took {m} for one path segment, so the alias with a model id holding a "/" was not
    watched (its key check neither). The aliases come from the running LiteLLM's own route table."""
    from tests.conftest import http_json
    from tests.test_e2e_stack import KEY as STACK_KEY, MODEL

    status, spec, _ = http_json(stack.base + "/openapi.json")
    assert status == 200
    posts = {p for p, ops in spec["paths"].items() if "post" in ops}
    # /cursor/chat/completions takes Responses bodies too, /queue/ is LiteLLM's experimental queue
    chat = sorted(p for p in posts if p.endswith("/chat/completions") and not p.startswith("/cursor/"))
    assert chat == ["/chat/completions", "/engines/{model}/chat/completions",
                    "/openai/deployments/{model}/chat/completions", "/v1/chat/completions"]
    listing = http_json(stack.base + "/v1/models", headers={"Authorization": f"Bearer {STACK_KEY}"})[1]
    models = [m["id"] for m in listing["data"]]
    assert models[0] == f"openai/{MODEL}" and MODEL in models
    want = {"error": {"message": "The request body must be a JSON object, got list", "type": "invalid_request_error",
                      "param": "body", "code": None}}
    for template in chat:
        for model in models:
            path = template.replace("{model}", model)
            assert raw_post(stack, path, b'[{"model": "x"}]', STACK_KEY) == (400, want), path
            status, body = raw_post(stack, path, b"{}", "sk-wrong")
            assert (status, body["error"]["type"]) == (401, "authentication_error"), path
    ok = json.dumps({"model": f"openai/{MODEL}", "messages": [{"role": "user", "content": "Say hi."}],
                     "max_tokens": 4}).encode()
    status, body = raw_post(stack, f"/engines/openai/{MODEL}/chat/completions", ok, STACK_KEY)
    assert status == 200 and body["choices"][0]["message"]["content"]
    responses = sorted(p for p in posts if p.endswith("/responses"))
    assert responses == ["/openai/v1/responses", "/responses", "/v1/responses"]
    for path in responses:
        status, body = raw_post(stack, path, b"[1]", STACK_KEY)
        assert (status, body["error"]["param"]) == (400, "body"), path


def test_the_banner_names_the_proxy_port(stack):
    """The stack runs LiteLLM on a free PROXY_PORT: the banner names that port, not 4000."""
    banners = [line for line in stack.log_path.read_text().splitlines() if "mlxstack front door:" in line]
    assert banners == [f"[litellm] mlxstack front door: checking keys and request shapes on port {stack.proxy_port}"]


def test_anthropic_sdk_gets_typed_errors_through_4000(stack):
    anthropic = pytest.importorskip("anthropic")
    from tests.test_e2e_stack import KEY as STACK_KEY, MODEL

    good = anthropic.Anthropic(base_url=stack.base, api_key=STACK_KEY, max_retries=0)
    reply = good.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Say hi."}])
    assert reply.content[0].text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=stack.base, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as err:
        good.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": 7}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    status, body = raw_post(stack, "/v1/messages", b"[1]", STACK_KEY)
    assert status == 400 and body["type"] == "error"


def test_a_comparison_id_is_turned_back_into_the_backends_own():
    """LiteLLM maps its response ids back only in previous_response_id; the front door maps the
    one inside prompt_cache_options (LESSONS 71), with LiteLLM's own decryption and owner check."""
    import base64

    from mlxstack.routing.front_door import comparison_to_backend_id, litellm_backend_response_id

    managed = "resp_" + base64.b64encode(
        b"litellm:custom_llm_provider:hosted_vllm;model_id:m1;response_id:resp_ours123").decode()
    assert litellm_backend_response_id(managed, None) == "resp_ours123"
    assert litellm_backend_response_id("resp_unknown", None) == "resp_unknown"   # not LiteLLM's: as sent
    data = {"input": "hi", "prompt_cache_options": {"comparison_response_id": managed, "ttl": "30m"}}
    assert comparison_to_backend_id(data, lambda rid: litellm_backend_response_id(rid, None)) == {
        "input": "hi", "prompt_cache_options": {"comparison_response_id": "resp_ours123", "ttl": "30m"}}
    assert comparison_to_backend_id({"input": "hi"}, str.upper) == {"input": "hi"}


def test_a_model_no_deployment_takes_is_a_404_listing_the_served_ones():
    from mlxstack.routing.front_door import unknown_model

    served = ["openai/tiny", "tiny", "claude-*"]
    known = lambda m: m in served or m.startswith("claude-")          # a wildcard like claude-*
    chat = unknown_model("/v1/chat/completions", {"model": "gpt-9", "messages": []}, known, lambda: served)
    assert (chat.status, chat.body) == (404, {"error": {
        "message": "The model `gpt-9` does not exist. Available models: openai/tiny, tiny; aliases: claude-*.", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}})
    msgs = unknown_model("/v1/messages", {"model": "gpt-9"}, known, lambda: served)
    assert (msgs.status, msgs.body["type"], msgs.body["error"]["type"]) == (404, "error", "not_found_error")
    for path, d in [("/v1/chat/completions", {"model": "tiny"}), ("/v1/messages", {"model": "claude-opus-4"}),
                    ("/v1/responses", {"input": "no model"}), ("/v1/models", {"model": "gpt-9"})]:
        assert unknown_model(path, d, known, lambda: served) is None, path
    assert unknown_model("/v1/chat/completions", None, known, lambda: served) is None      # not JSON
