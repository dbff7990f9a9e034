#!/usr/bin/env python3
"""Cache benchmarks on the embedded model.

(a) machinery   in-process cost of what every request pays before prefill: the engine's own
                ``prepare()`` (heal + canonicalise + one render + key, boundaries + tokenise) and
                ``lookup()`` (block hashing, lookup, stable prefix), and the components measured
                one by one (two renders and two tokenisations, as a request paid before issue 21),
                at 1k / 8k / 32k tokens, the previous turn stored with its session record.
                Target <= 15 ms at 32k. Run it from an older checkout's folder to compare builds.
(b) ttft        TTFT cold vs warm at 1k and 2k tokens over HTTP (a server it starts, or --base-url).
(c) replay      the same multi-turn agent replays (PI-shaped + interleaved sub-agent sessions) against
                this server and mlx_lm.server on the same model: uncached tokens per warm turn side by side.

    python benchmarks/bench_cache.py                         # all three parts (~3 min on a 2-core CPU)
    python benchmarks/bench_cache.py --parts a --sizes 1000,8000,32000 --repeat 7
    python benchmarks/bench_cache.py --parts b --base-url http://127.0.0.1:8080/v1

Exit 1 when (a) misses --target-ms at the largest size, or (c) shows ours prefilling more than
mlx_lm.server on a warm turn with an identical prompt (--no-fail to only report).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))                 # bench_agents
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))   # _probe_common
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _probe_common import (
    PI_TOOLS,
    Client,
    ProbeError,
    ServerProcess,
    fake_file,
    fake_test_output,
    filler_paragraphs,
    nonce,
    openclaw_subagent_report,
    openclaw_system_prompt,
    openclaw_user,
    pi_system_prompt,
    print_table,
    tool_call,
    tool_result,
)


# ----------------------------------------------------------------------------- (a) machinery
def build_conversation(target_tokens: int, count: Callable[[list[dict]], int]) -> list[dict]:
    """An agent conversation of about ``target_tokens`` (OpenClaw metadata + tool loop + sub-agent
    report, so canonicalisation has real work), ending with a user message."""
    msgs: list[dict] = [{"role": "system", "content": openclaw_system_prompt(800, tag="bench")},
                        {"role": "user", "content": openclaw_user("Refactor the parser module.", 1)}]
    i = 0
    while count(msgs) < target_tokens - 600:
        i += 1
        cid = f"call_{i}"
        if i % 2:
            call, result = tool_call(cid, "read_file", {"path": f"src/mod{i}.py"}), fake_file(f"src/mod{i}.py", 900, seed=i)
        else:
            call, result = tool_call(cid, "bash", {"command": "pytest -q"}), fake_test_output(500)
        msgs += [{"role": "assistant", "content": f"Step {i}: checking.", "tool_calls": [call]}, tool_result(cid, result)]
        if i % 5 == 0:
            msgs += [{"role": "user", "content": openclaw_subagent_report(f"scan batch {i}", runtime_s=30 + i)},
                     {"role": "assistant", "content": "Noted the sub-agent result."}]
    msgs.append({"role": "user", "content": openclaw_user("Now summarise the changes.", 1000 + i)})
    return msgs


def part_a(args: Any) -> bool:
    import logging

    logging.disable(logging.WARNING)
    from mlxstack.cache.lcp import lcp  # noqa: F401  (import check)
    from mlxstack.config.settings import load_settings
    from mlxstack.engine.chat import ChatJob
    from mlxstack.runner.generate import SamplingParams
    from mlxstack.models.loader import hf_offline_env, load_model
    from mlxstack.prompt.canonicalize import canonicalize_messages
    from mlxstack.prompt.render import encode
    from mlxstack.prompt.scrub import scrub_cache_key

    hf_offline_env()
    # No disk tier: a healing journal left by earlier runs would make the heal step depend on the machine
    settings = load_settings(env={"ENABLE_REQUEST_LOGGING": "false", "DISK_CACHE_DIR": "off"})
    t = time.perf_counter()
    loaded = load_model(settings)
    try:
        from mlxstack.engine.factory import make_engine

        engine = make_engine(loaded, settings)
    except ImportError:
        from mlxstack.engine.chat import ChatEngine
        from mlxstack.engine.state import EngineState
        from mlxstack.prompt.render import ChatRenderer

        renderer = ChatRenderer(loaded.tokenizer, preserve_thinking=settings.preserve_thinking)
        engine = ChatEngine(loaded, renderer, EngineState(settings, loaded.model_id, renderer.template_source), settings)
    try:  # the healing store, when this build has one, is what the server would use
        from mlxstack.server.app import App

        app = App(settings)
        app.loaded, app.state, app.engine, app.model_id = loaded, engine.state, engine, loaded.model_id
        app.after_response_hooks, app.extra_get_routes = [], {}
        app._install_features()
    except Exception:  # noqa: BLE001
        pass
    print(f"(a) model loaded in {time.perf_counter() - t:.1f}s; tokenizer {type(loaded.tokenizer).__name__}")
    tok, renderer, state = loaded.tokenizer, engine.renderer, engine.state
    cache = state.kv.index

    def count(msgs: list[dict]) -> int:
        return len(encode(tok, renderer.render(msgs, PI_TOOLS, False)))

    def job_for(msgs: list[dict], sid: str) -> ChatJob:
        return ChatJob(request_id="bench", messages=msgs, tools=PI_TOOLS, enable_thinking=False,
                       params=SamplingParams(), stop=[], body={"session_id": sid}, headers={}, emit=lambda _s: None)

    rows, ok = [], True
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    for size in sizes:
        msgs = build_conversation(size, count)
        sid = f"bench-{size}"
        # Populate: the previous request (the conversation before its last user message) is stored,
        # with the session record the server writes after it (its history boundary where this build
        # records one), so this request is the next turn of a growing conversation.
        prev = job_for(msgs[:-1], sid)
        pprep = engine.prepare(prev)
        cache.insert(pprep.key_tokens, pprep.model_tokens, None, nbytes=0, floor=0, session_id=sid)
        if hasattr(pprep, "history_end"):
            state.turns.update(sid, pprep.canonical, history=pprep.history_end)
        else:
            state.turns.update(sid, pprep.canonical)
        for k in range(12):  # other sessions' entries, so the index is not trivially small
            other = engine.prepare(job_for([{"role": "system", "content": f"other {k} " + filler_paragraphs(200)},
                                            {"role": "user", "content": "hi"}], f"o{k}"))
            cache.insert(other.key_tokens, other.model_tokens, None, nbytes=0, floor=0, session_id=f"o{k}")
        job = job_for(msgs, sid)
        steps: dict[str, list[float]] = {k: [] for k in ("heal", "canonicalise", "render orig", "render canon+scrub",
                                                         "tokenise x2", "hash", "lookup", "prepare()", "engine.lookup()",
                                                         "total")}
        n_tokens = 0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            healed = state.heal(copy.deepcopy(job.messages)) if hasattr(state, "heal") else job.messages
            t1 = time.perf_counter()
            original, canonical = canonicalize_messages(healed, enabled=settings.cache_canonicalize_tool_context,
                                                        strip_billing_header=settings.strip_billing_header)
            t2 = time.perf_counter()
            mtext = renderer.render(original, job.tools, False)
            t3 = time.perf_counter()
            ctext = scrub_cache_key(renderer.render(canonical, job.tools, False))
            t4 = time.perf_counter()
            mtok = encode(tok, mtext)
            ktok = mtok if ctext == mtext else encode(tok, ctext)
            t5 = time.perf_counter()
            hashes = cache.hashes(ktok)
            t6 = time.perf_counter()
            match = cache.lookup(ktok, mtok, key_hashes=hashes)
            t7 = time.perf_counter()
            steps["heal"].append(t1 - t0)
            steps["canonicalise"].append(t2 - t1)
            steps["render orig"].append(t3 - t2)
            steps["render canon+scrub"].append(t4 - t3)
            steps["tokenise x2"].append(t5 - t4)
            steps["hash"].append(t6 - t5)
            steps["lookup"].append(t7 - t6)
            # The engine's own path, end to end, as the server runs it.
            a = time.perf_counter()
            prep = engine.prepare(job)
            b = time.perf_counter()
            m2, _stable = engine.lookup(prep, sid, job)
            c = time.perf_counter()
            renders = getattr(prep, "renders", None)
            steps["prepare()"].append(b - a)
            steps["engine.lookup()"].append(c - b)
            steps["total"].append(c - a)
            n_tokens = len(prep.model_tokens)
        med = {k: statistics.median(v) * 1000 for k, v in steps.items()}
        rows.append([size, n_tokens, len(msgs), match.match_type, match.depth] + [f"{med[k]:.2f}" for k in steps]
                    + ["-" if renders is None else renders])
        if size == max(sizes) and med["total"] > args.target_ms:
            ok = False
        cache.clear()
    print(f"\n(a) machinery cost, median of {args.repeat} runs, milliseconds (cache holds the previous turn + 12 others)\n")
    print_table(["target", "tokens", "msgs", "match", "depth", "heal", "canon", "render orig", "render canon+scrub",
                 "tokenise x2", "hash", "lookup", "prepare()", "engine.lookup()", "total (prepare+lookup)",
                 "renders/request"], rows,
                markdown=args.markdown)
    print(f"\ntarget: total <= {args.target_ms} ms at {max(sizes)} tokens -> {'OK' if ok else 'MISSED'}")
    return ok


# ----------------------------------------------------------------------------- (b) TTFT
def part_b(client: Client, args: Any) -> None:
    rows = []
    for size in [int(s) for s in args.ttft_sizes.split(",") if s.strip()]:
        tag = nonce()
        msgs = [{"role": "system", "content": f"Run {tag}. " + pi_system_prompt(size - 40, tag)},
                {"role": "user", "content": "Summarise the guidelines in one sentence."}]
        cold = client.chat(msgs, max_tokens=args.max_tokens, session_id=f"ttft-{tag}")
        crow = client.stats_row(cold) or {}
        msgs = msgs + [{"role": "assistant", "content": cold.text},
                       {"role": "user", "content": "Which guideline matters most?"}]
        warm = client.chat(msgs, max_tokens=args.max_tokens, session_id=f"ttft-{tag}")
        wrow = client.stats_row(warm) or {}
        rows.append([size, "cold", cold.prompt_tokens, cold.cached_tokens, f"{cold.ttft_s:.3f}",
                     crow.get("ttft_s", ""), crow.get("prefill_tok_s", "")])
        rows.append([size, "warm", warm.prompt_tokens, warm.cached_tokens, f"{warm.ttft_s:.3f}",
                     wrow.get("ttft_s", ""), wrow.get("prefill_tok_s", "")])
    print("\n(b) TTFT cold vs warm (client TTFT: streaming, first content delta; server TTFT from /v1/cache/stats)\n")
    print_table(["size", "turn", "prompt", "cached", "client TTFT s", "server TTFT s", "prefill tok/s"], rows,
                markdown=args.markdown)


# ----------------------------------------------------------------------------- (c) replay
def part_c(ours: Client, base: Client, args: Any) -> list[str]:
    import bench_agents

    ns = argparse.Namespace(system_tokens=args.system_tokens, sessions=args.sessions, rounds=2,
                            sub_system_tokens=300, task_tokens=100, max_tokens=args.max_tokens, verbose=args.verbose)
    tag = nonce()
    res_o: dict[str, dict] = {}
    res_b: dict[str, dict] = {}
    for shape in ("pi", "many-sessions"):
        res_o.update(bench_agents.replay_all(ours, [shape], ns, tag, "mlxstack"))
        res_b.update(bench_agents.replay_all(base, [shape], ns, tag, "mlx_lm.server"))
    print("\n(c) multi-turn agent replay, this server vs mlx_lm.server (same model, greedy)")
    return bench_agents.compare(res_o, res_b, markdown=args.markdown)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="a,b,c", help="which parts to run: a,b,c (default all)")
    p.add_argument("--sizes", default="1000,8000,32000", help="(a) conversation sizes in tokens")
    p.add_argument("--repeat", type=int, default=5, help="(a) runs per size; the median is reported (default 5)")
    p.add_argument("--target-ms", type=float, default=15.0, help="(a) budget at the largest size (default 15 ms)")
    p.add_argument("--ttft-sizes", default="1000,2000", help="(b) prompt sizes (default 1000,2000)")
    p.add_argument("--base-url", default=None, help="(b)/(c) our server's base URL (default: start one on a free port)")
    p.add_argument("--api-key", default="", help="key for --base-url")
    p.add_argument("--baseline-url", default=None, help="(c) mlx_lm.server base URL (default: start one)")
    p.add_argument("--baseline-model", default=None, help="(c) model folder for mlx_lm.server (default: the embedded model)")
    p.add_argument("--system-tokens", type=int, default=500, help="(c) PI system prompt size (default 500)")
    p.add_argument("--sessions", type=int, default=14, help="(c) interleaved sessions (default 14)")
    p.add_argument("--max-tokens", type=int, default=8, help="(b)/(c) max_tokens (default 8)")
    p.add_argument("--markdown", action=argparse.BooleanOptionalAction, default=True, help="markdown tables")
    p.add_argument("--no-fail", action="store_true", help="report only; exit 0")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",")}
    ok = True
    if "a" in parts:
        ok = part_a(args) and ok
    procs: list[ServerProcess] = []
    try:
        if parts & {"b", "c"}:
            ours_url = args.base_url
            if not ours_url:
                procs.append(ServerProcess("ours", env={"ENABLE_REQUEST_LOGGING": "false"}))
            if "c" in parts and not args.baseline_url:
                procs.append(ServerProcess("mlx_lm", model_path=args.baseline_model))
            for proc in procs:
                proc.wait_ready(300)
            ours_url = ours_url or procs[0].base_url
            ours = Client(ours_url, args.api_key)
            if "b" in parts:
                part_b(ours, args)
            if "c" in parts:
                base_url = args.baseline_url or procs[-1].base_url
                base = Client(base_url, "", model=args.baseline_model or "default_model")
                base._stats_ok = False
                problems = part_c(ours, base, args)
                if problems:
                    print("\nours prefilled more than mlx_lm.server (identical prompts) on:\n  " + "\n  ".join(problems))
                    ok = False
    except ProbeError as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in procs:
            proc.stop()
    return 0 if ok or args.no_fail else 1


if __name__ == "__main__":
    sys.exit(main())
