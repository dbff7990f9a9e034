"""Models from a Hugging Face hub (mlxstack/models/hub.py, catalog.py; ``mlxstack pull`` / ``models``)
against a real hub protocol: tests/hub_server.py serves the tiny dense fixture model in the URL shapes
huggingface_hub uses, on a free port; HF_ENDPOINT points at it and HF_HUB_CACHE at a tmp folder.

Proves: only the files MLX loads are fetched (never the .bin / .gguf / .onnx beside them); a broken
connection is resumed with a Range request and the file is whole; a rerun fetches only what is missing;
a short disk, an unreachable hub, an unknown repo and the user's HF_HUB_OFFLINE are each one clear
error before any file is fetched; ``mlxstack models`` lists the pulled repo with its columns; and a
real ``python -m mlxstack.serve`` with MODEL_PATH=<repo id> not cached downloads it at load -- /health
reporting the fetch in the middle -- then answers, and ``mlxstack models`` marks it resident."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from mlxstack import cli
from mlxstack.models import hub
from tests.conftest import http_json, unused_port
from tests.hub_server import HubServer

REPO = "tiny-org/tiny-dense"
MLX_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
OTHER_FILES = {"pytorch_model.bin": b"\0" * 4096, "model.gguf": b"GGUF" + b"\0" * 1020,
               "onnx/model.onnx": b"\0" * 512, "flax_model.msgpack": b"\0" * 256, "README.md": b"# tiny dense\n"}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def repo_files(tiny_dense_path):
    files = {p.name: p.read_bytes() for p in tiny_dense_path.iterdir() if p.name in MLX_FILES}
    assert set(files) == MLX_FILES and len(files["model.safetensors"]) > 10 * 2 ** 20   # > one download chunk
    return {**files, **OTHER_FILES}


@pytest.fixture(autouse=True)
def idle_progress():
    """PROGRESS is the process's: left idle, so servers other tests start here report no fetch."""
    yield
    hub.PROGRESS.reset()


@pytest.fixture
def local_hub(repo_files, tmp_path, monkeypatch):
    server = HubServer({REPO: repo_files, "tiny-org/torch-only": {"config.json": b"{}",
                                                                  "pytorch_model.bin": b"\0" * 64}})
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", hub.OFFLINE_DEFAULTED, "HF_HOME", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    yield server
    server.close()


def fetched(server: HubServer) -> list[str]:
    """The files whose bytes were requested (GET of a resolve URL)."""
    return [path.split("/resolve/", 1)[1].split("/", 1)[1] for method, path, _ in server.requests
            if method == "GET" and "/resolve/" in path]


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_pull_fetches_only_the_files_mlx_loads(local_hub, repo_files, tmp_path):
    code, out, err = run_cli("pull", REPO)
    assert code == 0, err
    snapshot = Path(out.strip())
    assert snapshot.parent.name == "snapshots" and snapshot.name == local_hub.sha(REPO)
    on_disk = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    assert on_disk == MLX_FILES
    assert sorted(fetched(local_hub)) == sorted(MLX_FILES)        # no .bin / .gguf / .onnx / .msgpack request
    for name in MLX_FILES:
        assert (snapshot / name).read_bytes() == repo_files[name]
    state = hub.PROGRESS.snapshot()
    total = sum(len(repo_files[name]) for name in MLX_FILES)
    assert state["state"] == "done" and state["repo"] == REPO and state["bytes_total"] == total
    assert state["bytes_done"] == total and state["files"] == len(MLX_FILES)
    # cached now: a second pull asks the hub for the revision only, fetches no file
    before = len(fetched(local_hub))
    assert run_cli("pull", REPO)[0] == 0 and len(fetched(local_hub)) == before


def test_a_broken_download_is_resumed_with_a_range_request(local_hub, repo_files):
    local_hub.drop_once[(REPO, "model.safetensors")] = 11 * 2 ** 20      # one 10 MiB chunk written, then cut
    path = hub.fetch(REPO, console=False)
    ranges = [r for method, p, r in local_hub.requests if method == "GET" and p.endswith("/model.safetensors")]
    assert ranges == [None, f"bytes={10 * 2 ** 20}-"]                   # the rest only, not the whole file again
    assert (path / "model.safetensors").read_bytes() == repo_files["model.safetensors"]


def test_a_rerun_fetches_only_the_files_still_missing(local_hub, repo_files):
    path = hub.fetch(REPO, console=False)
    (path / "tokenizer.json").unlink()
    blob = [b for b in (path.parents[1] / "blobs").iterdir() if b.read_bytes() == repo_files["tokenizer.json"]]
    blob[0].unlink()
    before = len(fetched(local_hub))
    hub.fetch(REPO, console=False)
    assert fetched(local_hub)[before:] == ["tokenizer.json"]
    assert hub.PROGRESS.snapshot()["bytes_total"] == len(repo_files["tokenizer.json"])


def test_a_short_disk_is_refused_before_any_file_is_fetched(local_hub, repo_files, monkeypatch):
    monkeypatch.setattr(hub, "disk_free", lambda path: 1 << 20)
    code, out, err = run_cli("pull", REPO)
    assert code == 1 and not out
    need = sum(len(repo_files[name]) for name in MLX_FILES)
    assert f"its 5 missing files need {hub.gib(need)} and " in err and "has 0.00 GiB free" in err
    assert "HF_HUB_CACHE" in err and fetched(local_hub) == []
    assert hub.PROGRESS.snapshot()["state"] == "failed"


def test_an_unreachable_hub_is_one_error_naming_the_repo_and_the_endpoint(local_hub, monkeypatch):
    endpoint = f"http://127.0.0.1:{unused_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    code, out, err = run_cli("pull", REPO)
    assert code == 1 and not out
    lines = [line for line in err.splitlines() if line.startswith("mlxstack pull:")]
    assert len(lines) == 1, err
    assert (f"cannot download {REPO}: the Hugging Face hub at {endpoint} (HF_ENDPOINT) cannot be reached "
            "(ConnectError") in lines[0]


def test_unknown_repos_revisions_and_torch_only_repos_are_refused(local_hub):
    with pytest.raises(hub.FetchError, match=r"has no model repo of that name .*HF_TOKEN"):
        hub.fetch("tiny-org/nothing", console=False)
    with pytest.raises(hub.FetchError, match=r"has no revision 'v9' of it"):
        hub.fetch(REPO, "v9", console=False)
    with pytest.raises(hub.FetchError, match=r"no \.safetensors weights .*mlx-community"):
        hub.fetch("tiny-org/torch-only", console=False)
    assert fetched(local_hub) == []
    assert run_cli("pull", "./not-a-repo")[0] == 2


def test_the_users_offline_switch_is_obeyed_and_the_stacks_own_is_lifted(local_hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hub.FetchError, match="HF_HUB_OFFLINE=1 is set, so it cannot be downloaded"):
        hub.fetch(REPO, console=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    from mlxstack.models.loader import hf_offline_env

    hf_offline_env()              # what the server does: offline, and says the switch is its own
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ[hub.OFFLINE_DEFAULTED] == "1"
    assert (hub.fetch(REPO, console=False) / "config.json").is_file()
    assert constants.HF_HUB_OFFLINE is True                    # back on once the fetch is over


def test_model_fetch_off_names_pull(local_hub):
    from mlxstack.config.settings import load_settings
    from mlxstack.models.loaded import ModelLoadError
    from mlxstack.models.loader import local_model_folder

    settings = load_settings(env={"MODEL_PATH": REPO, "MODEL_FETCH": "false"})
    with pytest.raises(ModelLoadError, match=rf"MODEL_FETCH=false: download it with 'mlxstack pull {REPO}'"):
        local_model_folder(REPO, "MODEL_PATH", "", settings)
    assert fetched(local_hub) == []
    path, name = local_model_folder(REPO, "MODEL_PATH", "", settings.replace(model_fetch=True))
    assert name == "tiny-dense" and (path / "model.safetensors").is_file()


def test_models_lists_the_hub_cache_and_models_dir(local_hub, tiny_dense_path, tmp_path, monkeypatch):
    assert run_cli("pull", REPO)[0] == 0
    models_dir = tmp_path / "models"
    (models_dir / "mine").mkdir(parents=True)
    for name in MLX_FILES:
        (models_dir / "mine" / name).symlink_to(tiny_dense_path / name)
    config = json.loads((tiny_dense_path / "config.json").read_text())
    config["quantization"] = {"bits": 4, "group_size": 64}
    (models_dir / "mine" / "config.json").unlink()
    (models_dir / "mine" / "config.json").write_text(json.dumps(config))
    (models_dir / "not-a-model").mkdir()
    (tmp_path / "hf-cache" / "models--other--tokenizer-only" / "snapshots" / "abc").mkdir(parents=True)
    monkeypatch.setenv("MODELS_DIR", str(models_dir))
    monkeypatch.setenv("MODEL_CACHE_DIR", str(tmp_path / "no-embedded"))
    monkeypatch.setenv("MLX_PORT", str(unused_port()))
    code, out, err = run_cli("models")
    assert code == 0, err
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["NAME", "FAMILY", "SIZE", "CONTEXT", "QUANT", "RESIDENT"]
    assert rows[1][:2] == ["mine", "qwen3"] and rows[1][4:] == ["4096", "4-bit", "g64", "no"]
    assert rows[2][:2] == [REPO, "qwen3"] and rows[2][4:] == ["4096", "float32", "no"]
    from mlxstack.models.catalog import human_size

    pulled = sum(len(local_hub.repos[REPO][name]) for name in MLX_FILES)
    assert " ".join(rows[2][2:4]) == human_size(pulled)
    assert len(rows) == 3                     # neither the tokenizer-only repo nor the folder without config


def test_the_launchers_start_up_limit_does_not_count_a_download_in_progress():
    from mlxstack.launcher.stack import LaunchError, wait_ready

    class Child:
        def poll(self):
            return None

    calls = []

    def probe():
        calls.append(1)
        probe.fetching = {"state": "downloading", "repo": REPO, "bytes_done": 1, "bytes_total": 2} \
            if len(calls) < 5 else None
        return {"ready": True} if len(calls) >= 5 else None

    notes: list[str] = []
    assert wait_ready(Child(), probe, 0.4, "MLX server", notes.append) == {"ready": True}   # ~2 s of download
    calls.clear()
    probe.fetching = None

    def loading():
        loading.fetching = None
        return None

    with pytest.raises(LaunchError, match="not ready after 0.4s"):
        wait_ready(Child(), loading, 0.4, "MLX server", notes.append)


# --- a real server fetching its model at load ------------------------------------------------


@pytest.mark.e2e
def test_a_server_fetches_a_missing_repo_at_load_reports_it_and_answers(local_hub, tmp_path, monkeypatch):
    release = threading.Event()
    local_hub.hold[(REPO, "model.safetensors")] = (11 * 2 ** 20, release)
    port = unused_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))}
    env.update({"MODEL_PATH": REPO, "MLX_PORT": str(port), "MLX_HOST": "127.0.0.1", "MLX_API_KEY": "sk-test-hub",
                "DISK_CACHE_DIR": "off", "ENABLE_REQUEST_LOGGING": "false", "SPEC_CALIBRATE": "off",
                "DEFAULT_TEMPERATURE": "0", "DEFAULT_THINKING": "false", "MODEL_CACHE_DIR": str(tmp_path / "mc"),
                "WARM_PROMPTS": "", "BLAS_PRELOAD": "off",
                "HF_HUB_DOWNLOAD_TIMEOUT": "120"})   # the held file waits longer than the 10 s default
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlxstack.serve"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        mid = _wait(lambda: _fetch_state(base), lambda s: s and s["state"] == "downloading"
                    and s["bytes_done"] >= 10 * 2 ** 20, proc, tmp_path, 120)
        status, body, _ = http_json(base + "/health")
        assert status == 503 and body["ready"] is False and body["fetch"]["repo"] == REPO
        assert mid["bytes_total"] == sum(len(local_hub.repos[REPO][n]) for n in MLX_FILES) > mid["bytes_done"]
        release.set()
        _wait(lambda: http_json(base + "/health")[1], lambda b: isinstance(b, dict) and b.get("ready"), proc, tmp_path,
              240)
        status, body, _ = http_json(base + "/health")
        assert body["model"] == "tiny-dense" and body["fetch"]["state"] == "done"
        status, reply, _ = http_json(base + "/v1/chat/completions",
                                     {"model": "tiny-dense", "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "Hello"}]},
                                     headers={"Authorization": "Bearer sk-test-hub"})
        assert status == 200 and reply["choices"][0]["message"]["content"] is not None, reply
        assert reply["usage"]["completion_tokens"] >= 1
        assert sorted(fetched(local_hub)) == sorted(MLX_FILES)
        monkeypatch.setenv("MLX_PORT", str(port))
        monkeypatch.setenv("MODEL_CACHE_DIR", str(tmp_path / "mc"))
        code, out, err = run_cli("models")
        rows = [line.split() for line in out.splitlines()]
        assert code == 0 and [REPO, "yes"] == [rows[1][0], rows[1][-1]], out
    finally:
        release.set()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert "downloading tiny-org/tiny-dense (main) from http://127.0.0.1:" in (tmp_path / "server.log").read_text()


def _fetch_state(base: str):
    try:
        return http_json(base + "/health", timeout=5)[1].get("fetch")
    except Exception:  # noqa: BLE001 - not listening yet
        return None


def _wait(probe, done, proc, tmp_path, limit: float):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = probe()
        if done(value):
            return value
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode}:\n{(tmp_path / 'server.log').read_text()[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out; server log:\n{(tmp_path / 'server.log').read_text()[-4000:]}")
