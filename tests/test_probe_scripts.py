"""The probe / bench scripts in scripts/ and benchmarks/: --help works, diff_turns on synthetic logs,
and one quick end-to-end run of probe_session.py against a freshly started MLX server (embedded model)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tests.conftest import unused_port

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
PROBES = ["scripts/pi_like_probe.py", "scripts/probe_session.py", "scripts/diff_turns.py", "scripts/inspect_mlx_cache.py",
          "scripts/test_openclaw_integration.py", "benchmarks/bench_agents.py", "benchmarks/bench_cache.py"]

sys.path.insert(0, str(SCRIPTS))


def _run(args: list[str], timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("script", PROBES)
def test_help(script: str) -> None:
    proc = _run([str(REPO / script), "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower()


def test_openclaw_harness_not_collected() -> None:
    import test_openclaw_integration as mod

    assert mod.__test__ is False


def test_diff_turns_self_test() -> None:
    proc = _run([str(SCRIPTS / "diff_turns.py"), "--self-test"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "self-test passed" in proc.stdout


def test_diff_turns_synthetic_logs(tmp_path: Path) -> None:
    day = tmp_path / "2026-03-30"
    day.mkdir()
    base = list(range(1000, 1200))
    recs = [
        {"v": 1, "request_id": "r1", "ts": 10.0, "session": "sx", "model_text": "A" * 50 + "first turn",
         "model_tokens": base, "key_same_as_model": True, "key_tokens": None,
         "cache": {"match_type": "miss", "prompt_tokens": 200, "cached_tokens": 0}},
        {"v": 1, "request_id": "r2", "ts": 11.0, "session": "sx", "model_text": "A" * 50 + "first turn, then more",
         "model_tokens": base + [5, 6], "key_same_as_model": True, "key_tokens": None,
         "cache": {"match_type": "prefix", "prompt_tokens": 202, "cached_tokens": 200}},
        {"v": 1, "request_id": "r3", "ts": 12.0, "session": "sx", "model_text": "A" * 30 + "B" + "A" * 19 + "first turn, then more",
         "model_tokens": base[:120] + [7] + base[121:] + [5, 6], "key_same_as_model": False,
         "key_tokens": base + [5, 6], "key_text": "A" * 50 + "first turn, then more",
         "cache": {"match_type": "lcp", "prompt_tokens": 202, "cached_tokens": 10}},
    ]
    log = day / "cache-session-sx.log"
    log.write_text("\n".join(json.dumps(r) for r in recs) + "\n{broken\n")
    proc = _run([str(SCRIPTS / "diff_turns.py"), "--log-root", str(tmp_path), "--session", "sx"])
    assert proc.returncode == 0, proc.stderr
    assert "pure append (previous 200 tokens all shared)" in proc.stdout
    assert "diverge at index 120" in proc.stdout
    assert "(char 30)" in proc.stdout
    proc = _run([str(SCRIPTS / "diff_turns.py"), "--file", str(log), "--json"])
    data = json.loads(proc.stdout)
    assert [d["model_index"] for d in data] == [200, 120]
    proc = _run([str(SCRIPTS / "diff_turns.py"), "--log-root", str(tmp_path), "--session", "sx", "--fail-on-loss"])
    assert proc.returncode == 1  # r3 reused 10 tokens but shared 120


def test_common_helpers() -> None:
    import _probe_common as pc

    assert pc.strip_reasoning("<think>plan</think>\nAnswer") == "Answer"
    assert pc.simulate_stripped("<think>x</think>Done.") == "Done."
    assert pc.simulate_stripped("First part. Second part") == "Second part"
    r = pc.ChatResult(id="chatcmpl-0123456789abcdef01234567", usage={"prompt_tokens": 10,
                                                                     "prompt_tokens_details": {"cached_tokens": 8}})
    assert (r.request_id, r.uncached_tokens, r.reuse) == ("cdef01234567", 2, 0.8)
    text = pc.openclaw_user("hi", 5)
    assert text.startswith("Conversation info (untrusted metadata):") and '"message_id": "5"' in text
    assert pc.OPENCLAW_BOUNDARY in pc.openclaw_system_prompt(100)
    assert "Stats: runtime 45s • tokens 1.2k (in 1k / out 200)" in pc.openclaw_subagent_report("t")


def _embedded_model_ready() -> bool:
    base = Path(os.environ.get("MODEL_CACHE_DIR") or Path.home() / ".cache" / "mlxstack").expanduser()
    return (base / "SmolLM2-135M-Instruct-f32" / "config.json").exists()


@pytest.mark.e2e
@pytest.mark.skipif(not _embedded_model_ready(), reason="embedded model not prepared yet (run start_llm.py once)")
def test_probe_session_end_to_end(tmp_path: Path) -> None:
    """Start the MLX server on a free port and run probe_session.py against it (small prompts)."""
    import _probe_common as pc

    port = unused_port()
    env = {"MLX_PORT": str(port), "ENABLE_REQUEST_LOGGING": "true", "LOG_ROOT": str(tmp_path / "logs"),
           "MLX_API_KEY": ""}  # .env from install_and_run.py holds a key; this server is loopback-only
    env.update(pc.blas_env())
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlxstack.serve"], cwd=REPO, env={**os.environ, **env},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 40
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if json.load(resp).get("ready"):
                        break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail("server not ready: " + (tmp_path / "server.log").read_text()[-3000:])
        run = _run([str(SCRIPTS / "probe_session.py"), "--base-url", f"http://127.0.0.1:{port}/v1", "--api-key", "",
                    "--system-tokens", "80", "--max-tokens", "4"], timeout=120)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert "OK: all expectations met" in run.stdout
        logs = list((tmp_path / "logs").glob("*/cache-session-*.log"))
        if logs:  # request logging on: diff_turns reads what the server wrote
            d = _run([str(SCRIPTS / "diff_turns.py"), "--log-root", str(tmp_path / "logs"), "--session",
                      next(p for p in logs if "cont-" in p.name).name[len("cache-session-"):-4]])
            assert d.returncode == 0, d.stderr
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=20)
        log.close()
