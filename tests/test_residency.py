"""Models on demand (MODELS_ON_DEMAND): which models stay resident, and the router that loads them.

The policy (residency/policy.py) on plain data first, exact; then a real router process in front of
real MLX server processes, one per tiny fixture model (MODELS_DIR), with a budget that fits two:
loads and unloads in exact order, one load for concurrent first requests, a reloaded model warm
from its disk-tier namespace with the reply of a cold server, idle TTL and pins, hang-ups, 404 /
400 answers; and once through the whole stack on port 4000 with the official openai SDK.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mlxstack.residency.policy import LOADING, READY, UNLOADING, Slot, TooBig, expired, room_for
from tests.conftest import _model_cache_dir, http_json, unused_port

REPO = Path(__file__).resolve().parents[1]
KV = 8_000_000
PROC = 1_000_000          # MODEL_PROCESS_BYTES in the router tests: exact accounting (0 measures it)
MSGS = [{"role": "user", "content": "hello there, how are you doing today my friend"}]


# ============================================================================ the policy
def S(name, need, state=READY, used=0.0, busy=0, pinned=False):
    return Slot(name, need, state, used, busy, pinned)


def test_room_is_made_from_idle_models_least_recently_used_first():
    slots = [S("a", 30, used=5.0), S("b", 30, used=1.0), S("c", 30, used=3.0)]
    assert room_for(slots, 10, 100) == []                    # 90 + 10 fits
    assert room_for(slots, 40, 100) == ["b"]                 # oldest first, no more than needed
    assert room_for(slots, 70, 100) == ["b", "c"]
    assert room_for(slots, 100, 100) == ["b", "c", "a"]
    ties = [S("y", 30, used=1.0), S("x", 30, used=1.0)]
    assert room_for(ties, 30, 60) == ["x"]                   # equal age: by name


def test_busy_loading_unloading_and_pinned_models_hold_their_room():
    slots = [S("busy", 40, used=0.0, busy=1), S("load", 20, state=LOADING), S("gone", 20, state=UNLOADING),
             S("pin", 10, pinned=True), S("idle", 10, used=9.0)]
    assert room_for(slots, 10, 100) == ["idle"]
    assert room_for(slots, 20, 100) is None                  # only busy rows could make room: wait
    with pytest.raises(TooBig) as exc:
        room_for(slots, 95, 100)                             # fits alone, never beside the pin
    assert (exc.value.need, exc.value.budget, exc.value.pinned) == (95, 100, 10)
    with pytest.raises(TooBig):
        room_for([], 101, 100)                               # cannot fit even alone


def test_expired_lists_idle_models_past_the_ttl_oldest_first():
    slots = [S("a", 1, used=10.0), S("b", 1, used=2.0), S("busy", 1, used=0.0, busy=2),
             S("pin", 1, used=0.0, pinned=True), S("load", 1, state=LOADING, used=0.0)]
    assert expired(slots, now=12.0, ttl=5.0) == ["b"]
    assert expired(slots, now=20.0, ttl=5.0) == ["b", "a"]
    assert expired(slots, now=1e9, ttl=0.0) == []            # 0: never by time


# ============================================================================ a real router
@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, embedded_model_path) -> Path:
    from tests.fixtures import tiny_models as tm

    root = tmp_path_factory.mktemp("models")
    for name, build in (("tiny-a", tm.build_tiny_dense), ("tiny-b", tm.build_tiny_qwen2),
                        ("tiny-c", tm.build_tiny_dense_hd64)):
        build(root / name, embedded_model_path)
    return root


def weights(models_dir: Path, name: str) -> int:
    return sum(p.stat().st_size for p in (models_dir / name).glob("*.safetensors"))


class RouterProc:
    def __init__(self, tmp: Path, models_dir: Path, **env: str) -> None:
        self.port = unused_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full = {**os.environ, "MODELS_DIR": str(models_dir), "MODEL_PATH": "tiny-a", "MODELS_ON_DEMAND": "true",
                "PROMPT_CACHE_MAX_BYTES": str(KV), "MLX_PORT": str(self.port), "MLX_HOST": "127.0.0.1",
                "LOG_ROOT": str(tmp / "logs"), "DISK_CACHE_DIR": str(tmp / "kv"), "MODEL_CACHE_DIR": str(_model_cache_dir()),
                "HF_HUB_CACHE": str(tmp / "hub"), "HF_HUB_OFFLINE": "1", "MLX_API_KEY": "", "DEFAULT_TEMPERATURE": "0",
                "DEFAULT_REPETITION_PENALTY": "1.0", "DEFAULT_THINKING": "false", "SPEC_CALIBRATE": "off",
                "SPECULATIVE": "off", "ENABLE_REQUEST_LOGGING": "false", "MODEL_PROCESS_BYTES": str(PROC), **env}
        self.log_path = tmp / f"router-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxstack.residency.router"], cwd=REPO, env=full,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()[-3000:]
            try:
                if self.health()["ready"]:
                    break
            except OSError:
                pass
            time.sleep(0.3)

    def health(self) -> dict:
        return http_json(self.url + "/health", timeout=5)[1]

    def resident(self) -> list[str]:
        return sorted(m["model"] for m in self.health()["models"] if m["state"] == READY)

    def chat(self, model: str, messages=MSGS, **extra):
        return http_json(self.url + "/v1/chat/completions",
                         {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}, timeout=120)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


@pytest.fixture(scope="module")
def router(tmp_path_factory, models_dir):
    need = weights(models_dir, "tiny-a") + KV + PROC
    r = RouterProc(tmp_path_factory.mktemp("router"), models_dir, MODEL_MEMORY_BUDGET=str(2 * need + need // 2))
    yield r
    r.close()


def test_three_models_round_robin_within_a_budget_for_two(router, models_dir):
    h = router.health()
    assert [m["model"] for m in h["models"]] == ["tiny-a"] and h["loads_total"] == 1     # the main model, preloaded
    pids, replies, steps = {}, {}, []
    for model in ["tiny-a", "tiny-b", "tiny-a", "tiny-c", "tiny-b", "tiny-a"]:
        status, body, _ = router.chat(model)
        assert status == 200, body
        assert body["model"] == model
        replies.setdefault(model, []).append((body["choices"][0]["message"]["content"],
                                              body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        h = router.health()
        steps.append(router.resident())
        assert h["resident_bytes"] <= h["budget_bytes"]
        pids[model] = {m["model"]: m["pid"] for m in h["models"]}[model]
    # the least recently used idle model made room each time: b for c, a for b, c for a
    assert steps == [["tiny-a"], ["tiny-a", "tiny-b"], ["tiny-a", "tiny-b"], ["tiny-a", "tiny-c"],
                     ["tiny-b", "tiny-c"], ["tiny-a", "tiny-b"]]
    h = router.health()
    assert (h["loads_total"], h["unloads_total"]["room"]) == (5, 3)
    # a reloaded model is warm from its disk-tier namespace and answers as it did cold
    assert replies["tiny-a"][0][1] == 0 and replies["tiny-b"][0][1] == 0
    assert [c > 0 for _, c in replies["tiny-a"][1:]] == [True, True]
    assert replies["tiny-b"][1][1] > 0
    for model in ("tiny-a", "tiny-b"):
        assert len({text for text, _ in replies[model]}) == 1, replies[model]
    # memory returned: an unloaded model's process is gone
    assert not alive(pids["tiny-c"])
    # `mlxstack models` marks what the router holds
    env = {**os.environ, "MODELS_DIR": str(models_dir), "MLX_PORT": str(router.port), "MLX_HOST": "127.0.0.1",
           "HF_HUB_CACHE": str(models_dir.parent / "no-hub"), "MODEL_CACHE_DIR": str(models_dir.parent / "no-cache")}
    out = subprocess.run([sys.executable, "-m", "mlxstack.cli", "models"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    rows = {line.split()[0]: line.split()[-1] for line in out.stdout.splitlines()[1:]}
    assert rows == {"tiny-a": "yes", "tiny-b": "yes", "tiny-c": "no"}, out.stdout + out.stderr


def test_concurrent_first_requests_share_one_load(router):
    assert "tiny-c" not in router.resident()
    before = router.health()["loads_total"]
    out = []
    threads = [threading.Thread(target=lambda: out.append(router.chat("tiny-c")[0])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [200, 200, 200]
    assert router.health()["loads_total"] == before + 1


def test_unknown_model_404_lists_the_installed_ones_and_aliases_resolve(router):
    status, body, _ = router.chat("no-such-model")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "tiny-a, tiny-b, tiny-c" in body["error"]["message"]
    status, body, _ = router.chat("claude-sonnet-4-5")          # MODEL_ALIASES' default: the main model
    assert status == 200 and body["model"] == "tiny-a"
    listed = http_json(router.url + "/v1/models")[1]["data"]
    assert [m["id"] for m in listed] == ["tiny-a", "tiny-b", "tiny-c"]
    assert all(m["context_length"] == 4096 for m in listed)


def test_a_streaming_client_that_hangs_up_frees_its_model(router):
    body = json.dumps({"model": "tiny-a", "messages": MSGS, "max_tokens": 400, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", router.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert s.recv(200).startswith(b"HTTP/1.1 200")
    s.close()
    deadline = time.monotonic() + 30
    while {m["model"]: m["in_flight"] for m in router.health()["models"]}.get("tiny-a") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert router.chat("tiny-a")[0] == 200


def test_a_model_too_big_for_the_budget_is_a_400_and_loads_nothing(tmp_path, models_dir):
    from mlxstack.config.settings import load_settings
    from mlxstack.residency.router import Router, RouterError

    settings = load_settings(env={"MODELS_DIR": str(models_dir), "MODEL_PATH": "tiny-a", "MODELS_ON_DEMAND": "true",
                                  "MODEL_MEMORY_BUDGET": str(KV), "PROMPT_CACHE_MAX_BYTES": str(KV),
                                  "LOG_ROOT": str(tmp_path / "logs")})
    r = Router(settings)
    with pytest.raises(RouterError) as exc:
        r.acquire("tiny-b")
    assert (exc.value.status, exc.value.code) == (400, "model_too_large")
    assert "MODEL_MEMORY_BUDGET=8000000" in exc.value.message and "tiny-b needs" in exc.value.message
    assert (r.slots, r.loads, r.refused) == ({}, 0, 1)


def test_idle_models_leave_after_the_ttl_and_pinned_ones_stay(tmp_path, models_dir):
    r = RouterProc(tmp_path, models_dir, MODEL_IDLE_TTL_SECONDS="2", MODEL_PIN="tiny-b",
                   MODEL_MEMORY_BUDGET=str(8 << 30), MODEL_PROCESS_BYTES="0")
    try:
        assert "tiny-b" in r.resident()                    # pinned: loaded at start
        h = r.health()                                     # a server's own memory, measured at its load
        assert h["process_bytes_per_model"] > 0
        pinned = {m["model"]: m["bytes"] for m in h["models"]}["tiny-b"]      # loaded last: the largest measure
        assert pinned == weights(models_dir, "tiny-b") + KV + h["process_bytes_per_model"]
        idled = r.health()["unloads_total"]["idle"]       # 1 if the preloaded main model idled out already
        assert r.chat("tiny-a")[0] == 200
        used = time.monotonic()
        pid = {m["model"]: m["pid"] for m in r.health()["models"]}["tiny-a"]
        while "tiny-a" in [m["model"] for m in r.health()["models"]]:    # ready, then unloading, then gone
            assert time.monotonic() < used + 30
            time.sleep(0.2)
        assert time.monotonic() - used >= 2.0             # not before its TTL
        h = r.health()
        assert r.resident() == ["tiny-b"] and not alive(pid)
        assert h["unloads_total"]["idle"] == idled + 1
        time.sleep(2.5)
        assert r.resident() == ["tiny-b"]                 # a pin outlives the TTL
        status, body, _ = r.chat("tiny-a")                # loaded again on demand
        assert status == 200
    finally:
        r.close()


# ============================================================================ a repo id from the hub
HUB_REPO = "tiny-org/tiny-d"


@pytest.fixture(scope="module")
def local_hub(models_dir):
    from tests.hub_server import HubServer

    big = {"config.json": (models_dir / "tiny-b" / "config.json").read_bytes(), "model.safetensors": b"\0" * (64 << 20)}
    server = HubServer({HUB_REPO: models_dir / "tiny-b", "tiny-org/too-big": big,
                        "tiny-org/torch-only": {"config.json": b"{}", "pytorch_model.bin": b"\0" * 64}})
    yield server
    server.close()


def test_a_repo_id_is_fetched_on_first_use_and_sized_before_it(tmp_path, models_dir, local_hub):
    need = weights(models_dir, "tiny-a") + KV + PROC
    r = RouterProc(tmp_path, models_dir, MODEL_MEMORY_BUDGET=str(2 * need + need // 2), HF_ENDPOINT=local_hub.url,
                   HF_HUB_OFFLINE="")
    try:
        status, body, _ = r.chat(HUB_REPO)
        assert status == 200 and body["model"] == "tiny-d", body                   # the id its server serves
        got = sorted(p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p, _ in local_hub.requests
                     if m == "GET" and "/resolve/" in p and HUB_REPO in p)
        assert "model.safetensors" in got and "tiny_model_build.json" in got      # the MLX files, once
        assert HUB_REPO in [m["id"] for m in http_json(r.url + "/v1/models")[1]["data"]]   # installed now
        assert r.chat(HUB_REPO)[0] == 200 and r.health()["loads_total"] == 2              # main + the repo: one load
        before = len(local_hub.requests)
        status, body, _ = r.chat("tiny-org/too-big")       # 64 MiB of weights on the hub: refused, nothing fetched
        assert (status, body["error"]["code"]) == (400, "model_too_large")
        assert not [p for m, p, _ in local_hub.requests[before:] if "/resolve/" in p]
        status, body, _ = r.chat("tiny-org/no-such-repo")
        assert (status, body["error"]["code"]) == (404, "model_not_found") and "no model repo" in body["error"]["message"]
        status, body, _ = r.chat("tiny-org/torch-only")
        assert (status, body["error"]["code"]) == (400, "model_not_supported")
        assert r.chat("tiny-a")[0] == 200                  # and the router serves on
    finally:
        r.close()


# ============================================================================ through port 4000
@pytest.mark.e2e
def test_three_models_through_litellm_with_the_openai_sdk(tmp_path, models_dir, embedded_model_path, local_hub,
                                                          monkeypatch):
    openai = pytest.importorskip("openai")
    monkeypatch.setenv("HF_ENDPOINT", local_hub.url)          # the model servers inherit it
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    from tests.test_e2e_stack import KEY, Stack

    need = weights(models_dir, "tiny-a") + KV + PROC
    stack = Stack(tmp_path, str(embedded_model_path.parent), MODELS_DIR=str(models_dir), MODEL_PATH="tiny-a",
                  MODELS_ON_DEMAND="true", MODEL_MEMORY_BUDGET=str(2 * need + need // 2), PROMPT_CACHE_MAX_BYTES=str(KV),
                  MODEL_PROCESS_BYTES=str(PROC), DISK_CACHE_DIR=str(tmp_path / "kv"), HF_HUB_CACHE=str(tmp_path / "hub"), SPECULATIVE="off")
    try:
        client = openai.OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0, timeout=300)
        names = {m.id for m in client.models.list().data}
        assert {"openai/tiny-a", "tiny-a", "tiny-b", "tiny-c"} <= names
        cached = {}
        for model in ["tiny-a", "tiny-b", "tiny-c", "tiny-a"]:
            r = client.chat.completions.create(model=model, messages=MSGS, max_tokens=8, temperature=0)
            assert r.choices[0].message.content is not None
            cached.setdefault(model, []).append(r.usage.prompt_tokens_details.cached_tokens)
        assert cached == {"tiny-a": [0, 20], "tiny-b": [0], "tiny-c": [0]}     # a: unloaded for c, warm from disk
        h = http_json(stack.mlx + "/health")[1]
        assert sorted(m["model"] for m in h["models"]) == ["tiny-a", "tiny-c"]
        assert (h["loads_total"], h["unloads_total"]["room"]) == (4, 2)
        r = client.chat.completions.create(model="claude-haiku-4-5", messages=MSGS, max_tokens=4)   # an alias
        assert r.model in ("claude-haiku-4-5", "tiny-a")
        r = client.chat.completions.create(model=HUB_REPO, messages=MSGS, max_tokens=4)   # any repo id: fetched
        assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1
        with pytest.raises(openai.NotFoundError) as exc:             # the front door's 404, listing the models
            client.chat.completions.create(model="tiny-z", messages=MSGS, max_tokens=4)
        assert "tiny-b" in str(exc.value) and exc.value.body["code"] == "model_not_found"
        assert stack.stop() == 0
    finally:
        if stack.proc.poll() is None:
            stack.proc.kill()
