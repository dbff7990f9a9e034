#!/usr/bin/env python3
"""Cache scopes from outside: two tenants of one stack (TENANT_KEYS_FILE), through port 4000.

Tenant A sends a ~4k-token prompt (cold), then again (warm); tenant B sends A's prompt (must be
cold: no reuse, no faster), then again (his own warm); A sends it with a ``cache_salt`` (cold
again). Each request streamed; TTFT is the client's (request sent -> first content byte), the
cached tokens are the reply's usage. A fresh prompt per round, so rounds never reuse each other.

    .venv/bin/python benchmarks/bench_scopes.py [--tokens 4000] [--rounds 2] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MASTER = "sk-bench-scopes-master"
BACKEND = "sk-bench-scopes-backend-0123456789"
STEPS = (("A cold", "alice", None), ("A warm", "alice", None), ("B, A's prompt", "bob", None),
         ("B warm", "bob", None), ("A, a cache_salt", "alice", "salt-1"))


def prompt(tokens: int, round_: int) -> list[dict]:
    """A system prompt of about ``tokens`` tokens (~9 a line), unique to the round."""
    lines = [f"r{round_} src/module_{i}.py: def handler_{i}(request): return process(request, level={i % 7})"
             for i in range(max(1, tokens // 30))]
    return [{"role": "system", "content": "You review code.\n" + "\n".join(lines)},
            {"role": "user", "content": "Which handler has level 3?"}]


def streamed(base: str, key: str, messages: list[dict], salt: str | None) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens) of one streamed chat completion."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, usage = None, {}
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return (ttft if ttft is not None else time.perf_counter() - t0), int(usage.get("prompt_tokens", 0)), \
        int(details.get("cached_tokens", 0) or 0)


def run(tokens: int, rounds: int) -> dict:
    from mlxstack.config.tenants import add_tenant
    from scripts.probelib.client import free_ports
    from scripts.probelib.servers import embedded_model_path, launch_stack

    tmp = Path(tempfile.mkdtemp(prefix="bench-scopes-"))
    path = tmp / "tenants.json"
    keys = {"alice": add_tenant(path, "alice"), "bob": add_tenant(path, "bob")}
    mlx_port, proxy_port = free_ports(2)
    env = {"MLX_PORT": str(mlx_port), "PROXY_PORT": str(proxy_port), "LITELLM_MASTER_KEY": MASTER,
           "MLX_API_KEY": BACKEND, "TENANT_KEYS_FILE": str(path), "LOG_ROOT": str(tmp / "logs"),
           "MODEL_CACHE_DIR": str(embedded_model_path().parent), "DEFAULT_TEMPERATURE": "0",
           "DISK_CACHE_DIR": "off", "PROXY_STARTUP_TIMEOUT_SECONDS": "180"}
    proc, log = launch_stack(env, tmp / "stack.log")
    base = f"http://127.0.0.1:{proxy_port}"
    table: dict[str, list[tuple[float, int, int]]] = {name: [] for name, _, _ in STEPS}
    try:
        for r in range(rounds):
            messages = prompt(tokens, r)
            for name, tenant, salt in STEPS:
                table[name].append(streamed(base, keys[tenant], messages, salt))
    finally:
        import signal

        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
    cold = statistics.median(t for t, _, _ in table["A cold"])
    rows = []
    for name, _, _ in STEPS:
        ttft = statistics.median(t for t, _, _ in table[name])
        rows.append({"request": name, "prompt_tokens": table[name][0][1],
                     "cached_tokens": [c for _, _, c in table[name]], "ttft_s": round(ttft, 3),
                     "vs_a_cold": round(ttft / cold, 2)})
    return {"tokens": tokens, "rounds": rounds, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out = run(args.tokens, args.rounds)
    print(f"| request | prompt tokens | cached (per round) | TTFT s (median) | vs A cold |\n|---|---|---|---|---|")
    for row in out["rows"]:
        print(f"| {row['request']} | {row['prompt_tokens']:,} | {', '.join(map(str, row['cached_tokens']))} | "
              f"{row['ttft_s']} | {row['vs_a_cold']}x |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
