#!/usr/bin/env python3
"""Hybrid/recurrent models: uncached tokens per warm turn with snapshots vs without, side by side
with mlx_lm.server on the same model, in one run.

    .venv/bin/python benchmarks/bench_hybrid.py                 # builds the tiny qwen3_next fixture
    .venv/bin/python benchmarks/bench_hybrid.py --model PATH    # any hybrid MLX model folder

Three servers are started on free ports: ours with snapshots (SNAPSHOT_MAX_ENTRIES=8), ours with
snapshots off (SNAPSHOT_MAX_ENTRIES=0), and ``python -m mlx_lm.server``. Each replays the same
multi-turn chat and a tool loop (replies echoed back as history), greedy decoding.
Exit code 1 if our snapshot server ever needs more uncached tokens than mlx_lm.server on a turn.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))   # _probe_common
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _probe_common import Client, ServerProcess, print_table, tool_call, tool_result  # noqa: E402

SYSTEM = ("You are a coding agent working in a repository. Follow the project's conventions, "
          "prefer small commits, and explain each change briefly. ") * 8


def replay(client: Client, max_tokens: int, session: str) -> list[tuple[str, int, int, float]]:
    """-> [(label, prompt_tokens, cached_tokens, ttft_s)] for a chat + tool-loop session."""
    rows = []
    messages = [{"role": "system", "content": SYSTEM}]

    def send(label: str) -> str:
        r = client.chat(messages, max_tokens=max_tokens, session_id=session)
        rows.append((label, r.prompt_tokens, r.cached_tokens, r.ttft_s))
        return r.text

    for i, user in enumerate(("Summarise the repository layout.", "Which module owns the cache?",
                              "List two risks in it."), start=1):
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": send(f"chat {i}")})
    messages.append({"role": "user", "content": "Open the cache module."})
    messages.append({"role": "assistant", "content": send("tool request")})
    call = tool_call("call_1", "read_file", {"path": "mlxstack/cache/prompt_cache.py"})
    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    messages.append(tool_result("call_1", "class PromptCache:\n    def lookup(self, key, model): ...\n" * 6))
    messages.append({"role": "assistant", "content": send("tool result")})
    messages.append({"role": "user", "content": "Thanks. One line summary?"})
    send("follow-up")
    return rows


def build_fixture(out: Path) -> Path:
    from tests.fixtures.tiny_models import build_tiny_hybrid, tokenizer_source_dir

    return build_tiny_hybrid(out, tokenizer_source_dir())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="hybrid MLX model folder (default: build the tiny qwen3_next fixture)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench-hybrid-"))
    model = Path(args.model) if args.model else build_fixture(tmp / "tiny_hybrid")
    (tmp / "hf").mkdir()
    common = {"MODEL_PATH": str(model), "ENABLE_REQUEST_LOGGING": "false", "DEFAULT_TEMPERATURE": "0",
              "DEFAULT_REPETITION_PENALTY": "1.0", "DEFAULT_THINKING": "false"}
    servers = {
        "ours+snapshots": ServerProcess("ours", env={**common, "SNAPSHOT_MAX_ENTRIES": "8"}),
        "ours, no snapshots": ServerProcess("ours", env={**common, "SNAPSHOT_MAX_ENTRIES": "0"}),
        # mlx_lm.server's /v1/models scans the HF cache and fails when it does not exist.
        "mlx_lm.server": ServerProcess("mlx_lm", model_path=str(model), env={"HF_HUB_CACHE": str(tmp / "hf")}),
    }
    results: dict[str, list] = {}
    walls: dict[str, float] = {}
    try:
        for name, server in servers.items():
            server.wait_ready()
            t0 = time.perf_counter()
            results[name] = replay(Client(server.base_url, model=None if server.kind == "ours" else str(model)),
                                   args.max_tokens, session=f"bench-{name}")
            walls[name] = time.perf_counter() - t0
    finally:
        for server in servers.values():
            server.stop()

    names = list(results)
    labels = [r[0] for r in results[names[0]]]
    headers = ["turn", "prompt"] + [f"uncached: {n}" for n in names]
    rows = []
    worse = []
    for i, label in enumerate(labels):
        uncached = [results[n][i][1] - results[n][i][2] for n in names]
        rows.append([label, results[names[0]][i][1], *uncached])
        if i > 0 and uncached[0] > uncached[2]:
            worse.append(label)
    warm = {n: sum(r[1] - r[2] for r in results[n][1:]) for n in names}
    rows.append(["warm total", "", *[warm[n] for n in names]])
    rows.append(["wall s", "", *[round(walls[n], 2) for n in names]])
    print(f"model: {model}")
    print_table(headers, rows, markdown=args.markdown)
    base = warm["mlx_lm.server"] or 1
    print(f"\nwarm uncached tokens, ours+snapshots / mlx_lm.server = {warm['ours+snapshots'] / base:.2f}x; "
          f"without snapshots = {warm['ours, no snapshots'] / base:.2f}x")
    if worse:
        print(f"FAIL: more uncached tokens than mlx_lm.server on: {', '.join(worse)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
