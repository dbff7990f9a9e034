"""Backends as configuration (launcher/backends.py), the LiteLLM config for several backends
(launcher/litellm_config.py) and supervising several local servers (launcher/stack.py).
The whole stack with two replicas and two models is in tests/test_e2e_scaleout.py."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
import yaml

from mlxstack.config.settings import load_settings
from mlxstack.launcher import litellm_config as lc
from mlxstack.launcher.backends import (Backend, BackendsError, load_backends, model_groups, parse_backends,
                                        replica_backends)

REPO = Path(__file__).resolve().parents[1]


def _settings(**env):
    base = {"MLX_PORT": "9000", "PROXY_PORT": "4000", "MODEL_CACHE_DIR": "/models/cache"}
    return load_settings(env={**base, **{k.upper(): str(v) for k, v in env.items()}})


# --- MLX_REPLICAS (.env alone) -------------------------------------------------------------------
def test_replicas_from_env_get_consecutive_ports_and_their_own_disk_tier():
    s = _settings(mlx_replicas=3, model_path="/models/qwen", mlx_api_key="sk-k")
    backends = replica_backends(s)
    assert [b.name for b in backends] == ["mlx:9000", "mlx:9001", "mlx:9002"]
    assert [b.url for b in backends] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert [b.settings().mlx_port for b in backends] == [9000, 9001, 9002]
    assert {b.settings().model_path for b in backends} == {"/models/qwen"}
    assert {b.api_key for b in backends} == {"sk-k"} and {b.entry for b in backends} == {0}
    # one disk tier per process (it is locked per model): the first keeps the configured one
    assert [b.env["DISK_CACHE_DIR"] for b in backends] == [
        "auto", "/models/cache/kv/replica-9001", "/models/cache/kv/replica-9002"]
    off = replica_backends(_settings(mlx_replicas=2, disk_cache_dir="off"))
    assert [b.env["DISK_CACHE_DIR"] for b in off] == ["off", "off"]


def test_one_backend_keeps_the_single_stack_names_and_settings():
    s = _settings(model_path="/m/x")
    (b,) = replica_backends(s)
    assert (b.name, b.url, b.local, b.port) == ("mlx", "http://127.0.0.1:9000", True, 9000)
    assert b.settings() == s


def test_replicas_need_a_fixed_port():
    with pytest.raises(BackendsError, match="replicas need a fixed port"):
        replica_backends(_settings(mlx_replicas=2, mlx_port=0))


# --- the backends file ---------------------------------------------------------------------------
FILE = """
backends:
  - model_path: ""
    replicas: 2
    env: {PROMPT_CACHE_MAX_BYTES: 123456789, healing_store: false}
  - model_path: /models/small
    aliases: [small-fast, titles]
  - url: http://studio.local:8080
    api_key: os.environ/STUDIO_KEY
  - url: https://box:9443/
    api_key: sk-literal
    model: big-coder
"""


def test_backends_file_locals_remotes_ports_keys_and_per_backend_settings():
    s = _settings(mlx_api_key="sk-local")
    backends = parse_backends(yaml.safe_load(FILE), s, environ={"STUDIO_KEY": "sk-studio"})
    assert [(b.name, b.url, b.local, b.entry) for b in backends] == [
        ("mlx:9000", "http://127.0.0.1:9000", True, 0), ("mlx:9001", "http://127.0.0.1:9001", True, 0),
        ("mlx:9002", "http://127.0.0.1:9002", True, 1),
        ("remote:studio.local:8080", "http://studio.local:8080", False, 2),
        ("remote:box:9443", "https://box:9443", False, 3)]
    assert [b.api_key for b in backends] == ["sk-local", "sk-local", "sk-local", "sk-studio", "sk-literal"]
    first, small = backends[0].settings(), backends[2].settings()
    assert (first.prompt_cache_max_bytes, first.healing_store, first.model_path) == (123456789, False, "")
    assert (small.prompt_cache_max_bytes, small.healing_store, small.model_path) == (0, True, "/models/small")
    assert backends[2].aliases == ("small-fast", "titles") and backends[4].model == "big-coder"


@pytest.mark.parametrize("text, message", [
    ("backends: []", "expected a top-level 'backends:' list"),
    ("backends:\n  - {model_path: a, replica: 2}", "unknown key(s) replica; allowed:"),
    ("backends:\n  - {model_path: a, env: {PROMPT_CACHE_MAX_BYTE: 1}}", "(did you mean PROMPT_CACHE_MAX_BYTES?)"),
    ("backends:\n  - {model_path: a, env: {MLX_PORT: 1}}", "set MLX_PORT with the entry's own key (port)"),
    ("backends:\n  - {model_path: a, port: 9100}\n  - {model_path: b, port: 9100}", "port(s) 9100 are given to more than one"),
    ("backends:\n  - {model_path: a, port: 4000}", "port 4000 is PROXY_PORT"),
    ("backends:\n  - {url: 'http://h:1', port: 5}", "port only apply to local backends"),
    ("backends:\n  - {url: 'h:1'}", "url must look like http://host:port"),
    ("backends:\n  - {url: 'http://h:1', api_key: os.environ/NOPE_KEY}", "NOPE_KEY, which is not set. export NOPE_KEY="),
    ("backends:\n  - {model_path: a, replicas: 0}", "replicas must be an integer >= 1, got 0"),
    ("backends:\n  - {model_path: a, aliases: [1]}", "aliases must be a list of model names"),
    ("backends:\n  - {url: 'http://h:1'}\n  - {url: 'http://h:1'}", "http://h:1 is listed twice"),
])
def test_backends_file_errors_say_how_to_fix(text, message):
    with pytest.raises(BackendsError) as err:
        parse_backends(yaml.safe_load(text), _settings(), environ={})
    assert message in str(err.value)


def test_load_backends_reads_the_file_or_falls_back_to_replicas(tmp_path):
    s = _settings(backends_file=str(tmp_path / "backends.yaml"), mlx_replicas=2)
    assert [b.port for b in load_backends(s, tmp_path)] == [9000, 9001]          # no file: MLX_REPLICAS
    (tmp_path / "backends.yaml").write_text("backends:\n  - {model_path: /m, port: 9300}\n")
    with pytest.raises(BackendsError, match="MLX_REPLICAS=2 and .* both say how many backends"):
        load_backends(s, tmp_path)
    assert [b.name for b in load_backends(s.replace(mlx_replicas=1), tmp_path)] == ["mlx"]
    rel = _settings(backends_file="conf/b.yaml")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "b.yaml").write_text("backends: [{model_path: /m}, {model_path: /n}]\n")
    assert [b.port for b in load_backends(rel, tmp_path)] == [9000, 9001]
    (tmp_path / "conf" / "b.yaml").write_text("backends: [\n")
    with pytest.raises(BackendsError, match="cannot read it as YAML"):
        load_backends(rel, tmp_path)


# --- model names ---------------------------------------------------------------------------------
def _b(url, aliases=(), model=""):
    return Backend(url.rsplit(":", 1)[1], url, not model, 0, aliases=tuple(aliases), model=model)


def test_model_groups_come_from_what_each_backend_serves():
    a, b, c, d = _b("http://h:1"), _b("http://h:2", ["small-fast"]), _b("http://h:3"), _b("http://r:9", model="big")
    discovered = {"http://h:1": ("Qwen3-4B", 32768), "http://h:2": ("Smol", 8192), "http://h:3": ("Qwen3-4B", 16384),
                  "http://r:9": None}
    groups = model_groups([a, b, c, d], discovered)
    assert [(g.model_id, g.names, [x.url for x in g.backends], g.context_window) for g in groups] == [
        ("Qwen3-4B", ("openai/Qwen3-4B", "Qwen3-4B"), ["http://h:1", "http://h:3"], 16384),
        ("Smol", ("openai/Smol", "Smol", "small-fast"), ["http://h:2"], 8192),
        ("big", ("openai/big", "big"), ["http://r:9"], None)]
    renamed = model_groups([a, b], discovered, proxy_model_id="local/qwen")
    assert [g.names for g in renamed] == [("local/qwen", "Qwen3-4B"), ("openai/Smol", "Smol", "small-fast")]
    assert model_groups([_b("http://x:1")], {"http://x:1": None}) == []       # unreachable, no model: left out
    with pytest.raises(BackendsError, match="'Smol' is claimed by both Qwen3-4B and Smol"):
        model_groups([_b("http://h:1", ["Smol"]), b], discovered)


# --- LiteLLM config ------------------------------------------------------------------------------
def test_backend_keys_are_referenced_never_written():
    s = _settings(mlx_api_key="sk-local")
    backends = [Backend("a", "http://h:1", True, 0, api_key="sk-local"), Backend("b", "http://r:2", False, 1, api_key="sk-own"),
                Backend("c", "http://r:3", False, 2, api_key="")]
    refs, env = lc.backend_key_refs(s, backends)
    assert refs == {"http://h:1": "os.environ/MLX_API_KEY", "http://r:2": "os.environ/MLXSTACK_BACKEND_KEY_1",
                    "http://r:3": "none"}
    assert env == {"MLXSTACK_BACKEND_KEY_1": "sk-own"}


@pytest.mark.parametrize("routing", ["cache_aware", "affinity", "shuffle"])
def test_stack_config_lists_every_backend_under_every_name(routing):
    s = _settings(routing=routing, mlx_api_key="sk-local", proxy_request_timeout_seconds=77, model_aliases="off")
    backends = [Backend("mlx:1", "http://127.0.0.1:1", True, 0, api_key="sk-local"),
                Backend("mlx:2", "http://127.0.0.1:2", True, 0, api_key="sk-local"),
                Backend("remote", "http://r:3", False, 1, api_key="sk-remote", aliases=("small-fast",))]
    groups = model_groups(backends, {"http://127.0.0.1:1": ("big", 4096), "http://127.0.0.1:2": ("big", 4096),
                                     "http://r:3": ("small", 2048)})
    text = lc.render_yaml(lc.build_stack_config(s, groups))
    assert "sk-local" not in text and "sk-remote" not in text
    cfg = yaml.safe_load(text)
    rows = [(m["model_name"], m["litellm_params"]["model"], m["litellm_params"]["api_base"],
             m["litellm_params"]["api_key"], m["model_info"]["mlx_backend"]) for m in cfg["model_list"]]
    assert rows == [
        ("openai/big", "hosted_vllm/big", "http://127.0.0.1:1/v1", "os.environ/MLX_API_KEY", "http://127.0.0.1:1"),
        ("openai/big", "hosted_vllm/big", "http://127.0.0.1:2/v1", "os.environ/MLX_API_KEY", "http://127.0.0.1:2"),
        ("big", "hosted_vllm/big", "http://127.0.0.1:1/v1", "os.environ/MLX_API_KEY", "http://127.0.0.1:1"),
        ("big", "hosted_vllm/big", "http://127.0.0.1:2/v1", "os.environ/MLX_API_KEY", "http://127.0.0.1:2"),
        ("openai/small", "hosted_vllm/small", "http://r:3/v1", "os.environ/MLXSTACK_BACKEND_KEY_2", "http://r:3"),
        ("small", "hosted_vllm/small", "http://r:3/v1", "os.environ/MLXSTACK_BACKEND_KEY_2", "http://r:3"),
        ("small-fast", "hosted_vllm/small", "http://r:3/v1", "os.environ/MLXSTACK_BACKEND_KEY_2", "http://r:3")]
    assert {m["model_info"]["max_input_tokens"] for m in cfg["model_list"][:4]} == {4096}
    assert {m["litellm_params"]["timeout"] for m in cfg["model_list"]} == {77.0}
    router, settings = cfg["router_settings"], cfg["litellm_settings"]
    assert router["retry_policy"]["DefaultRetries"] == 1 and router["retry_policy"]["TimeoutErrorRetries"] == 0
    assert router["retry_policy"]["InternalServerErrorRetries"] == (1 if routing == "cache_aware" else 0)
    assert settings["num_retries"] == 0
    assert "pass_through_endpoints" not in cfg["general_settings"]
    if routing == "cache_aware":
        assert settings["callbacks"] == [lc.FRONT_DOOR_HOOK, lc.ROUTING_HOOK] and router["disable_cooldowns"] is True
        assert router["routing_strategy"] == "simple-shuffle" and "optional_pre_call_checks" not in router
    elif routing == "affinity":
        assert settings["callbacks"] == [lc.FRONT_DOOR_HOOK, lc.ROUTING_HOOK] and router["routing_strategy"] == "least-busy"
        assert router["optional_pre_call_checks"] == ["session_affinity"]
        assert router["deployment_affinity_ttl_seconds"] == 3600 and "disable_cooldowns" not in router
    else:
        assert settings["callbacks"] == [lc.FRONT_DOOR_HOOK] and router["routing_strategy"] == "simple-shuffle"


def test_litellm_env_for_several_backends_carries_the_hook_settings():
    from mlxstack.launcher.stack import litellm_env

    s = _settings(mlx_api_key="sk-local", litellm_master_key="sk-master", routing="affinity",
                  routing_affinity_ttl_seconds=60, strip_billing_header=False)
    backends = [Backend("a", "http://h:1", True, 0, api_key="sk-local"), Backend("b", "http://r:2", False, 1, api_key="sk-own")]
    env = litellm_env(s, backends, REPO)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert (env["ROUTING"], env["ROUTING_AFFINITY_TTL_SECONDS"], env["STRIP_BILLING_HEADER"]) == ("affinity", "60.0", "false")
    assert (env["MLX_API_KEY"], env["MLXSTACK_BACKEND_KEY_1"]) == ("sk-local", "sk-own")
    assert "ROUTING" not in litellm_env(s) or litellm_env(s)["ROUTING"] == os.environ.get("ROUTING")


def test_stack_ready_text_names_every_model_and_backend():
    from mlxstack.launcher.stack import stack_ready_text

    s = _settings(litellm_master_key="sk-master-abcdefghijklmnop", proxy_port=4100)
    backends = [Backend("mlx:9000", "http://127.0.0.1:9000", True, 0), Backend("remote:r:9", "http://r:9", False, 1,
                                                                               aliases=("small-fast",))]
    text = stack_ready_text(s, model_groups(backends, {"http://127.0.0.1:9000": ("big", None), "http://r:9": ("small", None)}))
    lines = text.splitlines()
    assert lines[0] == "READY  proxy http://127.0.0.1:4100/v1  models big, small  |  routing cache_aware"
    assert lines[1] == "  model openai/big or big: 1 backend(s)"
    assert lines[2].split() == ["mlx:9000", "http://127.0.0.1:9000/v1", "dashboard", "http://127.0.0.1:9000/dashboard"]
    assert lines[3] == "  model openai/small or small or small-fast: 1 backend(s)"
    assert lines[4].split() == ["remote:r:9", "http://r:9/v1", "(remote)"]
    assert "sk-master-abcdefghijklmnop" not in text and "sk-mas…nop" in text


# --- supervising several local servers -----------------------------------------------------------
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_a_backend_that_cannot_be_restarted_is_left_down_while_the_others_serve(tmp_path):
    """Three real child processes: mlx:1 crash-loops (no restarts allowed) and is left down with a
    loud line while mlx:2 keeps running; when mlx:2 gives up too nothing serves, and the stack stops."""
    from mlxstack.launcher.restarts import RestartPolicy
    from mlxstack.launcher.stack import LocalServer, supervise_all
    from mlxstack.launcher.supervisor import Supervisor

    out = StringIO()
    sup = Supervisor(out)
    s = _settings()
    servers = {}
    for name in ("mlx:1", "mlx:2"):
        child = sup.start(name, SLEEPER, os.environ)
        servers[name] = LocalServer(name, s, tmp_path / f"{name}.pid", RestartPolicy(0, 600), child=child)
    try:
        runner = threading.Thread(target=supervise_all, args=(sup, servers, SLEEPER, REPO, sup.say))
        runner.start()
        os.kill(servers["mlx:1"].child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while "It stays down" not in out.getvalue():
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.1)
        assert runner.is_alive() and servers["mlx:2"].child.poll() is None
        assert ("ERROR: the MLX server mlx:1 crashed again (killed by SIGKILL) after 0 restart(s) within 600s: a crash "
                "loop (MLX_MAX_RESTARTS=0, MLX_RESTART_WINDOW_SECONDS). It stays down; still serving: mlx:2.") in out.getvalue()
        os.kill(servers["mlx:2"].child.pid, signal.SIGKILL)
        runner.join(timeout=20)
        assert not runner.is_alive()
        assert "ERROR: the MLX server mlx:2 crashed again" in out.getvalue()
        assert out.getvalue().rstrip().endswith("Stopping the stack; see the MLX output above for the cause.")
    finally:
        sup.stop_all(grace=1.0)


def test_litellm_dying_stops_supervision_of_several_servers(tmp_path):
    from mlxstack.launcher.restarts import RestartPolicy
    from mlxstack.launcher.stack import LocalServer, supervise_all
    from mlxstack.launcher.supervisor import Supervisor

    out = StringIO()
    sup = Supervisor(out)
    servers = {n: LocalServer(n, _settings(), tmp_path / f"{n}.pid", RestartPolicy(5, 600), child=sup.start(n, SLEEPER, os.environ))
               for n in ("mlx:1", "mlx:2")}
    proxy = sup.start("litellm", [sys.executable, "-c", "import sys; sys.exit(7)"], os.environ)
    try:
        supervise_all(sup, servers, SLEEPER, REPO, sup.say)
        assert f"litellm (pid {proxy.pid}) stopped unexpectedly: exit code 7. Stopping the stack." in out.getvalue()
        assert all(s.child.poll() is None for s in servers.values())
    finally:
        sup.stop_all(grace=1.0)


@pytest.mark.e2e
def test_restart_of_one_backend_never_touches_the_other(tmp_path, embedded_model_path):
    """kill -9 of one of two real MLX servers: it alone is restarted on its held port (new pid,
    ready), the other keeps its pid and answers throughout."""
    from mlxstack.launcher.restarts import RestartPolicy
    from mlxstack.launcher.stack import LocalServer, _spawn_mlx, get_json, supervise_all, wait_ready, _mlx_probe
    from mlxstack.launcher.supervisor import Supervisor
    from mlxstack.system.listen_socket import listen_socket
    from tests.conftest import unused_port

    out = StringIO()
    sup = Supervisor(out)
    cmd = [sys.executable, "-m", "mlxstack.serve"]
    servers = {}
    for _ in range(2):
        port = unused_port()
        s = load_settings(env={"MLX_PORT": str(port), "ENABLE_REQUEST_LOGGING": "false", "LOG_ROOT": str(tmp_path),
                               "MODEL_CACHE_DIR": str(embedded_model_path.parent), "DISK_CACHE_DIR": "off"})
        server = LocalServer(f"mlx:{port}", s, tmp_path / f".mlx-{port}.pid", RestartPolicy(3, 600, base=0.2),
                             listen_socket("127.0.0.1", port))
        server.child = _spawn_mlx(sup, server.name, s, cmd, REPO, server.pidfile, server.listen)
        servers[server.name] = server
    try:
        for server in servers.values():
            wait_ready(server.child, _mlx_probe(lc.mlx_base_url(server.settings)), 300, server.name, sup.say)
        victim, other = list(servers.values())
        first_pid, other_pid = victim.child.pid, other.child.pid
        runner = threading.Thread(target=lambda: supervise_all(sup, servers, cmd, REPO, sup.say, interval=0.1), daemon=True)
        runner.start()
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while f"MLX server {victim.name} restarted" not in out.getvalue():
            assert time.monotonic() < deadline, out.getvalue()[-3000:]
            assert get_json(lc.mlx_base_url(other.settings) + "/health")[0] == 200
            time.sleep(0.2)
        assert victim.child.pid != first_pid and int(victim.pidfile.read_text()) == victim.child.pid
        assert other.child.pid == other_pid and other.child.poll() is None
        assert f"!! MLX SERVER {victim.name} DIED (pid {first_pid}, killed by SIGKILL). Restart 1 of at most 3" in out.getvalue()
        assert f"MLX SERVER {other.name} DIED" not in out.getvalue()
    finally:
        sup.start("litellm", [sys.executable, "-c", "pass"], os.environ)  # its exit ends supervise_all
        time.sleep(0.5)
        sup.stop_all(grace=2.0)
        for server in servers.values():
            server.listen.close()


def test_the_example_backends_file_parses_as_documented():
    data = yaml.safe_load((REPO / "backends.example.yaml").read_text())
    backends = parse_backends(data, _settings(mlx_port=8080), environ={})
    assert [(b.name, b.port, b.aliases) for b in backends] == [
        ("mlx:8080", 8080, ()), ("mlx:8081", 8081, ()), ("mlx:8090", 8090, ("small-fast",))]
    assert [b.settings().max_kv_size for b in backends] == [65536, 65536, 0]
    assert backends[0].settings().model_path == "/models/Qwen3-Coder-30B-A3B-Instruct-4bit"
