#!/usr/bin/env python3
"""Side-by-side agent replays: this stack vs ``mlx_lm.server`` on the same model, in one run.

Shapes (same requests to both servers, greedy decoding, repetition penalty off):
- ``pi``                 PI-shaped tool loop, retry, edited last user message
- ``openclaw``           OpenClaw boundary/inbound-context prompt, metadata prefixes, sub-agent report
- ``many-sessions``      N sub-agent sessions round-robin (default 14 > mlx_lm.server's 10 cache entries)
- ``stripped-reasoning`` every reply echoed back stripped (reasoning removed; simulated for a model
                         without reasoning by dropping the reply's first sentence)

Prints markdown tables: per shape and server, uncached tokens over warm turns, cold / warm TTFT
(client-side, streaming), total wall time and the ratio; then per-turn uncached tokens side by side.
Both servers are started on free ports (OpenBLAS preloaded for both) unless --ours-url /
--baseline-url are given. Exit 1 if ours prefilled more than the baseline on any warm turn
(--no-fail to only report).

    python benchmarks/bench_agents.py                       # ~3-5 min on a 2-core CPU
    python benchmarks/bench_agents.py --shapes pi,many-sessions --sessions 14
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))   # _probe_common
from _probe_common import (
    Client,
    ProbeError,
    Recorder,
    ServerProcess,
    Turn,
    default_api_key,
    nonce,
    print_table,
    replay_many_sessions,
    replay_openclaw,
    replay_pi,
    replay_stripped_reasoning,
)

SHAPES = ("pi", "openclaw", "many-sessions", "stripped-reasoning", "stripped-thinking")
# Shapes that need a model whose template opens <think> (the tiny qwen3-style fixture, random
# weights): both servers are started on it separately.
THINKING_SHAPES = ("stripped-thinking",)
BENCH_EXTRA = {"repetition_penalty": 1.0}  # same sampling on both servers (greedy: temperature 0)


def run_shape(shape: str, rec: Recorder, args: Any, tag: str) -> list[Turn]:
    if shape == "pi":
        return replay_pi(rec, sys_tokens=args.system_tokens, tag=tag, session=f"pi-{tag}")
    if shape == "openclaw":
        return replay_openclaw(rec, sys_tokens=args.system_tokens, tag=tag, session=f"oc-{tag}")
    if shape == "many-sessions":
        return replay_many_sessions(rec, n_sessions=args.sessions, rounds=args.rounds,
                                    sys_tokens=args.sub_system_tokens, task_tokens=args.task_tokens, tag=tag)
    if shape == "stripped-reasoning":
        return replay_stripped_reasoning(rec, sys_tokens=args.system_tokens, tag=tag, session=f"sr-{tag}")
    if shape == "stripped-thinking":
        return replay_stripped_thinking(rec, tag=tag, session=f"st-{tag}")
    raise ValueError(shape)


def replay_stripped_thinking(rec: Recorder, *, tag: str, session: str, turns: int = 4) -> list[Turn]:
    """Thinking on: the reply starts inside <think>. The client keeps only ``content`` (reasoning
    stripped, as most clients do) when it echoes the reply, so the history no longer equals the
    tokens in the KV; a server that cannot restore them re-prefills the reply."""
    start = len(rec.turns)
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    msgs = [{"role": "system", "content": "You are a careful coding agent. " * 20 + tag},
            {"role": "user", "content": "Plan the refactor of the parser module."}]
    r = rec.send("stripped-thinking", "question", msgs, session=session, extra=think)
    for i in range(2, turns + 1):
        msgs = msgs + [{"role": "assistant", "content": r.text},
                       {"role": "user", "content": f"Step {i}: continue."}]
        r = rec.send("stripped-thinking", f"follow-up {i} (stripped)", msgs, session=session, extra=think)
    return rec.turns[start:]


def thinking_servers(args: Any) -> tuple[list[ServerProcess], str, str, str]:
    """Ours and mlx_lm.server on the tiny thinking fixture (built in a temp dir)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fixtures.tiny_models import build_tiny_dense, tokenizer_source_dir

    tmp = Path(tempfile.mkdtemp(prefix="bench-think-"))
    model = str(build_tiny_dense(tmp / "tiny_think", tokenizer_source_dir()))
    (tmp / "hf").mkdir()
    ours = ServerProcess("ours", env={"MODEL_PATH": model, "ENABLE_REQUEST_LOGGING": "false",
                                      "DEFAULT_TEMPERATURE": "0", "DEFAULT_REPETITION_PENALTY": "1.0"})
    base = ServerProcess("mlx_lm", model_path=model, env={"HF_HUB_CACHE": str(tmp / "hf")})
    for proc in (ours, base):
        proc.wait_ready(timeout=300)
    return [ours, base], ours.base_url, base.base_url, model


class BenchRecorder(Recorder):
    """Recorder that adds the bench sampling settings to every request."""

    def send(self, *a: Any, **kw: Any):  # type: ignore[override]
        kw["extra"] = {**BENCH_EXTRA, **(kw.get("extra") or {})}
        return super().send(*a, **kw)


def replay_all(client: Client, shapes: Sequence[str], args: Any, tag: str, label: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for shape in shapes:
        rec = BenchRecorder(client, max_tokens=args.max_tokens, verbose=args.verbose)
        t0 = time.perf_counter()
        print(f"[{label}] {shape} ...", file=sys.stderr, flush=True)
        turns = run_shape(shape, rec, args, tag)
        out[shape] = {"turns": turns, "wall_s": time.perf_counter() - t0}
    return out


def summary(res: dict) -> dict:
    turns: list[Turn] = res["turns"]
    warm = [t for t in turns if t.warm]
    cold = [t for t in turns if not t.warm]
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    return {"warm_uncached": sum(t.uncached for t in warm), "warm_prompt": sum(t.prompt for t in warm),
            "cold_ttft": mean([t.ttft_s for t in cold]), "warm_ttft": mean([t.ttft_s for t in warm]),
            "wall_s": res["wall_s"], "n_warm": len(warm)}


def compare(ours: dict[str, dict], base: dict[str, dict], *, markdown: bool = True,
            names: tuple[str, str] = ("mlxstack", "mlx_lm.server")) -> list[str]:
    """Print the summary + per-turn tables; return the problems (ours uncached > baseline on a warm turn)."""
    rows = []
    problems: list[str] = []
    for shape in ours:
        if shape not in base:
            continue
        so, sb = summary(ours[shape]), summary(base[shape])
        ratio = sb["warm_uncached"] / so["warm_uncached"] if so["warm_uncached"] else float("inf")
        for name, s in ((names[0], so), (names[1], sb)):
            rows.append([shape, name, s["n_warm"], s["warm_uncached"], s["warm_prompt"],
                         f"{1 - s['warm_uncached'] / s['warm_prompt']:.1%}" if s["warm_prompt"] else "-",
                         f"{s['cold_ttft']:.2f}", f"{s['warm_ttft']:.2f}", f"{s['wall_s']:.1f}",
                         (f"{ratio:.1f}x" if ratio != float("inf") else "inf") if name == names[0] else ""])
    print("\n### Summary (warm turns = turn >= 2 of each session)\n")
    print_table(["shape", "server", "warm turns", "uncached (warm)", "prompt (warm)", "reuse", "cold TTFT s",
                 "warm TTFT s", "wall s", "uncached ratio base/ours"], rows, markdown=markdown)
    print("\n### Uncached tokens per warm turn\n")
    print("excess = uncached - new, where new = this prompt minus the session's previous prompt: the old\n"
          "context a server had to prefill again (0 for a perfect cache). It compares servers fairly\n"
          "even where their chat renderings differ (ours renders tools / tool calls for SmolLM2).\n")
    detail = []
    for shape in ours:
        if shape not in base:
            continue
        to, tb = ours[shape]["turns"], base[shape]["turns"]
        ex_o, ex_b = excess(to), excess(tb)
        for i, (a, b) in enumerate(zip(to, tb)):
            if not a.warm:
                continue
            flag = ""
            if ex_o[i] > ex_b[i]:
                flag = "ours re-prefilled more"
                problems.append(f"{shape} turn {a.turn} ({a.label}): excess ours {ex_o[i]} > baseline {ex_b[i]}")
            elif a.uncached > b.uncached:
                if a.prompt == b.prompt:
                    flag = "ours higher"
                    problems.append(f"{shape} turn {a.turn} ({a.label}): ours {a.uncached} > baseline {b.uncached}")
                else:
                    flag = "prompts differ (ours longer)"
            detail.append([shape, a.turn, a.label, a.prompt, a.uncached, ex_o[i], b.prompt, b.uncached, ex_b[i],
                           a.match, f"{a.ttft_s:.2f}", f"{b.ttft_s:.2f}", flag])
    print_table(["shape", "turn", "label", f"prompt ({names[0]})", f"uncached ({names[0]})", "excess",
                 f"prompt ({names[1]})", f"uncached ({names[1]})", "excess", "match (ours)", "TTFT ours",
                 "TTFT base", "note"], detail, markdown=markdown)
    return problems


def excess(turns: Sequence[Turn]) -> list[int]:
    """Per turn: uncached tokens beyond what is new since the same session's previous prompt."""
    last: dict[str, int] = {}
    out = []
    for t in turns:
        prev = last.get(t.session)
        out.append(t.uncached if prev is None else max(0, t.uncached - max(0, t.prompt - prev)))
        last[t.session] = t.prompt
    return out


def start_servers(args: Any) -> tuple[list[ServerProcess], str, str]:
    procs: list[ServerProcess] = []
    ours_url, base_url = args.ours_url, args.baseline_url
    if not ours_url:
        env = {"LOG_ROOT": args.log_root} if args.log_root else {}
        procs.append(ServerProcess("ours", env=env))
        ours_url = procs[-1].base_url
    if not base_url:
        procs.append(ServerProcess("mlx_lm", model_path=args.baseline_model))
        base_url = procs[-1].base_url
    for p in procs:  # start both, then wait: the loads overlap
        p.wait_ready(timeout=300)
    return procs, ours_url, base_url


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ours-url", default=None, help="this stack's base URL (…/v1); default: start mlxstack.serve on a free port")
    p.add_argument("--ours-key", default=None,
                   help="key for --ours-url (default: $LITELLM_MASTER_KEY or .env, used when --ours-url is given)")
    p.add_argument("--ours-model", default=None, help="model name for ours (default: first id of /models)")
    p.add_argument("--baseline-url", default=None, help="mlx_lm.server base URL; default: start it on a free port")
    p.add_argument("--baseline-model", default=None,
                   help="model folder for mlx_lm.server (default ~/.cache/mlxstack/SmolLM2-135M-Instruct-f32)")
    p.add_argument("--log-root", default="/tmp/mlxstack-bench-logs", help="LOG_ROOT for the started server")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens per request (default 8)")
    p.add_argument("--markdown", action=argparse.BooleanOptionalAction, default=True, help="markdown tables (default on)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each request")
    p.add_argument("--no-fail", action="store_true", help="exit 0 even if ours prefilled more on some turn")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(p)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of shapes (default {','.join(SHAPES)})")
    p.add_argument("--system-tokens", type=int, default=500, help="system prompt size for pi/openclaw/stripped (default 500)")
    p.add_argument("--sessions", type=int, default=14, help="many-sessions: live sessions (default 14)")
    p.add_argument("--rounds", type=int, default=2, help="many-sessions: turns per session (default 2)")
    p.add_argument("--sub-system-tokens", type=int, default=300, help="many-sessions: shared sub-agent prompt (default 300)")
    p.add_argument("--task-tokens", type=int, default=100, help="many-sessions: per-session task file (default 100)")
    args = p.parse_args(argv)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")

    t0 = time.perf_counter()
    procs: list[ServerProcess] = []
    try:
        procs, ours_url, base_url = start_servers(args)
        key = args.ours_key if args.ours_key is not None else (default_api_key() if args.ours_url else "")
        ours = Client(ours_url, key, model=args.ours_model)
        base = Client(base_url, "", model=args.baseline_model or "default_model")
        base._stats_ok = False  # mlx_lm.server has no /v1/cache/stats
        tag = nonce()
        print(f"ours {ours_url} (model {ours.model}) vs mlx_lm.server {base_url}; run {tag}", file=sys.stderr)
        # Interleave per shape so both servers see the machine in the same state.
        res_ours: dict[str, dict] = {}
        res_base: dict[str, dict] = {}
        for shape in [s for s in shapes if s not in THINKING_SHAPES]:
            res_ours.update(replay_all(ours, [shape], args, tag, "mlxstack"))
            res_base.update(replay_all(base, [shape], args, tag, "mlx_lm.server"))
        thinking = [s for s in shapes if s in THINKING_SHAPES]
        if thinking:
            more, t_ours, t_base, t_model = thinking_servers(args)
            procs += more
            res_ours.update(replay_all(Client(t_ours, ""), thinking, args, tag, "mlxstack"))
            res_base.update(replay_all(Client(t_base, "", model=t_model), thinking, args, tag, "mlx_lm.server"))
    except ProbeError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in procs:
            proc.stop()
    problems = compare(res_ours, res_base, markdown=args.markdown)
    print(f"\nmax_tokens {args.max_tokens}, greedy, repetition_penalty 1.0; total run {time.perf_counter() - t0:.0f} s")
    if problems:
        print("\nours prefilled more than mlx_lm.server on:\n  " + "\n  ".join(problems))
        return 0 if args.no_fail else 1
    print("\nours <= mlx_lm.server on every warm turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
