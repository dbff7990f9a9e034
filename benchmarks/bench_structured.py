#!/usr/bin/env python3
"""Constrained decoding costs on a real tokenizer (the embedded SmolLM2 one by default): schema
compile time (cold and cached), grammar mask time per token (µs) for JSON schemas and tool-call
grammars (lazy ``auto`` before and after its trigger, ``required``, ``none``), the mask applied to
MLX logits, and a batch of rows filled in parallel (llguidance's thread pool) vs one by one.

Each grammar is driven over a realistic reply: the reply text is written through the mask (the
longest allowed token at each step, as a model that "wants" that text would), then replayed on a
fresh row, timing ``mask_words()`` (what the sampler waits for) and ``consume()`` per token.

Then, through the real engine and continuous-batching scheduler on the embedded model (in process,
greedy): decode tok/s with and without a grammar at 1 and 8 concurrent rows, side by side (only
steps where exactly that many rows decode and nothing prefills or leaves), and the JSON validity of
replies to N generated pydantic-like schemas (objects with strings, integers, numbers, booleans,
enums, arrays and nested objects; required and optional fields) with ``response_format``
json_schema and without it (the same prompt asking for JSON), checked with ``jsonschema``.

    .venv/bin/python benchmarks/bench_structured.py [--tokenizer PATH] [--repeat 5] [--rows 8]
        [--schemas 60] [--decode-tokens 64] [--rounds 5] [--no-engine]
"""
from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--schemas", type=int, default=60, help="generated schemas for the validity check")
    ap.add_argument("--decode-tokens", type=int, default=64, help="max tokens per row in the decode benchmark")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the decode benchmark")
    ap.add_argument("--no-engine", action="store_true", help="grammar costs only (no decode, no validity)")
    args = ap.parse_args()
    if not args.no_engine and sys.platform.startswith("linux"):   # OpenBLAS preloaded, as the server runs
        from mlxstack.config.settings import load_settings
        from mlxstack.system.process_env import reexec_with

        reexec_with(load_settings(), [str(Path(__file__).resolve()), *sys.argv[1:]])
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
    from mlxstack.runner.sampling import Sampler, SamplingParams

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

    if not args.no_engine:
        engine_bench(args)


# ============================================================================ through the engine
def build_engine():
    """The embedded model's engine + its grammar compiler, as the server builds them (greedy)."""
    from mlxstack.server.common.structured import Structured
    from mlxstack.config.settings import load_settings
    from mlxstack.engine.factory import make_engine
    from mlxstack.models.loader import load_model

    settings = load_settings(env={"DEFAULT_TEMPERATURE": "0", "DEFAULT_REPETITION_PENALTY": "1.0",
                                  "DEFAULT_THINKING": "false", "ENABLE_REQUEST_LOGGING": "false",
                                  "DISK_CACHE_DIR": "off", "MLX_PORT": "0"})
    engine = make_engine(load_model(settings), settings)
    return engine, Structured.for_model(engine.loaded, engine, settings)


def make_job(engine, structured, messages, max_tokens, rid, **fields):
    """A ChatJob with the grammar its fields ask for, compiled as a request handler compiles it."""
    from mlxstack.server.common.job_adapter import chat_job
    from mlxstack.server.common.validation import parse_chat_request

    req = parse_chat_request({"messages": messages, "max_tokens": max_tokens, **fields}, engine.settings,
                             engine.token_count)
    req.grammar = structured.grammar_for(req) if fields else None
    return chat_job(req, rid, {}, emit=lambda _t: None, on_prompt=lambda _p: None, is_cancelled=lambda: False)


def run_jobs(engine, jobs, rows: int):
    """Step the real scheduler over ``jobs`` (``rows`` in flight); (outcomes, steady decode steps as
    (rows decoding, seconds)) -- steps where nothing prefilled, joined or left."""
    from concurrent.futures import Future

    from mlxstack.runner.batch import batching_support
    from mlxstack.engine.core import EngineCore

    sched = EngineCore(engine, rows, engine.settings.prefill_chunk_tokens, batching_support(engine)[0])
    futures, waiting, steady = [], list(jobs), []
    while waiting or not sched.idle():
        while waiting and sched.has_room():
            f = Future()
            f.set_running_or_notify_cancel()
            sched.admit(waiting.pop(0), f)
            futures.append(f)
        before = (len(sched.prefilling), len(sched.group))
        t0 = time.perf_counter()
        sched.step()
        dt = time.perf_counter() - t0
        if before[0] == 0 and before[1] > 0 and len(sched.group) == before[1] and not sched.prefilling:
            steady.append((before[1], dt))
    return [f.result() for f in futures], steady


BENCH_PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "London", "Berlin", "Madrid"]},
    "bio": {"type": "string", "maxLength": 400},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8}},
    "required": ["name", "age", "city", "bio", "tags"], "additionalProperties": False}
PEOPLE = ["a baker", "a pilot", "a painter", "a nurse", "a farmer", "a chemist", "a poet", "a carpenter"]


def decode_bench(engine, structured, max_tokens: int, rounds: int) -> None:
    """Free vs constrained decode at 1 and 8 rows, interleaved round by round (2 shared cores drift:
    each round runs every variant once), medians over the rounds."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": BENCH_PERSON, "strict": True}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    variants = [("unconstrained", {}), ("json_schema (strict)", {"response_format": fmt}),
                ("tool_choice none (mask every token)", {"tools": tools, "tool_choice": "none"})]
    print(f"\ndecode through the engine + scheduler (embedded model, greedy, up to {max_tokens} tokens a row, "
          f"{rounds} interleaved rounds; tok/s over steps where every row decodes)")
    print(f"{'rows':>4s}  {'grammar':38s} {'steps':>6s} {'tok/s median':>13s} {'min':>7s} {'max':>7s} "
          f"{'vs free (median of rounds)':>27s}")

    def jobs(rows, fields, tag):
        return [make_job(engine, structured, [{"role": "user", "content": f"Describe {PEOPLE[i % 8]} as a JSON "
                                               f"object with name, age, city, bio and tags. ({tag})"}],
                         max_tokens, f"{tag}{i}", **fields) for i in range(rows)]

    for rows in (1, 8):
        for _label, fields in variants:
            run_jobs(engine, jobs(rows, fields, "warm"), rows)           # kernels, masks, compiled grammars
        rates: dict[str, list[float]] = {label: [] for label, _ in variants}
        steps: dict[str, int] = {label: 0 for label, _ in variants}
        for r in range(rounds):
            for label, fields in variants:
                _, steady = run_jobs(engine, jobs(rows, fields, f"r{r}"), rows)
                full = [dt for n, dt in steady if n == rows]
                steps[label] += len(full)
                rates[label].append(rows * len(full) / sum(full) if full else float("nan"))
        free = rates[variants[0][0]]
        for label, _ in variants:
            ratio = statistics.median(x / f for x, f in zip(rates[label], free))
            print(f"{rows:4d}  {label:38s} {steps[label]:6d} {statistics.median(rates[label]):13.1f} "
                  f"{min(rates[label]):7.1f} {max(rates[label]):7.1f} {ratio:26.2f}x")


def random_schemas(n: int, seed: int = 18) -> list[tuple[str, dict]]:
    """``n`` varied pydantic-like object schemas (title, schema): bounded strings and arrays (as
    ``Field(max_length=...)`` writes them), integers and numbers with ranges, booleans, string enums,
    nested objects, required and optional fields, additionalProperties false."""
    import random

    rng = random.Random(seed)
    nouns = ["book", "movie", "city", "recipe", "car", "planet", "song", "employee", "invoice", "hotel", "course",
             "museum", "bird", "laptop", "river", "festival", "garden", "restaurant", "team", "device"]
    words = ["name", "title", "label", "owner", "country", "category", "color", "author", "brand", "status", "code",
             "region", "language", "genre", "material", "style"]
    nums = ["year", "count", "price", "rating", "size", "weight", "score", "rank", "age", "capacity"]

    def leaf(depth: int) -> dict:
        kind = rng.choice(["string", "string", "integer", "number", "boolean", "enum", "array", "object"]
                          if depth < 2 else ["string", "integer", "boolean", "enum"])
        if kind == "string":
            return {"type": "string", "maxLength": rng.choice([12, 20, 32])}
        if kind == "integer":
            lo = rng.choice([0, 1, 1900])
            return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([10, 100, 200])}
        if kind == "number":
            return {"type": "number", "minimum": 0, "maximum": rng.choice([5, 100, 1000])}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"type": "string", "enum": rng.sample(["red", "green", "blue", "small", "large", "new", "used",
                                                         "open", "closed", "high", "low"], rng.randint(2, 4))}
        if kind == "array":
            return {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": rng.randint(2, 4)}
        return obj(depth + 1, rng.randint(2, 3))

    def obj(depth: int, k: int) -> dict:
        keys = rng.sample(words + nums, k)
        props = {key: leaf(depth) for key in keys}
        required = [key for key in keys if rng.random() < 0.75] or keys[:1]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return [(f"{rng.choice(nouns)} #{i}", obj(0, rng.randint(2, 6))) for i in range(n)]


def extract_json(text: str):
    """(strict parse, lenient parse): the whole reply as JSON, or the first JSON object inside it."""
    strict = lenient = None
    try:
        strict = json.loads(text)
    except ValueError:
        pass
    at = text.find("{")
    while at >= 0 and lenient is None:
        try:
            lenient, _ = json.JSONDecoder().raw_decode(text[at:])
        except ValueError:
            at = text.find("{", at + 1)
    return strict, lenient if strict is None else strict


def validity_bench(engine, structured, n: int, rows: int) -> None:
    import jsonschema

    schemas = random_schemas(n)
    t0 = time.perf_counter()
    for title, schema in schemas:
        structured.compiler.compile(json_spec({**schema, "title": title}, strict=True))
    compile_ms = (time.perf_counter() - t0) * 1000 / len(schemas)
    print(f"\nJSON validity over {n} generated schemas (embedded model, greedy, {rows} rows at a time; "
          f"compile {compile_ms:.1f} ms a schema, cold)")
    print(f"{'':26s} {'parses':>7s} {'valid':>7s} {'valid*':>7s} {'length':>7s} {'tokens':>7s} {'s':>6s}")
    for label, constrained in (("without response_format", False), ("with json_schema (strict)", True)):
        jobs = []
        for i, (title, schema) in enumerate(schemas):
            fields = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "reply", "schema": schema, "strict": True}}} if constrained else {}
            ask = (f"Reply with only a JSON object for a {title.split(' #')[0]}, matching this JSON schema: "
                   f"{json.dumps(schema)}")
            jobs.append(make_job(engine, structured, [{"role": "user", "content": ask}], 384, f"v{i}", **fields))
        t0 = time.perf_counter()
        outs, _ = run_jobs(engine, jobs, rows)
        took = time.perf_counter() - t0
        parses = valid = valid_lenient = cut = 0
        for out, (_, schema) in zip(outs, schemas):
            strict, lenient = extract_json(out.text.strip())
            cut += out.finish_reason == "length"
            parses += strict is not None
            valid += strict is not None and jsonschema.Draft202012Validator(schema).is_valid(strict)
            valid_lenient += lenient is not None and jsonschema.Draft202012Validator(schema).is_valid(lenient)
        tokens = sum(o.completion_tokens for o in outs)
        pct = [f"{100 * k / len(outs):6.1f}%" for k in (parses, valid, valid_lenient)]
        print(f"{label:26s} {' '.join(pct)} {cut:7d} {tokens:7d} {took:6.0f}")
    print("(valid: the whole reply parses and validates; valid*: the first JSON object in the reply does; "
          "length: replies cut by max_tokens)")


def engine_bench(args) -> None:
    t0 = time.perf_counter()
    engine, structured = build_engine()
    print(f"\nengine: {engine.loaded.model_id} loaded in {time.perf_counter() - t0:.1f} s")
    decode_bench(engine, structured, args.decode_tokens, args.rounds)
    validity_bench(engine, structured, args.schemas, args.rows)


if __name__ == "__main__":
    main()
