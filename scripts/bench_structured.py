#!/usr/bin/env python3
"""Constrained decoding costs on a real tokenizer (the embedded SmolLM2 one by default): schema
compile time (cold and cached), grammar mask time per token (µs) for JSON schemas and tool-call
grammars (lazy ``auto`` before and after its trigger, ``required``, ``none``), the mask applied to
MLX logits, and a batch of rows filled in parallel (llguidance's thread pool) vs one by one.

Each grammar is driven over a realistic reply: the reply text is written through the mask (the
longest allowed token at each step, as a model that "wants" that text would), then replayed on a
fresh row, timing ``mask_words()`` (what the sampler waits for) and ``consume()`` per token.

    .venv/bin/python scripts/bench_structured.py [--tokenizer PATH] [--repeat 5] [--rows 8]

(Decode tok/s with and without a grammar, side by side, comes with the engine wiring.)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402

from mlxstack.constraints import BatchMasks, GrammarCompiler, apply_mask, json_spec, spec_for_request  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "format": "email"},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "email", "address", "tags"], "additionalProperties": False}
PERSON_TEXT = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "address": {"street": '
               '"12 St James Square", "city": "London", "zip": "10001"}, "tags": ["mathematics", "engines", "poetry"]}')


def tools(n: int) -> list[dict]:
    out = []
    for i in range(n):
        out.append({"type": "function", "function": {"name": f"tool_{i}" if i else "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "days"], "additionalProperties": False}}})
    return out


TOOLS = tools(8)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "unit": "celsius"}}\n</tool_call>'
FREE = "Let me check the forecast for you. I will look up the weather in Paris for the next three days. "
BIG = {"type": "object", "properties": {f"field_{i}": {"anyOf": [{"type": "string", "maxLength": 40},
                                                                 {"type": "integer"}, {"type": "null"}]}
                                        for i in range(150)}}


class Bench:
    def __init__(self, tokenizer: str) -> None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(tokenizer)
        stop = [hf.eos_token_id]
        t0 = time.perf_counter()
        self.compiler = GrammarCompiler.for_tokenizer(hf, stop_ids=stop)
        self.tokenizer_s = time.perf_counter() - t0
        self.stop = stop
        llt = self.compiler.tokenizer
        self.vocab = llt.vocab_size
        self.bytes = [llt.decode_bytes([i]) for i in range(self.vocab)]

    def tokens_for(self, spec, text: str) -> list[int]:
        """``text`` written through the mask: the longest allowed token at each step."""
        row = self.compiler.compile(spec).new_row(self.stop, self.vocab)
        rest, out = text.encode(), []
        while rest:
            allowed = row.allowed()
            ids = range(self.vocab) if allowed is None else allowed.tolist()
            best = max((i for i in ids if self.bytes[i] and rest.startswith(self.bytes[i])),
                       key=lambda i: len(self.bytes[i]), default=None)
            if best is None:
                raise SystemExit(f"the grammar refuses {rest[:30]!r}")
            row.consume(best)
            out.append(best)
            rest = rest[len(self.bytes[best]):]
        return out

    def per_token(self, spec, ids: list[int], repeat: int) -> tuple[list[float], list[float], list[str]]:
        """(mask µs, consume µs, row state before the token) per token, best of ``repeat`` runs."""
        grammar = self.compiler.compile(spec)
        best_mask = [float("inf")] * len(ids)
        best_eat = [float("inf")] * len(ids)
        states = []
        for r in range(repeat):
            row = grammar.new_row(self.stop, self.vocab)
            for k, tok in enumerate(ids):
                if r == 0:
                    states.append(row.state)
                t0 = time.perf_counter()
                row.mask_words()
                t1 = time.perf_counter()
                row.consume(tok)
                t2 = time.perf_counter()
                best_mask[k] = min(best_mask[k], (t1 - t0) * 1e6)
                best_eat[k] = min(best_eat[k], (t2 - t1) * 1e6)
        return best_mask, best_eat, states


def compile_ms(compiler: GrammarCompiler, make) -> tuple[float, float]:
    """(cold, cached) milliseconds: a spec never seen (a unique title or tool) and the same spec again."""
    spec = make()
    t0 = time.perf_counter()
    compiler.compile(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(spec)
    return cold * 1000, (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="", help="tokenizer folder (default: the embedded model's)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()
    path = args.tokenizer
    if not path:
        from mlxstack.models.embedded_model import ensure_embedded_model

        path = str(ensure_embedded_model(Path.home() / ".cache" / "mlxstack"))
    b = Bench(path)
    sp = b.compiler.specials
    print(f"tokenizer: {path} (vocab {b.vocab}); llguidance tokenizer built in {b.tokenizer_s * 1000:.0f} ms\n")

    n = iter(range(10**6))
    rows = [
        ("json_object", lambda: spec_for_request(response_format={"type": "json_object"})),
        ("json_schema person (strict)", lambda: json_spec({**PERSON, "title": f"p{next(n)}"}, strict=True)),
        ("json_schema 150 anyOf fields", lambda: json_spec({**BIG, "title": f"b{next(n)}"})),
        ("tools x8 auto (lazy)", lambda: spec_for_request(tools=TOOLS + [
            {"type": "function", "function": {"name": f"t{next(n)}"}}], tool_choice="auto", specials=sp)),
        ("tools x8 required", lambda: spec_for_request(tools=TOOLS + [
            {"type": "function", "function": {"name": f"t{next(n)}"}}], tool_choice="required", specials=sp)),
        ("tools x8 none", lambda: spec_for_request(tools=TOOLS + [
            {"type": "function", "function": {"name": f"t{next(n)}"}}], tool_choice="none", specials=sp)),
    ]
    print(f"{'compile':32s} {'cold ms':>9s} {'cached ms':>10s}")
    for name, make in rows:
        cold, hit = compile_ms(b.compiler, make)
        print(f"{name:32s} {cold:9.2f} {hit:10.3f}")

    cases = [
        ("json_schema person", json_spec(PERSON, strict=True), PERSON_TEXT, None),
        ("json_object", spec_for_request(response_format={"type": "json_object"}), PERSON_TEXT, None),
        ("tools auto: free text", spec_for_request(tools=TOOLS, tool_choice="auto", specials=sp), FREE + CALL, "dormant"),
        ("tools auto: in the call", spec_for_request(tools=TOOLS, tool_choice="auto", specials=sp), FREE + CALL, "engaged"),
        ("tools required", spec_for_request(tools=TOOLS, tool_choice="required", specials=sp), CALL, None),
        ("tools none (free text)", spec_for_request(tools=TOOLS, tool_choice="none", specials=sp), FREE * 2, None),
        ("reasoning, then json", spec_for_request(response_format={"type": "json_object"}, reasoning_close="</think>"),
         "Thinking about the person first. </think>\n\n" + PERSON_TEXT, None),
    ]
    print(f"\n{'mask per token':28s} {'tokens':>6s} {'mask med µs':>12s} {'p90 µs':>8s} {'max µs':>8s} "
          f"{'consume µs':>11s}")
    for name, spec, text, state in cases:
        ids = b.tokens_for(spec, text)
        mask, eat, states = b.per_token(spec, ids, args.repeat)
        keep = [k for k, s in enumerate(states) if state is None or s == state]
        m = sorted(mask[k] for k in keep)
        e = [eat[k] for k in keep]
        print(f"{name:28s} {len(keep):6d} {statistics.median(m):12.1f} {m[int(0.9 * (len(m) - 1))]:8.1f} "
              f"{m[-1]:8.1f} {statistics.median(e):11.1f}")

    # the sampler step with and without a mask (greedy, eval'd): what applying the mask adds
    from mlxstack.runtime.sampling import Sampler, SamplingParams

    grammar = b.compiler.compile(json_spec(PERSON, strict=True))
    logits = mx.random.normal((b.vocab,))
    mx.eval(logits)
    for label, g in (("without a grammar", None), ("with a grammar mask", grammar)):
        sampler = Sampler(SamplingParams(grammar=g, stop_token_ids=frozenset(b.stop)), [1], b.vocab)
        times = []
        for _ in range(100):
            t0 = time.perf_counter()
            mx.eval(sampler.sample(logits))
            times.append((time.perf_counter() - t0) * 1e6)
        print(f"sampler.sample [{b.vocab}] {label:20s}: median {statistics.median(times):6.0f} µs")
    words = grammar.new_row(b.stop, b.vocab).mask_words()
    times = []
    for _ in range(100):
        t0 = time.perf_counter()
        mx.eval(apply_mask(logits, words))
        times.append((time.perf_counter() - t0) * 1e6)
    print(f"apply_mask alone (eval'd)                : median {statistics.median(times):6.0f} µs\n")

    # a batch of engaged rows: one by one vs llguidance's thread pool
    spec = json_spec(PERSON, strict=True)
    ids = b.tokens_for(spec, PERSON_TEXT)
    grammar = b.compiler.compile(spec)
    for label, parallel in (("one by one", False), ("BatchMasks (parallel)", True)):
        rows_ = [grammar.new_row(b.stop, b.vocab) for _ in range(args.rows)]
        masks = BatchMasks()
        per_step = []
        for tok in ids:
            t0 = time.perf_counter()
            if parallel:
                masks.fill(rows_)
            else:
                for r in rows_:
                    r.mask_words()
            per_step.append((time.perf_counter() - t0) * 1e6)
            for r in rows_:
                r.consume(tok)
        print(f"{args.rows} json rows, {label:22s}: median {statistics.median(per_step):7.0f} µs per step "
              f"({statistics.median(per_step) / args.rows:.0f} µs per row)")


if __name__ == "__main__":
    main()
