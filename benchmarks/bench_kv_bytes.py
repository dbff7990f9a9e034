#!/usr/bin/env python3
"""KV bytes resident in RAM for N sub-agents sharing one system prompt vs one session (issue 20).

In process, the embedded model through the real engine and continuous-batching scheduler, greedy:
N sessions with the same ~2k-token system prompt and their own question arrive together; the
``mlxstack_kv_bytes`` figure (runner/kv_bytes.py: requests in flight, each array once, plus the RAM
cache tier) is read after every scheduler step. Prints the peak in flight, the cache tier after, and
both as a multiple of one session's.

    .venv/bin/python benchmarks/bench_kv_bytes.py [--sessions 8] [--system-repeat 50] [--max-tokens 16]
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import Future
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402

from mlxstack.config.settings import load_settings  # noqa: E402
from mlxstack.runner.batch import batching_support  # noqa: E402
from mlxstack.engine.chat import ChatJob  # noqa: E402
from mlxstack.engine.factory import make_engine  # noqa: E402
from mlxstack.engine.core import EngineCore  # noqa: E402
from mlxstack.models.loader import load_model  # noqa: E402
from mlxstack.runner.sampling import SamplingParams  # noqa: E402

SYSTEM = ("You are a coding sub-agent in a large repository. Read files before editing, run the tests after "
          "each change, keep diffs small, and report briefly what you changed and why. ")


def run(n: int, system: str, max_tokens: int) -> dict:
    env = {"MODEL_PATH": "", "DEFAULT_TEMPERATURE": "0", "DEFAULT_THINKING": "false", "ENABLE_REQUEST_LOGGING": "false",
           "DISK_CACHE_DIR": "off", "MLX_PORT": "0", "SPECULATIVE": "off"}
    settings = load_settings(env=env)
    engine = make_engine(load_model(settings), settings)
    sched = EngineCore(engine, max(8, n), 512, batching=batching_support(engine)[0])
    # the MLX allocator's own view (every buffer, activations included, transients within a step
    # too): what the process really held on top of the loaded model
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    futures = []
    for i in range(n):
        job = ChatJob(request_id=f"k{i}", messages=[{"role": "system", "content": system},
                                                   {"role": "user", "content": f"Task {i}: look at module {i}."}],
                      tools=None, enable_thinking=False, params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                      stop=[], body={"session_id": f"agent-{i}-{time.time()}"}, headers={}, emit=lambda _t: None)
        f: Future = Future()
        f.set_running_or_notify_cancel()
        sched.admit(job, f)
        futures.append(f)
    peak = 0
    while not sched.idle():
        sched.step()
        peak = max(peak, engine.state.live_kv_bytes)
    outs = [f.result() for f in futures]
    mx.synchronize()
    alloc_peak, alloc_after = mx.get_peak_memory() - base, mx.get_active_memory() - base
    stats = engine.state.stats()
    return {"prompt": outs[0].prompt_tokens, "peak_live": peak, "tier": stats["tier_kv_bytes"],
            "tier_entries": stats["bytes"], "after": stats["kv_bytes"], "shared": sched.shared_prefills,
            "texts": [o.text for o in outs], "alloc_peak": alloc_peak, "alloc_after": alloc_after}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--system-repeat", type=int, default=50, help="system prompt = SYSTEM x this (~2k tokens at 50)")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    if sys.platform.startswith("linux"):
        from mlxstack.system.process_env import reexec_with

        reexec_with(load_settings(), [str(Path(__file__).resolve()), *sys.argv[1:]])
    system = SYSTEM * args.system_repeat
    one = run(1, system, args.max_tokens)
    many = run(args.sessions, system, args.max_tokens)
    mib = 2 ** 20
    print(f"prompt ~{one['prompt']} tokens (shared system prompt), {args.max_tokens} tokens each")
    print(f"{'sessions':>8} {'peak in flight MiB':>19} {'cache tier after MiB':>21} {'(entries summed)':>17} "
          f"{'peak + tier / one':>18} {'shared prefills':>16}")
    for label, r in (("1", one), (str(args.sessions), many)):
        print(f"{label:>8} {r['peak_live'] / mib:19.1f} {r['tier'] / mib:21.1f} {r['tier_entries'] / mib:17.1f} "
              f"{(r['peak_live'] + r['tier']) / (one['peak_live'] + one['tier']):17.2f}x {r['shared']:16d}")
    print(f"MLX allocator, on top of the loaded model: peak {many['alloc_peak'] / mib:.1f} MiB for "
          f"{args.sessions} vs {one['alloc_peak'] / mib:.1f} MiB for 1 = {many['alloc_peak'] / one['alloc_peak']:.2f}x; "
          f"held after {many['alloc_after'] / mib:.1f} vs {one['alloc_after'] / mib:.1f} MiB "
          f"= {many['alloc_after'] / one['alloc_after']:.2f}x")
    print(f"first session's reply identical to the single run's: {many['texts'][0] == one['texts'][0]}")


if __name__ == "__main__":
    main()
