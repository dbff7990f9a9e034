"""The whole product: start_llm's stack (real MLX server on the embedded model + real LiteLLM
proxy) on free ports, driven through port "4000" with the OpenAI SDK, raw HTTP and the
Anthropic /v1/messages shape Claude Code uses. Ends by checking SIGTERM frees both ports."""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest

from mlxstack.launcher import ports
from scripts.probelib.servers import launch_stack
from tests.conftest import http_json, unused_ports

pytestmark = pytest.mark.e2e  # the whole stack: MLX server and LiteLLM processes (docs/testing.md#tiers)

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-e2e-test-key"
MODEL = "SmolLM2-135M-Instruct"


class Stack:
    def __init__(self, tmp: Path, embedded_cache: str, **extra_env: str) -> None:
        self.mlx_port, self.proxy_port = unused_ports(2)
        env = {"MLX_PORT": str(self.mlx_port), "PROXY_PORT": str(self.proxy_port), "LITELLM_MASTER_KEY": KEY,
               "LOG_ROOT": str(tmp / "logs"), "MODEL_CACHE_DIR": embedded_cache, "DEFAULT_TEMPERATURE": "0",
               "DEFAULT_MAX_TOKENS": "24", "PROXY_STARTUP_TIMEOUT_SECONDS": "180", **extra_env}
        self.log_path = tmp / "stack.log"
        self.proc, self.log = launch_stack(env, self.log_path)
        self.base = f"http://127.0.0.1:{self.proxy_port}"
        self.mlx = f"http://127.0.0.1:{self.mlx_port}"

    def post(self, path, body, key=KEY, headers=None):
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        return http_json(self.base + path, body, headers={**auth, **(headers or {})}, timeout=180)

    def recent(self) -> list[dict]:
        return http_json(self.mlx + "/v1/cache/stats")[1]["recent"]

    def stop(self) -> float:
        self.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        code = self.proc.wait(timeout=15)
        while not (ports.port_is_free("127.0.0.1", self.mlx_port) and ports.port_is_free("127.0.0.1", self.proxy_port)):
            assert time.monotonic() - start < 5, "ports still busy 5 s after SIGTERM"
            time.sleep(0.1)
        self.log.close()
        return code


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    s = Stack(tmp_path_factory.mktemp("stack"), str(embedded_model_path.parent))
    yield s
    if s.proc.poll() is None:
        s.proc.kill()


Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_ready_line_and_capital_of_france_with_usage(stack):
    log = stack.log_path.read_text()
    assert f"http://127.0.0.1:{stack.proxy_port}/v1" in log and MODEL in log
    for model in (f"openai/{MODEL}", MODEL):
        status, body, _ = stack.post("/v1/chat/completions", {"model": model, "messages": Q, "max_tokens": 24})
        assert status == 200, body
        assert "Paris" in body["choices"][0]["message"]["content"]
        assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] > 0


def test_missing_or_wrong_key_is_401(stack):
    assert stack.post("/v1/chat/completions", {"model": MODEL, "messages": Q}, key=None)[0] == 401
    # A wrong key is 401 too: the front door answers it (LiteLLM 1.106 alone, without a database,
    # would say 400 "No connected db."; routing/front_door.py).
    status, body, _ = stack.post("/v1/chat/completions", {"model": MODEL, "messages": Q}, key="sk-wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"


def test_openai_sdk_streaming_and_cached_tokens(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY)
    system = {"role": "system", "content": "You answer in one short sentence. " * 15}
    msgs = [system, {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, extra_body={"session_id": "sdk-1"})
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Another."}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"session_id": "sdk-1"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage][-1]
    assert text.strip()
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert stack.recent()[-1]["session"].startswith("sdk-1")


def test_session_affinity_header_reaches_the_backend(stack):
    stack.post("/v1/chat/completions", {"model": MODEL, "messages": Q, "max_tokens": 4},
               headers={"x-session-affinity": "affinity-42"})
    assert stack.recent()[-1]["session"].startswith("affinity-42")


def test_anthropic_messages_shape_claude_code(stack):
    body = {"model": MODEL, "max_tokens": 24, "system": "x-anthropic-billing-header: cc_version=2.1; cch=ab12;\nYou are Claude Code.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]}
    status, reply, _ = stack.post("/v1/messages", body)
    assert status == 200, reply
    assert reply["type"] == "message" and reply["role"] == "assistant"
    assert any(b["type"] == "text" and b["text"] for b in reply["content"])
    u = reply["usage"]   # what was reused, what this request stored, and the rest make the prompt
    assert u["cache_creation_input_tokens"] > 0 and u["input_tokens"] == 0
    # streaming variant: Anthropic SSE event names
    req = urllib.request.Request(stack.base + "/v1/messages", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "x-api-key": KEY})
    with urllib.request.urlopen(req, timeout=180) as resp:
        raw = resp.read().decode()
    assert "event: message_start" in raw and "event: content_block_delta" in raw and "event: message_stop" in raw


def test_anthropic_tool_use_round_trip(stack):
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    messages = [
        {"role": "user", "content": "Read README.md"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "README.md"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "# Title\nA server."}]},
    ]
    status, reply, _ = stack.post("/v1/messages", {"model": MODEL, "max_tokens": 16, "tools": tools, "messages": messages})
    assert status == 200, reply
    assert reply["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


def test_concurrent_sessions_through_litellm_batch_reuse_and_match_alone(stack):
    """Four agent sessions at once through port 4000: their turns decode together on the MLX
    server, each warm turn reuses its own previous turn, and every reply equals the reply the
    same conversation gets when it runs alone afterwards."""
    system = {"role": "system", "content": "You are a terse coding agent. Answer in one sentence. " * 8}
    users = ["Name a sorting algorithm.", "Name a prime number.", "Name a colour.", "Name a planet."]

    def converse(i: int, tag: str) -> list[tuple[str, dict]]:
        msgs, out = [system], []
        for t in range(2):
            msgs = msgs + [{"role": "user", "content": users[i] if t == 0 else "And another one?"}]
            status, body, _ = stack.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 16,
                                                                  "temperature": 0, "session_id": f"{tag}-{i}"})
            assert status == 200, body
            out.append((body["choices"][0]["message"]["content"], body["usage"]))
            msgs = msgs + [{"role": "assistant", "content": out[-1][0]}]
        return out

    together: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, converse(i, "conc"))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    recent = [r for r in stack.recent() if str(r.get("session", "")).startswith("conc-")]
    alone = [converse(i, "alone") for i in range(4)]
    assert sorted(together) == [0, 1, 2, 3]
    assert [[text for text, _ in together[i]] for i in range(4)] == [[text for text, _ in alone[i]] for i in range(4)]
    for i in range(4):
        (_, first), (_, second) = together[i]
        assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"]   # its own turn 1
    assert max(r.get("batch_size_max", 1) for r in recent) >= 2                              # decoded together


def _fan_out(post, cold, session: str, opening: str) -> None:
    """A stored turn, then four requests at once extending it by the same ~360-token pasted file
    (past SHARED_PREFIX_MIN_TOKENS) plus each its own question, then one branch's next turn alone:
    every reply is the cold engine's (which served the same turns alone, so it heals alike)."""
    from tests.fuzz.traffic import at_once, fan_out
    from tests.test_engine import job

    def ask(msgs):
        status, body, _ = post({"model": MODEL, "messages": msgs, "max_tokens": 12, "temperature": 0,
                                "session_id": session})
        assert status == 200, body
        return body["choices"][0]["message"]["content"]

    def alone(msgs):        # greedy means greedy: no default penalty (LESSONS 64)
        j = job(list(msgs), max_tokens=12, session=session)[0]
        return cold.run(j).text.strip()      # the API strips the content's ends (parsing/reasoning.py)

    msgs = [{"role": "system", "content": "You are a terse coding agent. Keep replies short. " * 40},   # > 256 tokens:
            {"role": "user", "content": opening}]                                               # reused by reference
    first = ask(msgs)
    assert first == alone(msgs)
    hist = msgs + [{"role": "assistant", "content": first}]
    branches = fan_out(hist, 5, 40)
    got = at_once(ask, branches)
    assert sorted(got) == [0, 1, 2, 3], "a request of the fan-out did not answer 200"
    assert [got[i] for i in range(4)] == [alone(b) for b in branches]
    nxt = branches[1] + [{"role": "assistant", "content": got[1]}, {"role": "user", "content": "And line 5?"}]
    assert ask(nxt) == alone(nxt)


def test_a_fan_out_over_a_stored_turn_answers_like_a_cold_server_through_4000_and_8080(stack, embedded_model_path):
    """The reproduction of the fork of a copy-free leader (LESSONS 63), from outside: it answered
    500 on every request of the fan-out and left entries that changed the next turn's reply."""
    from mlxstack.config.settings import load_settings
    from tests.conftest import build_engine

    cold = build_engine(load_settings(env={
        "MODEL_PATH": "", "MODEL_CACHE_DIR": str(embedded_model_path.parent), "DEFAULT_TEMPERATURE": "0",
        "DEFAULT_MAX_TOKENS": "24", "PROMPT_CACHE_MAX_ENTRIES_GLOBAL": "0", "SHARED_PREFIX_MIN_TOKENS": "0",
        "SPECULATIVE": "off", "DISK_CACHE_DIR": "off", "ENABLE_REQUEST_LOGGING": "false", "MLX_PORT": "0"}))
    # (the stack's settings are its env over the defaults, as Stack starts it: no .env file)
    before = http_json(stack.mlx + "/v1/cache/stats")[1]["counters"].get("shared_prefill_tokens", 0)
    _fan_out(lambda body: stack.post("/v1/chat/completions", body), cold, "fan-4000", "Explain what a KV cache is.")
    _fan_out(lambda body: http_json(stack.mlx + "/v1/chat/completions", body, timeout=180), cold, "fan-8080",
             "Explain what a radix tree is.")
    stats = http_json(stack.mlx + "/v1/cache/stats")[1]
    assert stats["counters"].get("shared_prefill_tokens", 0) - before >= 2 * 256      # the fan-outs forked
    assert all(v == 0 for v in stats["correctness"].values()), stats["correctness"]


CHECKLIST = "\n".join(f"- item {i}: check the {w} before release" for i, w in enumerate(
    ["logs", "tests", "docs", "config", "ports", "keys", "cache", "disk", "build", "deps", "lint", "notes"], 1))
PY_FILE = "\n".join(f"def get_{n}(store, key):\n    value = store.get(key)\n    return value or {i}"
                    for i, n in enumerate(["user", "order", "invoice", "cart"]))


def test_greedy_through_4000_is_mlx_lms_greedy_continuation_of_the_same_tokens(stack, embedded_model_path):
    """temperature 0 and no penalty fields: the server's default repetition penalty (1.08 here,
    the shipped setting) is not applied, so the reply is mlx-lm's own argmax continuation -- the
    model copies the checklist and the file it is asked to repeat (LESSONS 64). On the old
    defaults both replies differed from mlx-lm's."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tok = load(str(embedded_model_path))
    for ask, copied in (("Here is a checklist:\n" + CHECKLIST + "\nWrite the checklist again exactly.",
                         "- item 1: check the logs before release\n- item 2: check the tests before release"),
                        ("```python\n" + PY_FILE + "\n```\nRepeat this file exactly.",
                         "def get_user(store, key):\n    value = store.get(key)")):
        messages = [{"role": "user", "content": ask}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        want = []
        for t, _ in generate_step(mx.array(prompt), model, max_tokens=64):
            t = int(t)
            if t in tok.eos_token_ids:
                break
            want.append(t)
        status, body, _ = stack.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                              "max_tokens": 64, "temperature": 0})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["choices"][0]["message"]["content"] == tok.decode(want).strip()
        assert copied in body["choices"][0]["message"]["content"]          # the model copies, as asked


def test_sigterm_frees_both_ports(stack):
    assert stack.stop() == 0
