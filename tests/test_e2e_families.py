"""Every model family through port 4000 (issue 9, "done means"): one real stack -- the launcher's
backends file with one MLX server per cache-kind fixture (sliding window: gemma3, gpt_oss with
its harmony template; chunked attention: llama4; recurrent: mamba2; conv hybrid: lfm2) behind the
real LiteLLM proxy. A multi-turn conversation long enough to rotate every window and drop
attention chunks goes through the proxy to each family; every reply (content, reasoning, tool
calls, finish reason) equals what a real MLX server with caching off answers for the same
request, every warm turn reuses at least the previous turn's prompt, and no request fails.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from scripts.probelib.servers import launch_stack
from tests.conftest import LiveServer, engine_settings, http_json, unused_ports
from tests.test_model_families import SYSTEM, TURNS

pytestmark = pytest.mark.e2e  # a real stack per model family (docs/testing.md#tiers)

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["gemma3", "gpt_oss", "llama4", "mamba2", "lfm2"]
KEY, MLX_KEY = "sk-e2e-families", "sk-mlx-e2e-families"
COMMON = {"DEFAULT_TEMPERATURE": "0", "DEFAULT_REPETITION_PENALTY": "1.0", "DEFAULT_THINKING": "false",
          "DISK_CACHE_DIR": "off", "ENABLE_REQUEST_LOGGING": "false"}


class FamiliesStack:
    def __init__(self, tmp: Path, paths: dict[str, Path], embedded_cache: str) -> None:
        *backend_ports, self.proxy_port = unused_ports(len(paths) + 1)
        self.ports = dict(zip(paths, backend_ports))
        backends = tmp / "backends.yaml"
        backends.write_text("backends:\n" + "".join(
            f"  - model_path: {paths[k]}\n    port: {self.ports[k]}\n" for k in paths))
        env = {**COMMON, "BACKENDS_FILE": str(backends), "PROXY_PORT": str(self.proxy_port),
               "LITELLM_MASTER_KEY": KEY, "MLX_API_KEY": MLX_KEY, "LOG_ROOT": str(tmp / "logs"),
               "MODEL_CACHE_DIR": embedded_cache, "PROXY_STARTUP_TIMEOUT_SECONDS": "240"}
        self.log_path = tmp / "stack.log"
        self.proc, self.log = launch_stack(env, self.log_path, timeout=400)
        self.base = f"http://127.0.0.1:{self.proxy_port}"

    def backend(self, kind: str) -> str:
        return f"http://127.0.0.1:{self.ports[kind]}"

    def model_id(self, kind: str) -> str:
        status, body, _ = http_json(self.backend(kind) + "/v1/models", headers={"Authorization": f"Bearer {MLX_KEY}"})
        assert status == 200, body
        return body["data"][0]["id"]

    def chat(self, body: dict) -> tuple[int, dict, dict]:
        status, out, headers = http_json(self.base + "/v1/chat/completions", body,
                                         headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
        return status, out, {k.lower(): v for k, v in dict(headers).items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def families(tmp_path_factory, tiny_kind_paths, embedded_model_path):
    paths = {kind: tiny_kind_paths(kind) for kind in FAMILIES}
    stack = FamiliesStack(tmp_path_factory.mktemp("families-stack"), paths, str(embedded_model_path.parent))
    yield stack, paths
    stack.stop()


def reply_of(body: dict) -> dict:
    choice = body["choices"][0]
    msg = choice["message"]
    return {"content": msg.get("content"), "reasoning": msg.get("reasoning_content"),
            "tool_calls": [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []],
            "finish_reason": choice["finish_reason"]}


@pytest.mark.parametrize("kind", FAMILIES)
def test_family_through_the_proxy_equals_the_cache_off_server(families, kind):
    stack, paths = families
    model = stack.model_id(kind)
    messages = [{"role": "system", "content": SYSTEM}]
    sent, through_proxy, usages = [], [], []
    for user in TURNS:
        messages.append({"role": "user", "content": user})
        body = {"model": model, "messages": list(messages), "max_tokens": 12, "temperature": 0}
        status, out, headers = stack.chat(body)
        assert status == 200, (kind, out)
        assert stack.backend(kind) in headers.get("x-litellm-model-api-base", ""), headers   # LiteLLM -> this family
        sent.append(body)
        through_proxy.append(reply_of(out))
        usages.append(out["usage"])
        messages.append({"role": "assistant", "content": out["choices"][0]["message"].get("content") or ""})

    cold = LiveServer(engine_settings(paths[kind], prompt_cache_max_entries_global=0))
    try:
        reference = []
        for body in sent:
            status, out, _ = http_json(cold.base + "/v1/chat/completions", {**body, "model": cold.app.model_id},
                                       timeout=300)
            assert status == 200, out
            assert (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
            reference.append(reply_of(out))
    finally:
        cold.close()

    assert through_proxy == reference, kind
    prompts = [u["prompt_tokens"] for u in usages]
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages]
    assert prompts[-1] > 150                       # past every 32-token window and chunk
    assert cached[0] == 0
    for prev_prompt, now in zip(prompts, cached[1:]):
        assert now >= prev_prompt - 8, (kind, prompts, cached)   # the previous turn's prompt is reused
    status, stats, _ = http_json(stack.backend(kind) + "/v1/cache/stats",
                                 headers={"Authorization": f"Bearer {MLX_KEY}"})
    assert status == 200
    assert stats["correctness"]["exact_key_rejected_by_model_lcp"] == 0
    assert stats.get("status_counts", {}).get("500", 0) == 0


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_fan_out_through_the_proxy_equals_the_cache_off_server(families, kind):
    """Four requests at once through port 4000, each extending one stored turn by the same pasted
    file plus its own question (sub-agents over one context; LESSONS 63), then one branch's next
    turn: every reply is what the cache-off server answers to the same request alone."""
    from tests.fuzz.traffic import at_once, fan_out

    stack, paths = families
    model = stack.model_id(kind)
    sent: list[dict] = []

    def ask(messages: list[dict]) -> dict:
        body = {"model": model, "messages": messages, "max_tokens": 10, "temperature": 0, "session_id": f"fan-{kind}"}
        status, out, _ = stack.chat(body)
        assert status == 200, (kind, out)
        sent.append(body)
        return reply_of(out)

    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    first = ask(msgs)
    hist = msgs + [{"role": "assistant", "content": first["content"] or ""}]
    branches = fan_out(hist, 4, 10)
    got = at_once(ask, branches)
    assert sorted(got) == [0, 1, 2, 3], kind
    nxt = branches[3] + [{"role": "assistant", "content": got[3]["content"] or ""}, {"role": "user", "content": "And then?"}]
    last = ask(nxt)
    cold = LiveServer(engine_settings(paths[kind], prompt_cache_max_entries_global=0, max_concurrent_sequences=1))
    try:
        def alone(messages: list[dict]) -> dict:
            status, out, _ = http_json(cold.base + "/v1/chat/completions", {
                "model": cold.app.model_id, "messages": messages, "max_tokens": 10, "temperature": 0,
                "session_id": f"fan-{kind}"}, timeout=300)
            assert status == 200, out
            return reply_of(out)

        assert first == alone(msgs)
        assert [got[i] for i in range(4)] == [alone(b) for b in branches], kind
        assert last == alone(nxt), kind
    finally:
        cold.close()
