#!/usr/bin/env python3
"""Speculative decoding (prompt lookup inside continuous batching) vs SPECULATIVE=off, side by side.

Through the real engine and continuous-batching scheduler on the embedded model (in process,
greedy, prompt cache off so both modes prefill the same), interleaved rounds of:
  copy  -- an agent's edit turns: a ~40-line file rewritten with one change (copy-heavy replies)
  free  -- free text (a story, an explanation)
  mix8  -- 8 concurrent sessions, 4 copy + 4 free, in one batch
  copy8 -- 8 concurrent copy sessions in one batch
Per workload: decode tok/s (completion tokens / time from the first token to the last, aggregate
over the batch), the ratio on/off (median of the per-round ratios), the acceptance (accepted /
proposed drafts, and the share of reply tokens that came from drafts), and whether every reply is
identical with speculation off.

Then a draft model (``--draft-layers N``, 0 skips it): the embedded model's first N layers
(scripts/make_draft_model.py) as DRAFT_MODEL with SPECULATIVE=draft, on copy and free, beside
mlx_lm.server with and without ``--draft-model`` (the same draft, one stream at a time over HTTP,
decode tok/s from the first streamed token to the last).

    .venv/bin/python benchmarks/bench_speculative.py [--rounds 3] [--max-tokens 160] [--max-draft 6] [--draft-layers 6]
    .venv/bin/python benchmarks/bench_speculative.py --compare-prior --draft-layers 0   # measured costs vs the prior

``--compare-prior`` adds the same loads with speculation deciding from the step costs measured on
this machine (runner/spec/step_costs.py, the default) against deciding from the constant prior alone.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))         # make_draft_model, probelib
sys.path.insert(0, str(REPO / "benchmarks"))    # bench_concurrency

from mlxstack.config.settings import load_settings  # noqa: E402
from mlxstack.runner.batch import batching_support  # noqa: E402
from mlxstack.engine.chat import ChatJob  # noqa: E402
from mlxstack.engine.factory import make_engine  # noqa: E402
from mlxstack.engine.core import EngineCore  # noqa: E402
from mlxstack.models.loader import load_model  # noqa: E402
from mlxstack.runner.sampling import SamplingParams  # noqa: E402

FILE = "\n".join(
    f"def handle_{name}(request, store):\n    item = store.get(request.{name}_id)\n"
    f"    if item is None:\n        raise NotFound('{name}')\n    return render(item, status={200 + i})"
    for i, name in enumerate(["user", "order", "invoice", "product", "cart", "payment", "review", "coupon"]))
COPY = [   # an agent's edit turns: the file is in the prompt, the reply rewrites it with one change
    [{"role": "system", "content": "You are a code editor. You output only code."},
     {"role": "user", "content": "```python\n" + FILE + "\n```\nOutput the same code with `render` renamed to "
                                 "`render_item`."}],
    [{"role": "user", "content": "Write handlers for user, order, invoice, product, cart, payment, review and coupon."},
     {"role": "assistant", "content": "```python\n" + FILE + "\n```"},
     {"role": "user", "content": "Now write the whole file again, but change NotFound to KeyError."}],
]
FREE = [
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "user", "content": "Explain how a hash map works, and when to use one."}],
]


def make(mode: str, max_draft: int, draft: str = ""):
    env = {"MODEL_PATH": "", "SPECULATIVE": mode, "DRAFT_MODEL": draft, "SPEC_MAX_DRAFT": str(max_draft), "DEFAULT_TEMPERATURE": "0",
           "DEFAULT_REPETITION_PENALTY": "1.0", "DEFAULT_THINKING": "false", "ENABLE_REQUEST_LOGGING": "false",
           "PROMPT_CACHE_MAX_ENTRIES_GLOBAL": "0", "DISK_CACHE_DIR": "off", "MLX_PORT": "0"}
    settings = load_settings(env=env)
    return make_engine(load_model(settings), settings)


def run(engine, convos: list[list[dict]], max_tokens: int) -> tuple[list, float]:
    sched = EngineCore(engine, 16, 512, batching=batching_support(engine)[0])
    futures = []
    for i, messages in enumerate(convos):
        job = ChatJob(request_id=f"b{i}", messages=messages, tools=None, enable_thinking=False,
                      params=SamplingParams(temperature=0.0, max_tokens=max_tokens), stop=[],
                      body={"session_id": f"bench-{i}-{time.time()}"}, headers={}, emit=lambda _t: None)
        f: Future = Future()
        f.set_running_or_notify_cancel()
        sched.admit(job, f)
        futures.append(f)
    seqs = list(sched.prefilling)
    while not sched.idle():
        sched.step()
    outs = [f.result() for f in futures]
    first = min(s.t_first for s in seqs)
    last = max(s.t_end for s in seqs)
    tokens = sum(o.completion_tokens for o in outs)
    return outs, tokens / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--max-draft", type=int, default=6)
    ap.add_argument("--draft-layers", type=int, default=6, help="draft model: the embedded model's first N layers (0: skip)")
    ap.add_argument("--skip-ngram", action="store_true", help="only the draft-model section")
    ap.add_argument("--compare-prior", action="store_true",
                    help="also: speculation deciding from measured step costs vs from the constant prior alone")
    args = ap.parse_args()
    if sys.platform.startswith("linux"):   # OpenBLAS preloaded, as the server runs
        from mlxstack.system.process_env import reexec_with

        reexec_with(load_settings(), [str(Path(__file__).resolve()), *sys.argv[1:]])
    engines = {"off": make("off", args.max_draft), "auto": make("auto", args.max_draft)}
    print(f"speculation: {engines['auto'].speculation.describe()}")
    loads = {"copy": [[c] for c in COPY], "free": [[f] for f in FREE], "mix8": [COPY * 2 + FREE * 2],
             "copy8": [COPY * 4]}
    if not args.skip_ngram:
        compare(engines, loads, args.rounds, args.max_tokens, "auto")
    if args.compare_prior:
        engines["prior"] = make("auto", args.max_draft)
        prior_only(engines["prior"].speculation.costs)
        print("\n## measured step costs (auto) vs the constant prior alone (prior), both speculating")
        compare(engines, loads, args.rounds, args.max_tokens, "auto", base="prior")
        print(f"measured costs: {engines['auto'].speculation.stats()}")
    if args.draft_layers:
        draft_model_section(engines, args)


def prior_only(costs) -> None:
    """Make a ``StepCosts`` answer the constant prior and never ask for a plain yardstick step: the
    cost model before steps were timed (``--compare-prior``)."""
    costs.wants_plain = lambda rows: False
    costs.cost = costs.prior_cost


def draft_model_section(engines: dict, args: argparse.Namespace) -> None:
    import tempfile

    from make_draft_model import prune
    from probelib.servers import ServerProcess, embedded_model_path

    folder = prune(embedded_model_path(), Path(tempfile.mkdtemp(prefix="draft-")) / f"first{args.draft_layers}",
                   args.draft_layers)
    engines = {"off": engines["off"], "draft": make("draft", args.max_draft, str(folder))}
    print(f"\n## a draft model: the embedded model's first {args.draft_layers} layers\n"
          f"speculation: {engines['draft'].speculation.describe()}")
    loads = {"copy": [[c] for c in COPY], "free": [[f] for f in FREE]}
    compare(engines, loads, args.rounds, args.max_tokens, "draft")
    dm = engines["draft"].speculation.draft
    print(f"draft model: {dm.drafted} tokens drafted, {dm.fed} fed to catch up")
    # mlx_lm.server, the same draft, one stream at a time
    from bench_concurrency import stream_chat

    def decode_tps(base: str, convo: list[dict]) -> tuple[float, str]:
        r = stream_chat(base, "default_model", convo, args.max_tokens)
        n = int((r["usage"] or {}).get("completion_tokens") or len(r["stamps"]))
        span = r["stamps"][-1] - r["stamps"][0] if len(r["stamps"]) > 1 else float("nan")
        return (n - 1) / span, r["text"]

    got: dict[str, dict[str, list[float]]] = {}
    texts: dict[str, list[str]] = {}
    for label, extra in (("plain", []), ("draft", ["--draft-model", str(folder), "--num-draft-tokens", "3"])):
        with ServerProcess("mlx_lm", extra_args=extra) as srv:
            srv.wait_ready(300)
            decode_tps(srv.root, FREE[0])                      # warm-up
            got[label] = {"copy": [], "free": []}
            texts[label] = []
            for _ in range(args.rounds):
                for name, convos in (("copy", COPY), ("free", FREE)):
                    for convo in convos:
                        tps, text = decode_tps(srv.root, convo)
                        got[label][name].append(tps)
                        texts[label].append(text)
    print("\nmlx_lm.server --draft-model (same draft, --num-draft-tokens 3), one stream:")
    for name in ("copy", "free"):
        off, on = statistics.median(got["plain"][name]), statistics.median(got["draft"][name])
        print(f"  {name:5} plain {off:6.1f} tok/s  with draft {on:6.1f} tok/s  ratio {on / off:5.2f}x")
    print(f"  replies identical with and without the draft: {texts['plain'] == texts['draft']}")


def compare(engines: dict, loads: dict, rounds: int, max_tokens: int, on: str, base: str = "off") -> None:
    """``engines[on]`` against ``engines[base]`` (keyed "off" in the loop below), interleaved rounds."""
    engines = {"off": engines[base], on: engines[on]}
    for name, batches in loads.items():
        for convos in batches:          # warm-up (graph caches, allocator) outside the timings
            for eng in engines.values():
                run(eng, convos, 8)
    print(f"{'load':6} {base + ' tok/s':>10} {on + ' tok/s':>10} {'ratio':>7} {'accepted/proposed':>18} "
          f"{'from drafts':>12} {'identical':>10}")
    for name, batches in loads.items():
        ratios, speeds = [], {"off": [], on: []}
        proposed = accepted = tokens = 0
        identical = True
        for r in range(rounds):
            order = ("off", on) if r % 2 == 0 else (on, "off")
            for convos in batches:
                got = {}
                for mode in order:
                    outs, tps = run(engines[mode], convos, max_tokens)
                    got[mode] = (outs, tps)
                    speeds[mode].append(tps)
                ratios.append(got[on][1] / got["off"][1])
                identical &= [o.raw_text for o in got[on][0]] == [o.raw_text for o in got["off"][0]]
                proposed += sum(o.timings["spec_proposed"] for o in got[on][0])
                accepted += sum(o.timings["spec_accepted"] for o in got[on][0])
                tokens += sum(o.completion_tokens for o in got[on][0])
        print(f"{name:6} {statistics.median(speeds['off']):10.1f} {statistics.median(speeds[on]):10.1f} "
              f"{statistics.median(ratios):6.2f}x {accepted:>8}/{proposed:<9} {accepted / max(1, tokens):11.0%} "
              f"{str(identical):>10}", flush=True)


if __name__ == "__main__":
    main()
