#!/usr/bin/env python3
"""Models on demand (MODELS_ON_DEMAND), through LiteLLM on real ports.

Three models -- the embedded SmolLM2-135M (float32, the main model) and two tiny fixture models in a
MODELS_DIR -- each with a conversation of its own, used round-robin with a MODEL_MEMORY_BUDGET that
fits any two but never three: under LRU every turn after the first two finds its model unloaded.

- time to first token of a turn whose model is not resident (load included) vs resident;
- every turn after a reload: cached tokens (warm from the model's disk-tier namespace) and the reply
  against a cold server of the same model (no disk tier, nothing cached), turn by turn;
- the resident memory of the model servers: peak (sampled by the router) against the budget, and
  after an unload (the process gone: all of it returned);
- beside it, what unloading *in one process* returns (mlx-lm's load, then del + gc + mx.clear_cache),
  the alternative docs/operations.md#models-on-demand weighs.

    .venv/bin/python benchmarks/bench_models.py [--rounds 3] [--max-tokens 24]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from bench_guard import STACK_KEY, STACK_MLX_KEY, Stack, _release  # noqa: E402

KV = 64 << 20
PROCESS = 300_000_000          # MODEL_PROCESS_BYTES: a model server's own memory (measured ~0.25 GB here)
SYSTEM = ("You are a careful assistant for a software team. " * 60).strip()
QUESTIONS = ["Name three uses of a hash map.", "Which of them needs ordering?", "Give one more, briefly.",
             "Summarise the list.", "What did we start with?"]
ENV = {"DEFAULT_TEMPERATURE": "0", "DEFAULT_REPETITION_PENALTY": "1.0", "DEFAULT_THINKING": "false",
       "SPECULATIVE": "off", "SPEC_CALIBRATE": "off", "ENABLE_REQUEST_LOGGING": "false"}


def chat(base: str, model: str, messages: list[dict], max_tokens: int, key: str = STACK_KEY) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    from probelib.client import sse_data

    t0, first, text, usage = time.perf_counter(), None, [], {}
    with urllib.request.urlopen(req, timeout=900) as resp:
        for payload in sse_data(resp):
            frame = json.loads(payload)
            usage = frame.get("usage") or usage
            for ch in frame.get("choices") or []:
                delta = ch.get("delta") or {}
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece:
                    first = first if first is not None else time.perf_counter()
                    text.append(delta.get("content") or "")
    return {"text": "".join(text), "ttft": (first or time.perf_counter()) - t0,
            "cached": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)}


def get(url: str, key: str = STACK_MLX_KEY) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.load(resp)


def weights(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def cold_replies(model_path: str, env: dict, tmp: Path, turns: list[list[dict]], max_tokens: int) -> list[str]:
    """Each turn's reply from a plain MLX server of the model with no disk tier, every turn cold
    (PROMPT_CACHE_MAX_BYTES tiny: nothing kept between turns)."""
    from probelib.client import free_ports

    port = free_ports(1)[0]
    full = {**env, "MODEL_PATH": model_path, "MLX_PORT": str(port), "MLX_HOST": "127.0.0.1", "MLX_API_KEY": "",
            "DISK_CACHE_DIR": "off", "PROMPT_CACHE_MAX_BYTES": "1", "MODELS_ON_DEMAND": "false",
            "LOG_ROOT": str(tmp / "cold-logs")}
    import os

    log = open(tmp / f"cold-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlxstack.serve"], cwd=REPO, env={**os.environ, **full},
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if get(base + "/health", "").get("ready"):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp / f"cold-{port}.log").read_text()[-2000:])
            time.sleep(0.5)
        served = get(base + "/v1/models", "")["data"][0]["id"]
        out = []
        for messages in turns:
            r = chat(base, served, messages, max_tokens, key="")
            if r["cached"]:
                raise RuntimeError(f"the cold reference reused {r['cached']} tokens")
            out.append(r["text"])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def in_process_unload() -> dict:
    """RSS and MLX active memory around an in-process load and unload of the embedded model."""
    import mlx.core as mx
    from mlx_lm import load

    from mlxstack.models.embedded_model import ensure_embedded_model
    from mlxstack.models.memory import process_rss_bytes as rss_bytes
    import os

    path = ensure_embedded_model(Path.home() / ".cache" / "mlxstack")
    before = rss_bytes(os.getpid()), mx.get_active_memory()
    model, tok = load(str(path))
    mx.eval(model.parameters())
    loaded = rss_bytes(os.getpid()), mx.get_active_memory()
    del model, tok
    gc.collect()
    mx.clear_cache()
    after = rss_bytes(os.getpid()), mx.get_active_memory()
    return {"rss": [before[0], loaded[0], after[0]], "active": [before[1], loaded[1], after[1]],
            "weights": weights(Path(path))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    from mlxstack.models.embedded_model import ensure_embedded_model
    from tests.fixtures import tiny_models as tm

    embedded = Path(ensure_embedded_model(Path.home() / ".cache" / "mlxstack"))
    tmp = Path(tempfile.mkdtemp(prefix="bench_models_"))
    models_dir = tmp / "models"
    tm.build_tiny_dense(models_dir / "tiny-b", embedded)
    tm.build_tiny_qwen2(models_dir / "tiny-c", embedded)
    main_model = "SmolLM2-135M-Instruct"
    need = {main_model: weights(embedded) + KV + PROCESS,
            "tiny-b": weights(models_dir / "tiny-b") + KV + PROCESS, "tiny-c": weights(models_dir / "tiny-c") + KV + PROCESS}
    budget = need[main_model] + need["tiny-b"] + need["tiny-c"] // 2       # any two, never three
    env = {**ENV, "MODELS_ON_DEMAND": "true", "MODELS_DIR": str(models_dir), "MODEL_MEMORY_BUDGET": str(budget),
           "PROMPT_CACHE_MAX_BYTES": str(KV), "MODEL_PROCESS_BYTES": str(PROCESS), "DISK_CACHE_DIR": str(tmp / "kv"),
           "HF_HUB_CACHE": str(tmp / "hub"), "MODEL_CACHE_DIR": str(embedded.parent)}
    from probelib.client import free_ports

    mlx_port, proxy_port = free_ports(2)
    stack = Stack("on-demand", env, mlx_port, proxy_port, tmp / "stack")
    order = [main_model, "tiny-b", "tiny-c"]
    convo = {m: [{"role": "system", "content": SYSTEM}] for m in order}
    sent: dict[str, list[list[dict]]] = {m: [] for m in order}
    rows = []
    try:
        for rnd in range(args.rounds):
            for m in order:
                convo[m].append({"role": "user", "content": QUESTIONS[rnd % len(QUESTIONS)]})
                loads = get(stack.mlx + "/health")["loads_total"]
                r = chat(stack.base, m, convo[m], args.max_tokens)
                h = get(stack.mlx + "/health")
                rows.append({"round": rnd, "model": m, "loaded": h["loads_total"] > loads, **r,
                             "resident_bytes": h["resident_bytes"]})
                sent[m].append([dict(x) for x in convo[m]])
                convo[m].append({"role": "assistant", "content": r["text"]})
        # resident: the last model again, twice
        resident = []
        m = order[-1]
        for q in ("One more question.", "And another."):
            convo[m].append({"role": "user", "content": q})
            r = chat(stack.base, m, convo[m], args.max_tokens)
            resident.append(r["ttft"])
            convo[m].append({"role": "assistant", "content": r["text"]})
        h = get(stack.mlx + "/health")
        rss_now = {x["model"]: x["rss_bytes"] for x in h["models"]}
        peak = h["peak_rss_bytes"]
    finally:
        _release(stack)
    cold = {m: cold_replies("" if m == main_model else str(models_dir / m), {**ENV, "MODEL_CACHE_DIR": str(embedded.parent)},
                            tmp, sent[m], args.max_tokens) for m in order}
    for m in order:
        for row, text in zip([r for r in rows if r["model"] == m], cold[m]):
            row["equal_cold"] = row["text"] == text
    inproc = in_process_unload()

    g = lambda n: f"{n / 2 ** 30:.2f}"  # noqa: E731
    print(f"\nbudget {g(budget)} GiB (needs: " + ", ".join(f"{m} {g(need[m])}" for m in order) + ")")
    print("| round | model | load | TTFT s | cached tokens | reply = cold |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['model']} | {'yes' if r['loaded'] else 'no'} | {r['ttft']:.2f} | {r['cached']} | "
              f"{'yes' if r['equal_cold'] else 'NO'} |")
    loaded_ttft = [r["ttft"] for r in rows if r["loaded"]]
    print(f"\nTTFT with a load: median {statistics.median(loaded_ttft):.2f} s over {len(loaded_ttft)} turns; "
          f"resident: {', '.join(f'{t:.2f}' for t in resident)} s")
    warm = [r for r in rows if r["loaded"] and r["round"] > 0]
    print(f"turns after a reload: {len(warm)}, warm (cached > 0): {sum(r['cached'] > 0 for r in warm)}, "
          f"replies equal to cold: {sum(r['equal_cold'] for r in rows)}/{len(rows)}")
    print(f"model servers' resident memory: peak {g(peak)} GiB (budget {g(budget)}); at the end "
          + ", ".join(f"{m} {g(b)}" for m, b in rss_now.items()) + "; an unloaded model's process exits (0 left)")
    rss, act = inproc["rss"], inproc["active"]
    print(f"in one process instead (embedded model, weights {g(inproc['weights'])} GiB): RSS {g(rss[0])} -> {g(rss[1])} "
          f"-> {g(rss[2])} GiB after del + gc + mx.clear_cache; MLX active {g(act[0])} -> {g(act[1])} -> {g(act[2])} GiB")
    ok = all(r["equal_cold"] for r in rows) and all(r["cached"] > 0 for r in warm) and peak <= budget
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
