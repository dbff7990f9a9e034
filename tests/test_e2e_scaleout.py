"""Several backends through the real stack: start_llm's run_stack with a backends file (two
replicas of a tiny model, MLX_REPLICAS-style ports, plus the embedded model under a "small-fast"
alias), the real LiteLLM proxy with the mlxstack routing hook, driven over HTTP like a client.

Checks: /v1/models through the proxy lists both models; ``model`` picks the backend; sessions
(explicit id, header id, no id) stay on their replica over their turns; sub-agents sharing the
orchestrator's system prompt land on its replica warm; kill -9 of that replica moves its
sessions to the other one with one cold turn each, no request fails, and they stay there after
the launcher restarts it."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from scripts.probelib.servers import launch_stack
from tests.conftest import http_json, unused_ports

pytestmark = pytest.mark.e2e  # several MLX server processes behind LiteLLM (docs/testing.md#tiers)

REPO = Path(__file__).resolve().parents[1]
KEY, MLX_KEY = "sk-e2e-scaleout", "sk-mlx-scaleout-backends"
AUTH, MLX_AUTH = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {MLX_KEY}"}


class ScaleoutStack:
    def __init__(self, tmp: Path, tiny: Path, embedded_cache: str) -> None:
        # four distinct ports: the replica pair (port, port + 1), the small model, the proxy
        self.replica_port, self.small_port, self.proxy_port = unused_ports(3, first_run=2)
        backends = tmp / "backends.yaml"
        backends.write_text(
            "backends:\n"
            f"  - model_path: {tiny}\n    port: {self.replica_port}\n    replicas: 2\n"
            f"  - model_path: \"\"\n    port: {self.small_port}\n    aliases: [small-fast]\n"
            "    env: {DEFAULT_MAX_TOKENS: 6}\n")
        self.logs = tmp / "logs"
        env = {"BACKENDS_FILE": str(backends), "PROXY_PORT": str(self.proxy_port), "LITELLM_MASTER_KEY": KEY,
               "MLX_API_KEY": MLX_KEY, "LOG_ROOT": str(self.logs), "MODEL_CACHE_DIR": embedded_cache,
               "DEFAULT_TEMPERATURE": "0", "DEFAULT_MAX_TOKENS": "4", "DISK_CACHE_DIR": "off",
               "PROXY_STARTUP_TIMEOUT_SECONDS": "180", "ENABLE_REQUEST_LOGGING": "false"}
        self.log_path = tmp / "stack.log"
        self.proc, self.log = launch_stack(env, self.log_path)
        self.base = f"http://127.0.0.1:{self.proxy_port}"
        self.replicas = [f"http://127.0.0.1:{self.replica_port + i}" for i in range(2)]
        self.small = f"http://127.0.0.1:{self.small_port}"
        self.model = tiny.name  # what the tiny backends serve (their folder's name)

    def chat(self, body, headers=None):
        return http_json(self.base + "/v1/chat/completions", body, headers={**AUTH, **(headers or {})}, timeout=180)

    def requests(self, url: str) -> int:
        status, body, _ = http_json(url + "/v1/cache/stats", headers=MLX_AUTH)
        assert status == 200, body
        return body["counters"].get("requests", 0) if body.get("ready", True) else 0  # restarting: nothing served yet

    def served_by(self, body, headers=None):
        """(status, reply, the replica url that answered: LiteLLM's x-litellm-model-api-base)."""
        status, reply, hdrs = self.chat(body, headers)
        base = {k.lower(): v for k, v in hdrs.items()}.get("x-litellm-model-api-base", "")
        url = base.rstrip("/").removesuffix("/v1") or None
        assert status != 200 or url in self.replicas, (url, hdrs)
        return status, reply, url

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=20)
        self.log.close()
        return code


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_dense_path, embedded_model_path):
    s = ScaleoutStack(tmp_path_factory.mktemp("scaleout"), tiny_dense_path, str(embedded_model_path.parent))
    yield s
    if s.proc.poll() is None:
        s.stop()


def test_two_models_listed_and_chosen_by_model(stack):
    status, body, _ = http_json(stack.base + "/v1/models", headers=AUTH)
    assert status == 200
    assert sorted(m["id"] for m in body["data"]) == sorted(
        [f"openai/{stack.model}", stack.model, "openai/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "small-fast"])
    before = stack.requests(stack.small), [stack.requests(u) for u in stack.replicas]
    for name in ("small-fast", "SmolLM2-135M-Instruct"):
        status, reply, _ = stack.chat({"model": name, "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert status == 200 and "Paris" in reply["choices"][0]["message"]["content"], reply
    assert stack.requests(stack.small) == before[0] + 2
    assert [stack.requests(u) for u in stack.replicas] == before[1]
    log = stack.log_path.read_text()
    assert f"backend mlx:{stack.replica_port} (http://127.0.0.1:{stack.replica_port}) serves {stack.model}" in log
    assert f"backend mlx:{stack.small_port} (http://127.0.0.1:{stack.small_port}) serves SmolLM2-135M-Instruct" in log


# A random-weight model's reply does not always re-tokenise to the ids it generated, so a warm
# turn's reuse can stop a few tokens inside the echoed reply: warm = all but those few tokens
# of the previous prompt; a cold turn reuses at most the shared system prompt.
SLACK = 8


def _warm(log) -> bool:
    return log[-1][2] >= log[-2][1] - SLACK


def test_anthropic_messages_are_routed_by_model_too(stack):
    """With several backends /v1/messages is LiteLLM's own Anthropic endpoint (a pass-through has
    one fixed target), routed by model like chat completions: Claude Code's small-fast requests
    reach the small model's backend."""
    before = stack.requests(stack.small)
    body = {"model": "small-fast", "max_tokens": 16, "system": "You are Claude Code, terse.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]}
    status, reply, _ = http_json(stack.base + "/v1/messages", body,
                                 headers={**AUTH, "x-claude-code-session-id": "5f0e8a9c-1111-2222-3333-444455556666"})
    assert status == 200, reply
    assert reply["type"] == "message" and reply["role"] == "assistant"
    assert "".join(b.get("text", "") for b in reply["content"]).strip()
    assert stack.requests(stack.small) == before + 1


def _turn(stack, session, text):
    session["messages"].append({"role": "user", "content": text})
    status, reply, url = stack.served_by({"model": stack.model, "messages": session["messages"], "max_tokens": 4,
                                          **session.get("body", {})}, session.get("headers"))
    assert status == 200, reply
    session["messages"].append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or "."})
    usage = reply["usage"]
    session["log"].append((url, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    return url


def test_sessions_stay_on_their_replica_and_a_dead_replica_costs_one_cold_turn(stack):
    def session(system, **extra):
        return {"messages": [{"role": "system", "content": system}], "log": [], **extra}

    orchestrator = session("You coordinate a team of coding agents. Plan, split, review. " * 12)
    other = session("You answer questions about gardening, briefly. " * 8, body={"session_id": "garden-1"})
    third = session("You translate English to French. " * 8, headers={"x-session-affinity": "translate-1"})
    subs = [session(orchestrator["messages"][0]["content"]) for _ in range(2)]
    for t in range(3):
        for s in (orchestrator, other, third):
            _turn(stack, s, f"turn {t}: what next?")
        if t == 0:
            for i, s in enumerate(subs):
                _turn(stack, s, f"sub-task {i}: read the file")
    for s in (orchestrator, other, third):
        urls = {u for u, _, _ in s["log"]}
        assert len(urls) == 1, s["log"]                                          # stuck to one replica
        assert all(_warm(s["log"][: i + 1]) for i in range(1, len(s["log"]))), s["log"]   # warm: new tokens only
    home = orchestrator["log"][0][0]
    assert {other["log"][0][0], third["log"][0][0]} != {home}                     # new sessions were spread
    for s in subs:                                                                # joined the orchestrator, warm
        url, prompt, cached = s["log"][0]
        assert url == home and cached >= 128, s["log"]

    # kill -9 the orchestrator's replica: its sessions move, one cold turn each, nothing fails
    victim = home
    survivor = next(u for u in stack.replicas if u != victim)
    pidfile = stack.logs / f".mlx-{victim.rsplit(':', 1)[1]}.pid"
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    time.sleep(0.5)  # longer than the hook trusts a health answer: the next turn probes the dead port
    affected = [s for s in [orchestrator, other, third, *subs] if s["log"][-1][0] == victim]
    unaffected = [s for s in [orchestrator, other, third, *subs] if s["log"][-1][0] != victim]
    for s in affected + unaffected:
        _turn(stack, s, "after the kill")
    # Each affected session's next turn is cold: on the survivor (moved, logged) or, when the
    # launcher had already restarted the victim by then, on the restarted (empty) victim.
    for s in affected:
        assert s["log"][-1][0] in stack.replicas and not _warm(s["log"]), s["log"]
    for s in unaffected:
        assert s["log"][-1][0] == survivor and _warm(s["log"]), s["log"]
    deadline = time.monotonic() + 120
    while f"MLX server mlx:{victim.rsplit(':', 1)[1]} restarted" not in stack.log_path.read_text():
        assert time.monotonic() < deadline, stack.log_path.read_text()[-3000:]
        time.sleep(0.5)
    for s in affected:                                                             # they stay where they went, warm
        went = s["log"][-1][0]
        _turn(stack, s, "back to work")
        assert s["log"][-1][0] == went and _warm(s["log"]), s["log"]
    log = stack.log_path.read_text()
    moved = [s for s in affected if s["log"][-2][0] == survivor]
    assert log.count("mlxstack routing: session ") == len(moved) >= 1
    assert f"!! MLX SERVER mlx:{victim.rsplit(':', 1)[1]} DIED" in log


def test_responses_chains_stay_on_the_backend_holding_the_previous_response(stack):
    """/v1/responses with previous_response_id: the stored response lives on one replica only
    (measured before the fix: every other turn landed on the other replica and got 400
    "Previous response ... not found")."""
    previous, homes = None, []
    for turn in range(4):
        body = {"model": stack.model, "input": [{"role": "user", "content": f"turn {turn}: hello"}], "max_output_tokens": 4,
                **({"previous_response_id": previous} if previous else {})}
        status, reply, headers = http_json(stack.base + "/v1/responses", body, headers=AUTH, timeout=180)
        assert status == 200, reply
        previous = reply["id"]
        homes.append(headers.get("x-litellm-model-api-base") or headers.get("X-Litellm-Model-Api-Base"))
    assert len(set(homes)) == 1 and homes[0].rstrip("/").removesuffix("/v1") in stack.replicas, homes


def test_sigterm_stops_every_server(stack):
    assert stack.stop() == 0
    from mlxstack.launcher import ports

    for port in (stack.replica_port, stack.replica_port + 1, stack.small_port, stack.proxy_port):
        assert ports.port_is_free("127.0.0.1", port), port
