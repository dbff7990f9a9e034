"""Shared pytest fixtures. Each owner keeps their fixtures in their own marked section."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


# ===========================================================================
# Tiny random-weight models and the embedded model (tests/fixtures/tiny_models.py)
# ===========================================================================


def _model_cache_dir() -> Path:
    """Where the converted embedded model lives across test runs."""
    return Path(os.environ.get("MLXSTACK_TEST_MODEL_CACHE", Path.home() / ".cache" / "mlxstack"))


@pytest.fixture(scope="session")
def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct MLX folder converted from the bundled GGUF (cached)."""
    from mlxstack.models.embedded_model import ensure_embedded_model

    return Path(ensure_embedded_model(_model_cache_dir()))


@pytest.fixture(scope="session")
def tiny_dense_path(tmp_path_factory, embedded_model_path) -> Path:
    """qwen3, 2 layers, hidden 64; every cache layer a trimmable KVCache."""
    from tests.fixtures.tiny_models import build_tiny_dense

    return build_tiny_dense(tmp_path_factory.mktemp("tiny_dense"), embedded_model_path)


@pytest.fixture(scope="session")
def tiny_hybrid_path(tmp_path_factory, embedded_model_path) -> Path:
    """qwen3_next, 4 layers: cache [ArraysCache, KVCache, ArraysCache, KVCache]."""
    from tests.fixtures.tiny_models import build_tiny_hybrid

    return build_tiny_hybrid(tmp_path_factory.mktemp("tiny_hybrid"), embedded_model_path)


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory, embedded_model_path) -> Path:
    """qwen2_5_vl with a 2-block vision tower, processor configs included."""
    from tests.fixtures.tiny_models import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), embedded_model_path)


@pytest.fixture(scope="session")
def tiny_dense_hd64_path(tiny_kind_paths) -> Path:
    """qwen3 with head_dim 64: wide enough for KV quantisation groups."""
    return tiny_kind_paths("dense_hd64")


@pytest.fixture(scope="session")
def tiny_kind_paths(tmp_path_factory, embedded_model_path):
    """One tiny model folder per cache kind (built lazily): kind name -> path builder."""
    from tests.fixtures import tiny_models as tm
    from tests.fixtures.tiny_gpt_oss import build_tiny_gpt_oss

    builders = {"dense": tm.build_tiny_dense, "dense_hd64": tm.build_tiny_dense_hd64,
                "llama_hd64": tm.build_tiny_llama_hd64,
                "hybrid": tm.build_tiny_hybrid, "gemma3": tm.build_tiny_gemma3,
                "llama4": tm.build_tiny_llama4, "mamba2": tm.build_tiny_mamba2, "lfm2": tm.build_tiny_lfm2,
                "gpt_oss": build_tiny_gpt_oss}
    built: dict[str, Path] = {}

    def path(kind: str) -> Path:
        if kind not in built:
            built[kind] = builders[kind](tmp_path_factory.mktemp(f"tiny_{kind}"), embedded_model_path)
        return built[kind]

    return path


# ===========================================================================
# (end of tiny model fixtures)
# ===========================================================================


# ===========================================================================
# Engine and live-server helpers (tests/test_engine*.py, tests/test_http*.py)
# ===========================================================================


def unused_port() -> int:
    """A TCP port nothing listens on right now (bound to port 0, then released)."""
    from scripts.probelib.client import free_port

    return free_port()


def unused_ports(n: int, first_run: int = 1) -> list[int]:
    """``n`` distinct free ports, bound all at once (scripts/probelib/client.py ``free_ports``)."""
    from scripts.probelib.client import free_ports

    return free_ports(n, first_run)


def engine_settings(model_path: Path | str | None = None, **overrides):
    """Settings for tests: deterministic sampling, no request logs unless asked."""
    from mlxstack.config.settings import load_settings

    env = {
        "MODEL_PATH": str(model_path or ""),
        "MODEL_CACHE_DIR": str(_model_cache_dir()),
        "DEFAULT_TEMPERATURE": "0",
        "DEFAULT_REPETITION_PENALTY": "1.0",
        "DEFAULT_THINKING": "false",
        "ENABLE_REQUEST_LOGGING": "false",
        "MLX_PORT": "0",
        "DISK_CACHE_DIR": "off",   # tests that want the disk tier point it at a tmp folder
        "SPEC_CALIBRATE": "off",   # ~2 s a load on the embedded model; test_speculation.py turns it on
        "PRIORITY_DECODE_SHARE": "0",   # rows beside an urgent one from measured step times: tests freeze them (test_priority.py)
    }
    env.update({k.upper(): str(v) for k, v in overrides.items()})
    return load_settings(env=env)


def build_engine(settings):
    """An engine (ChatEngine, or VLMChatEngine for a VLM) for driving run() on the test thread."""
    from mlxstack.engine.factory import make_engine
    from mlxstack.models.loader import load_model

    return make_engine(load_model(settings), settings)


class LiveServer:
    """A real MLX server (App + ThreadingHTTPServer) on a free port, in this process."""

    def __init__(self, settings):
        import threading

        from mlxstack.server.app import App, make_server

        self.app = App(settings)
        self.httpd = make_server(self.app, "127.0.0.1", 0)
        self.port = self.httpd.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.app.start_loading().result(timeout=300)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.app.close()


def sse_events(raw: str) -> list[tuple[str, dict]]:
    """A named-event SSE body (Anthropic / Responses streams) as (event, data) pairs."""
    import json

    out = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def blas_preload_missing() -> str | None:
    """Why this process has no optimised BLAS preloaded for MLX, or None. The host path
    (backends/cpu/host_forward.py) is off without one, by design; LD_PRELOAD is read at exec only,
    so a plain ``pytest`` runs without it and the test runner (mlxstack.launcher.test_runner)
    re-executes with it. A BLAS named in LD_PRELOAD counts as present even when it did not take:
    the tests that need it then fail, as they must."""
    from mlxstack.system.blas import INSTALL_HINT, find_optimized_blas, optimized_blas_active, preloaded_blas

    if optimized_blas_active() or preloaded_blas():
        return None
    lib = find_optimized_blas()
    if lib is None:
        return f"no optimised BLAS installed here, so the host path is off ({INSTALL_HINT})"
    return (f"no optimised BLAS preloaded in this process (LD_PRELOAD, read at exec), so the host path is off: "
            f"run the tests through `python -m mlxstack.launcher.test_runner`, which preloads {lib}")


def http_json(url: str, body=None, headers=None, method=None, timeout=120):
    """(status, parsed JSON or raw text, headers) with no exception for 4xx/5xx."""
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, hdrs = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        raw, status, hdrs = err.read(), err.code, dict(err.headers)
    try:
        return status, json.loads(raw), hdrs
    except ValueError:
        return status, raw.decode("utf-8", "replace"), hdrs


@pytest.fixture(scope="session")
def embedded_server(embedded_model_path, tmp_path_factory):
    """One live MLX server on the embedded SmolLM2 model, shared by HTTP tests."""
    server = LiveServer(engine_settings(None, log_root=str(tmp_path_factory.mktemp("logs"))))
    yield server
    server.close()


# ===========================================================================
# (end of engine and live-server helpers)
# ===========================================================================


# ===========================================================================
# Test tiers: the e2e and slow markers (pytest.ini, docs/testing.md)
# ===========================================================================

# Fixtures that start a real stack (LiteLLM in front of MLX server processes): every test that uses
# one is e2e, whichever module it lives in. Modules that are e2e or slow throughout say so with
# ``pytestmark``; this covers the in-process modules with a stack section at their end.
STACK_FIXTURES = frozenset({"stack", "vlm_stack", "hybrid_stack"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if STACK_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


# ===========================================================================
# (end of test tiers)
# ===========================================================================


@pytest.fixture(scope="module")
def oai(stack):
    """The official openai SDK against the module's ``stack`` (tests/test_e2e_stack.Stack and its key)."""
    openai = pytest.importorskip("openai")
    from tests.test_e2e_stack import KEY

    return openai.OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(stack):
    """The official anthropic SDK against the module's ``stack``."""
    anthropic = pytest.importorskip("anthropic")
    from tests.test_e2e_stack import KEY

    return anthropic.Anthropic(base_url=stack.base, api_key=KEY, max_retries=0, timeout=300)
