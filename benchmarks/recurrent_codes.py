"""RECURRENT_STATE_BITS measured (bench_kv_quant.py --parts recurrent): recurrent states stored as
TurboQuant codes (cache/state_codes.py) against the exact stored state, on the tiny random-weight
recurrent fixture models (tests/fixtures/tiny_models.py: mamba2, lfm2, qwen3_next hybrid).

Per model and width, over N chat prompts: each prompt but its last token is fed into a fresh cache
and captured as a turn's stored state; that state is checked out exact and coded (what a server with
the setting stores and a hit restores), and the last token is fed to both:
- the next-token distribution: mean / max KL(exact || coded) in nats over the full vocabulary, top-1
  agreement, beside the exact distribution's mean entropy (a scale for the KL) and, as the noise
  floor, the exact state of the same prompt prefilled in other chunks (other float rounding);
- greedy: how many of the N prompts keep the same 16 greedy tokens after the restore;
- a session: the prompt fed as 5 turns, each turn's end stored and restored by the next (coded
  every time: the errors of successive restores add up where the state does not forget them), the
  KL after the last one (exact: the same turns never coded -- other chunks, the noise floor);
- bytes: one stored entry (the whole state at the prompt's depth: attention KV included on the
  hybrids) and its recurrent layers alone, full vs coded, and how many such snapshots fit in one
  1 GiB budget.

Random weights give a rough picture only: a trained model's state statistics, its sensitivity to
state error and its vocabulary's logit scale are all different.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

FIXTURES = ("mamba2", "lfm2", "hybrid")
WIDTHS = (2, 3, 4, 8)
GREEDY = 16
CHAIN = 5           # a session's turns: each one's end stored (coded) and restored by the next


def _builders() -> dict[str, Any]:
    from tests.fixtures import tiny_models as tm

    return {"mamba2": tm.build_tiny_mamba2, "lfm2": tm.build_tiny_lfm2, "hybrid": tm.build_tiny_hybrid}


def _recurrent_bytes(layers) -> int:
    return sum(s.nbytes for s in layers if s.kind == "arrays") + sum(_recurrent_bytes(s.children) for s in layers)


def measure(model: Any, prompts: list[list[int]], label: str, budget: int = 1 << 30) -> list[dict]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxstack.cache.kv_ops import KVState, LiveCache, capture, checkout
    from mlxstack.cache.layer_kinds import eval_state
    from mlxstack.cache.state_codes import StateCodes
    from mlxstack.runner.generate import feed

    def after(state: KVState, last: int) -> tuple[Any, list[int]]:
        """Log-probabilities of the next token after ``last`` on ``state``, and GREEDY greedy tokens."""
        live = checkout(state, state.depth)
        out = model(mx.array([[last]], dtype=mx.int32), cache=live.layers)[0, -1].astype(mx.float32)
        logp = out - mx.logsumexp(out)
        toks, tok = [], int(mx.argmax(out).item())
        for _ in range(GREEDY):
            toks.append(tok)
            tok = int(mx.argmax(model(mx.array([[tok]], dtype=mx.int32), cache=live.layers)[0, -1]).item())
        return logp, toks

    def stored_after(p: list[int], step: int) -> KVState:
        live = LiveCache(make_prompt_cache(model), 0, None)
        feed(model, live, p[:-1], step)
        return capture(live)

    def coded(s: KVState, codes: Any) -> KVState:
        """``s`` as a server with ``codes`` stores it (None: exact)."""
        if codes is None:
            return s
        layers = codes.code_layers(s.layers)
        eval_state(layers)
        return KVState(layers, s.depth, s.floor, sum(x.nbytes for x in layers))

    def chained(p: list[int], codes: Any) -> KVState:
        """The prompt fed as CHAIN turns, each one's state stored (coded) and restored before the next."""
        live, cut = LiveCache(make_prompt_cache(model), 0, None), len(p) - 1
        for i in range(CHAIN):
            feed(model, live, p[cut * i // CHAIN:cut * (i + 1) // CHAIN], 256)
            state = coded(capture(live), codes)
            live = checkout(state, state.depth)
        return state

    def kl(got: list) -> list[float]:
        return [float(mx.sum(mx.exp(r) * (r - g)).item()) for (r, _), (g, _) in zip(refs, got)]

    def compare(states: list[KVState], bits: Any, codes: Any = None) -> dict:
        got = [after(s, p[-1]) for s, p in zip(states, prompts)]
        kls = kl(got)
        chain = kl([after(chained(p, codes), p[-1]) for p in prompts]) if bits != "exact, chunks of 64" else [0.0]
        agree = sum(int(mx.argmax(r).item() == mx.argmax(g).item()) for (r, _), (g, _) in zip(refs, got))
        same = sum(int(a == b) for (_, a), (_, b) in zip(refs, got))
        nbytes = statistics.mean(s.nbytes for s in states)
        return {"model": label, "bits": bits, "kl_mean": f"{statistics.mean(kls):.2e}", "kl_max": f"{max(kls):.2e}",
                f"kl_mean_{CHAIN}_restores": f"{statistics.mean(chain):.2e}" if len(chain) > 1 else "-",
                "entropy": entropy, "top1_agree": f"{agree}/{len(prompts)}",
                f"greedy{GREEDY}_same": f"{same}/{len(prompts)}", "entry_bytes": int(nbytes),
                "recurrent_bytes": int(statistics.mean(_recurrent_bytes(s.layers) for s in states)),
                "vs_exact": nbytes / full, "snapshots_in_1GiB": int(budget // nbytes)}

    stored = [stored_after(p, 256) for p in prompts]
    refs = [after(s, p[-1]) for s, p in zip(stored, prompts)]
    entropy = statistics.mean(float(-mx.sum(mx.exp(r) * r).item()) for r, _ in refs)
    full = statistics.mean(s.nbytes for s in stored)
    full_rec = statistics.mean(_recurrent_bytes(s.layers) for s in stored)
    rows = [{**compare(stored, "exact"), "recurrent_bytes": int(full_rec)},
            # the noise floor: the same prompt prefilled in chunks of 64 instead of 256 (exact, but
            # other float rounding: LESSONS 43) -- what a cold run on another chunking differs by
            compare([stored_after(p, 64) for p in prompts], "exact, chunks of 64")]
    for bits in WIDTHS:
        codes = StateCodes(bits)
        rows.append(compare([coded(s, codes) for s in stored], bits, codes))
    return rows


def recurrent(work: Path, tokenizer_dir: Path, prompts_of, settings, n: int = 10) -> list[dict]:
    """Every fixture built under ``work`` (tokenizer from ``tokenizer_dir``), measured on ``n``
    prompts from ``prompts_of(tokenizer, n)``."""
    from mlxstack.models.loader import load_model

    rows = []
    for name, build in _builders().items():
        path = build(work / f"tiny_{name}", tokenizer_dir)
        tiny = load_model(settings(model_path=path))
        rows += measure(tiny.model, prompts_of(tiny.tokenizer, n), name)
    return rows
