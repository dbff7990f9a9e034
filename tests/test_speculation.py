"""Speculative decoding inside continuous batching (issue 19): prompt-lookup drafts verified for
every row of the batch in one forward.

The proof is parity: with SPECULATIVE=auto every greedy reply is token for token the reply with
SPECULATIVE=off -- alone and batched, for every cache kind, and the prompt cache then holds
exactly the accepted tokens (the next turn's hit equals a cold run). Sampled rows too: each
position's draw is keyed by the position, so a seeded reply is the one SPECULATIVE=off draws, and
the draws keep the sampling distribution (checked statistically).
"""
from __future__ import annotations

import math
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxstack.cache.slab import stack_layers
from mlxstack.runner.sampling import Sampler, SamplingParams
from tests.conftest import build_engine, engine_settings
from tests.test_batching import run_batched
from tests.test_engine import job

pytestmark = pytest.mark.slow  # engines on the embedded model and every tiny kind, ~10 min here (docs/testing.md#tiers)

FILE = "\n".join(f"def func_{i}(x):\n    return x * {i} + {i * 7 % 13}" for i in range(6))
COPY = [{"role": "user", "content": "Repeat this file exactly:\n" + FILE}]
FREE = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
LOOP = [{"role": "system", "content": "one two three four one two three four one two three four"},
        {"role": "user", "content": "one two three four one two three four"}]


def engines(path, **extra):
    on = build_engine(engine_settings(path, speculative="auto", **extra))
    off = build_engine(engine_settings(path, speculative="off", **extra))
    return on, off


def spec_totals(outs):
    return (sum(o.timings["spec_proposed"] for o in outs), sum(o.timings["spec_accepted"] for o in outs))


# ------------------------------------------------------------------ the ragged slab
def test_ragged_rows_give_each_sequence_its_own_logits(tiny_dense_path):
    """Rows take back different numbers of tokens; the next forward of the batch equals each
    sequence run alone, and a row copied out holds exactly its own tokens."""
    from mlx_lm import load

    model, _ = load(str(tiny_dense_path))
    lens = [5, 9, 7]

    def own(n):
        c = make_prompt_cache(model)
        model(mx.array([list(range(100, 100 + n))]), cache=c)
        return c

    slab = stack_layers([own(n) for n in lens])
    first = mx.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    model(first, cache=slab)
    back = [3, 0, 2]
    for layer in slab:
        for r, n in enumerate(back):
            layer.rewind(r, n)
        layer.settle([0, 1, 2])
    assert slab[0].gap == [3, 0, 2] and slab[0]._idx == 13
    second = mx.array([[20, 21], [22, 23], [24, 25]])
    out = model(second, cache=slab)
    for r in range(3):
        c = own(lens[r])
        model(first[r:r + 1, :4 - back[r]], cache=c)
        ref = model(second[r:r + 1], cache=c)
        # batched matmuls round differently from single-row ones (OpenBLAS, LESSONS 23): allclose
        assert mx.allclose(ref[0], out[r], atol=1e-4, rtol=1e-4).item(), r
        assert mx.array_equal(mx.argmax(ref[0], -1), mx.argmax(out[r], -1)).item(), r
        taken = slab[0].take(r)
        assert taken.offset == lens[r] + 4 - back[r] + 2 == c[0].offset
        assert mx.allclose(taken.keys, c[0].keys[..., :c[0].offset, :], atol=1e-5).item()


def test_settle_moves_free_rows_and_the_shared_end_back(tiny_dense_path):
    from mlx_lm import load

    model, _ = load(str(tiny_dense_path))
    caches = []
    for n in (4, 6, 5):
        c = make_prompt_cache(model)
        model(mx.array([list(range(50, 50 + n))]), cache=c)
        caches.append(c)
    slab = stack_layers(caches)
    model(mx.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]]), cache=slab)
    layer = slab[0]
    assert layer._idx == 9
    layer.rewind(0, 2)
    layer.rewind(1, 2)
    layer.settle([0, 1])                      # row 2 is free: it follows the members
    assert layer.gap == [0, 0, 0] and layer._idx == 7
    assert layer.offset.tolist() == [5, 7, 6]
    with pytest.raises(ValueError):
        layer.rewind(0, 8)


# ------------------------------------------------------------------ the acceptance rule
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                    dict(temperature=1.3, top_p=0.8)])
def test_position_keyed_draws_keep_the_sampling_distribution(params):
    """The draw at each position (Gumbel-max with the position's key): distributed as the filtered
    softmax (chi-square over 4,000 positions, p > 0.001); so a draft is kept with probability
    p(draft), as the rejection rule keeps it."""
    logits = mx.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    ref = Sampler(SamplingParams(**params), [], 6)
    p = mx.softmax(ref._filtered(logits - mx.logsumexp(logits))).tolist()
    n = 4000
    for seed in (1, 2):
        s = Sampler(SamplingParams(seed=seed, **params), [], 6)
        counts = [0] * 6
        for tok in s.targets(mx.broadcast_to(logits, (n, 6))).tolist():
            counts[tok] += 1
        chi2 = sum((counts[i] - n * p[i]) ** 2 / (n * p[i]) for i in range(6) if p[i] > 0)
        assert all(counts[i] == 0 for i in range(6) if p[i] == 0), (seed, counts)
        # chi-square upper tail 0.001 for dof <= 5 is at most 20.5
        assert chi2 < 20.5, (seed, counts, [round(n * x) for x in p], chi2)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_targets_are_the_tokens_sample_draws_one_at_a_time(temperature):
    """A speculative step's verification (``targets`` over k positions, then ``skip`` of what it
    kept) gives the tokens plain decoding draws with ``sample``, position for position, and the
    draws after it are the same too: a seeded reply does not depend on where drafts were verified."""
    rows = mx.random.normal((12, 50), key=mx.random.key(3)) * 2
    plain = Sampler(SamplingParams(temperature=temperature, seed=11), [], 50)
    want = [int(plain.sample(rows[j]).item()) for j in range(12)]
    spec = Sampler(SamplingParams(temperature=temperature, seed=11), [], 50)
    got = []
    for lo, hi, kept in ((0, 5, 2), (2, 3, 1), (3, 12, 9)):     # verify 5, keep 2; verify 1 ...
        t = spec.targets(rows[lo:hi]).tolist()
        assert t[:kept] == want[lo:lo + kept]
        spec.skip(kept)
        got += t[:kept]
    assert got == want
    if temperature:
        assert len(set(want)) > 3                                # sampled, not an argmax in disguise
        other = Sampler(SamplingParams(temperature=temperature, seed=12), [], 50)
        assert [int(other.sample(rows[j]).item()) for j in range(12)] != want


# ------------------------------------------------------------------ parity through the scheduler
def test_copy_heavy_replies_are_identical_and_most_tokens_come_from_drafts(embedded_model_path):
    """The embedded model repeating a file, alone and batched with free text: the same tokens as
    SPECULATIVE=off, and most of the copy comes from accepted drafts."""
    on, off = engines(embedded_model_path, prompt_cache_max_entries_global=0)
    # drafts priced by the prior, not by this run's step timings (how much a wider step costs
    # against a plain one moves with the machine's load and decides how much is drafted)
    costs = on.speculation.costs
    costs.wants_plain, costs.cost = (lambda rows: False), costs.prior_cost
    jobs = lambda: [job(COPY, max_tokens=60, session="c")[0], job(FREE, max_tokens=40, session="f")[0],  # noqa: E731
                    job(COPY, max_tokens=50, session="c2")[0]]
    spec, _ = run_batched(on, jobs())
    plain, _ = run_batched(off, jobs())
    assert [o.raw_text for o in spec] == [o.raw_text for o in plain]
    assert [o.completion_tokens for o in spec] == [o.completion_tokens for o in plain]
    proposed, accepted = spec_totals(spec[:1])
    assert accepted >= spec[0].completion_tokens // 2, (proposed, accepted, spec[0].completion_tokens)
    assert spec_totals(plain) == (0, 0)
    assert on.state.counters.get("spec_accepted") == spec_totals(spec)[1]
    alone, _ = run_batched(on, [job(COPY, max_tokens=60, session="alone")[0]])   # a group of one
    assert alone[0].raw_text == spec[0].raw_text and alone[0].timings["spec_accepted"] > 0


def test_every_slab_row_holds_exactly_its_depth_after_every_step(embedded_model_path, monkeypatch):
    """Eight rows, copy-heavy and free text: rows accept different numbers of drafts, finish at
    different steps and leave. After every step each member's slab row holds exactly its counted
    depth and its RoPE offset says the same; the replies equal SPECULATIVE=off."""
    from mlxstack.runner import batch as batch_mod

    settle = batch_mod.DecodeGroup.settle     # a step ends once the core's verdicts are settled
    checked = []

    def checking(self, *args, **kwargs):
        out = settle(self, *args, **kwargs)
        if self.slab is not None:
            layer = self.slab[self.kv_idx[0]]
            pads, offsets = layer.left_padding.tolist(), layer.offset.tolist()
            for s in self.seqs:
                r = self.row[id(s)]
                assert layer._idx - layer.gap[r] - pads[r] == offsets[r] == s.live.depth, (r, layer.gap)
                checked.append(r)
        return out

    monkeypatch.setattr(batch_mod.DecodeGroup, "settle", checking)
    on, off = engines(embedded_model_path, prompt_cache_max_entries_global=0)
    jobs = lambda: [job(m, max_tokens=40 + 3 * i, session=f"r{i}")[0]  # noqa: E731
                    for i, m in enumerate([COPY, FREE, COPY, FREE, COPY, LOOP, FREE, COPY])]
    spec, _ = run_batched(on, jobs())
    plain, _ = run_batched(off, jobs())
    assert [o.raw_text for o in spec] == [o.raw_text for o in plain]
    assert spec_totals(spec)[1] > 0 and len(checked) > 100


KINDS = ["dense", "gemma3", "llama4", "mamba2", "lfm2", "hybrid", "gpt_oss"]
# rows draft in a batch of plain KV layers (ragged slab rows); sliding windows draft only before they
# rotate (these fixtures' windows are shorter than the prompts), recurrent / conv state and chunked
# attention cannot take tokens back: those rows decode one token a step, unchanged
CAN_DRAFT = {"dense"}


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_parity_for_every_cache_kind(kind, tiny_kind_paths):
    """Three requests batched, then a warm second turn: replies identical to SPECULATIVE=off, the
    second turn reuses the same number of tokens (the cache holds exactly the accepted tokens)."""
    path = tiny_kind_paths(kind)
    on, off = engines(path)
    first = lambda: [job(LOOP, max_tokens=24, session="a")[0], job(FREE, max_tokens=16, session="b")[0],  # noqa: E731
                     job(COPY, max_tokens=20, session="c")[0]]
    spec, _ = run_batched(on, first())
    plain, _ = run_batched(off, first())
    assert [o.raw_text for o in spec] == [o.raw_text for o in plain]
    proposed, accepted = spec_totals(spec)
    if kind in CAN_DRAFT:
        assert proposed > 0, kind
    else:
        assert proposed == 0, kind
    follow = lambda o, m: m + [{"role": "assistant", "content": o.text}, {"role": "user", "content": "again"}]  # noqa: E731
    second = lambda outs: [job(follow(outs[0], LOOP), max_tokens=16, session="a")[0],  # noqa: E731
                           job(follow(outs[2], COPY), max_tokens=12, session="c")[0]]
    spec2, _ = run_batched(on, second(spec))
    plain2, _ = run_batched(off, second(plain))
    assert [o.raw_text for o in spec2] == [o.raw_text for o in plain2]
    assert [o.cached_tokens for o in spec2] == [o.cached_tokens for o in plain2]
    assert all(o.cached_tokens > 0 for o in spec2)
    cold = build_engine(engine_settings(path, speculative="off", prompt_cache_max_entries_global=0))
    ref1, _ = run_batched(cold, first())     # the same history (healing) as the warm engines
    ref, _ = run_batched(cold, second(ref1))
    assert [o.raw_text for o in spec2] == [o.raw_text for o in ref]


REPLAYED = {"gemma3", "llama4", "mamba2", "lfm2", "hybrid", "gpt_oss"}   # put back, then the kept tokens replayed


def oracle_drafts(monkeypatch, reference: list[int], every: int = 3):
    """Drafts from the reply SPECULATIVE=off produced, with one token wrong in every ``every``-th
    proposal: full acceptances, partial ones and rejections, on random weights that rarely repeat
    themselves (prompt lookup would seldom draft there)."""
    from mlxstack.runner.spec.drafting import NgramDrafter

    calls = [0]

    def propose(self, k):
        toks = self.tokens
        if k <= 0 or toks != reference[:len(toks)]:
            return []
        out = list(reference[len(toks):len(toks) + k])
        calls[0] += 1
        if out and calls[0] % every == 0:
            out[calls[0] % len(out)] = (out[calls[0] % len(out)] + 1) % 1000
        return out

    monkeypatch.setattr(NgramDrafter, "propose", propose)


def generated_ids(engine, messages, max_tokens, session):
    got = []
    consume = engine.consume

    def recording(seq, tok):
        got.append(tok)
        return consume(seq, tok)

    engine.consume = recording
    try:
        out = engine.run(job(messages, max_tokens=max_tokens, session=session)[0])
    finally:
        del engine.consume
    return out, got


@pytest.mark.parametrize("kind", KINDS)
def test_alone_every_cache_kind_takes_back_rejected_drafts(kind, tiny_kind_paths, monkeypatch):
    """One request at a time (a decode group of one on its own cache), drafts right,
    partly right and wrong: caches that can be cut take rejected drafts back, recurrent / conv state,
    rotated windows and chunked attention (past its first chunk: its front is trimmed as it goes)
    are put back and the kept tokens replayed.
    The reply and the next turn's reuse are identical to SPECULATIVE=off."""
    on, off = engines(tiny_kind_paths(kind))
    b, ids = generated_ids(off, LOOP, 30, "l")
    prompt = on.prepare(job(LOOP, max_tokens=30, session="probe")[0]).model_tokens
    oracle_drafts(monkeypatch, list(prompt) + ids)
    # whether drafting pays is decided from the prior (tokens alone), not from this run's wall
    # times: under a loaded machine the timed costs could stop drafting before any rejection
    costs = on.speculation.costs
    monkeypatch.setattr(costs, "cost", costs.prior_cost)
    monkeypatch.setattr(costs, "wants_plain", lambda rows: False)
    a = alone(on, job(LOOP, max_tokens=30, session="l")[0])
    assert a.raw_text == b.raw_text
    assert 0 < a.timings["spec_accepted"] < a.timings["spec_proposed"], kind
    assert (on.state.counters.get("spec_replays") > 0) == (kind in REPLAYED), kind
    monkeypatch.undo()
    follow = LOOP + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "more"}]
    wa = alone(on, job(follow, max_tokens=12, session="l")[0])
    wb = alone(off, job(follow, max_tokens=12, session="l")[0])
    assert wa.raw_text == wb.raw_text and wa.cached_tokens == wb.cached_tokens > 0


def alone(engine, j):
    """One request through the scheduler (a decode group of one, the server's path)."""
    return run_batched(engine, [j])[0][0]


def test_quantised_kv_parity(tiny_dense_hd64_path):
    on, off = engines(tiny_dense_hd64_path, kv_bits=8, quantized_kv_start=40)
    jobs = lambda: [job(LOOP, max_tokens=40, session="q")[0], job(COPY, max_tokens=30, session="r")[0]]  # noqa: E731
    spec, _ = run_batched(on, jobs())
    plain, _ = run_batched(off, jobs())
    assert [o.raw_text for o in spec] == [o.raw_text for o in plain]
    assert spec_totals(spec)[0] > 0


def test_a_seeded_sampled_reply_is_the_same_with_and_without_speculation(embedded_model_path):
    """Sampled rows draft as greedy ones do: alone and beside a free-text row, the seeded reply
    with drafts is token for token the reply SPECULATIVE=off draws, and drafts were accepted."""
    on, off = engines(embedded_model_path, prompt_cache_max_entries_global=0)
    costs = on.speculation.costs          # drafts priced by the prior, not by this run's step timings
    costs.wants_plain, costs.cost = (lambda rows: False), costs.prior_cost

    def sampled(eng, with_free):
        j, _ = job(COPY, max_tokens=40, session=f"s{time.time()}")
        j.params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=40, seed=7)
        jobs = [j] + ([job(FREE, max_tokens=40, session=f"f{time.time()}")[0]] if with_free else [])
        return run_batched(eng, jobs)[0]

    for with_free in (False, True):
        a, b = sampled(on, with_free), sampled(off, with_free)
        assert [o.raw_text for o in a] == [o.raw_text for o in b]
        assert a[0].timings["spec_accepted"] > 0 and b[0].timings["spec_proposed"] == 0


def test_stop_inside_accepted_drafts_leaves_exactly_the_reply_in_the_cache(embedded_model_path):
    """A stop string or max_tokens reached in the middle of accepted drafts: the reply ends there,
    and the stored entry holds the prompt and the reply only (the next turn's hit equals cold)."""
    on, off = engines(embedded_model_path)
    for mt in (7, 13):
        a = alone(on, job(COPY, max_tokens=mt, session=f"m{mt}")[0])
        b = alone(off, job(COPY, max_tokens=mt, session=f"m{mt}")[0])
        assert a.raw_text == b.raw_text and a.completion_tokens == mt
    stop = ["return x * 3"]
    a = alone(on, job(COPY, max_tokens=80, stop=stop, session="st")[0])
    b = alone(off, job(COPY, max_tokens=80, stop=stop, session="st")[0])
    assert a.text == b.text and a.finish_reason == b.finish_reason == "stop"
    assert a.timings["spec_accepted"] > 0
    follow = COPY + [{"role": "assistant", "content": a.text}, {"role": "user", "content": "thanks"}]
    wa = alone(on, job(follow, max_tokens=8, session="st")[0])
    wb = alone(off, job(follow, max_tokens=8, session="st")[0])
    assert wa.raw_text == wb.raw_text and wa.cached_tokens == wb.cached_tokens > 0


def test_speculation_off_never_drafts(embedded_model_path):
    eng = build_engine(engine_settings(embedded_model_path, spec_max_draft=0))
    out = alone(eng, job(COPY, max_tokens=20, session="z")[0])
    assert out.timings["spec_proposed"] == 0
    assert eng.speculation.describe() == "off"
    assert not math.isnan(out.timings["decode_tok_s"])


# ------------------------------------------------------------------ constrained rows
def test_a_grammar_cuts_drafts_it_refuses_and_drafts_the_text_it_forces(embedded_model_path):
    from mlxstack.constraints import GrammarCompiler, spec_for_request
    from tests.test_sampling_constraints import PERSON

    eng = build_engine(engine_settings(embedded_model_path, prompt_cache_max_entries_global=0))
    compiler = GrammarCompiler.for_tokenizer(eng.loaded.tokenizer, stop_ids=eng.stop_ids)
    grammar = compiler.compile(spec_for_request(response_format={
        "type": "json_schema", "json_schema": {"schema": PERSON, "strict": True}}))
    tok = compiler.tokenizer
    row = grammar.new_row(eng.stop_ids, 49152)
    good = tok.tokenize_str('{"name": "Bob", "age": 4')
    assert row.fits(good) == len(good)
    assert row.fits(tok.tokenize_str('{"nam": 3')) == 2            # '{"' fits, 'nam' does not
    assert row.fits([]) == 0 and row.forced(0) == []
    row.consume_prefix(tok.tokenize_str('{"name": "Bob", '))
    assert tok.decode_str(row.forced(8)) == '"age": '               # the key the schema requires next
    assert row.consumed == len(tok.tokenize_str('{"name": "Bob", '))   # fits / forced consume nothing


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_constrained_replies_with_drafts(embedded_model_path, temperature):
    """A JSON-schema row beside a copying row: drafts are accepted on the constrained row (the keys
    the grammar forces), the reply is valid, and greedy and seeded sampled replies are the ones
    SPECULATIVE=off gives (draws are keyed by position: runner/sampling.py)."""
    import json

    import jsonschema

    from mlxstack.constraints import GrammarCompiler, spec_for_request
    from tests.test_sampling_constraints import ASK, PERSON

    on, off = engines(embedded_model_path, prompt_cache_max_entries_global=0)

    def pair(eng, session):
        compiler = GrammarCompiler.for_tokenizer(eng.loaded.tokenizer, stop_ids=eng.stop_ids)
        grammar = compiler.compile(spec_for_request(response_format={
            "type": "json_schema", "json_schema": {"schema": PERSON, "strict": True}}))
        constrained, _ = job(ASK, max_tokens=80, session=session)
        constrained.params = SamplingParams(temperature=temperature, max_tokens=80, grammar=grammar, seed=5)
        return run_batched(eng, [constrained, job(COPY, max_tokens=40, session=session + "c")[0]])[0]

    spec = pair(on, "j1")
    jsonschema.validate(json.loads(spec[0].text), PERSON)
    assert spec[0].timings["spec_accepted"] > 0
    assert [o.raw_text for o in spec] == [o.raw_text for o in pair(off, "j1")]


# ------------------------------------------------------------------ the measured cost model
def test_steps_are_timed_by_rows_and_width(embedded_model_path):
    """A copy-heavy batch: the decode group takes a plain step first (the yardstick), then records
    its clean plain and speculative steps (runner/spec/step_costs.py) under the forward's row count;
    /v1/cache/stats shows them."""
    on, off = engines(embedded_model_path, prompt_cache_max_entries_global=0)
    spec = on.speculation
    assert spec.costs.seen == {}
    outs, _ = run_batched(on, [job(COPY, max_tokens=40, session=f"t{i}")[0] for i in range(2)])
    plain, _ = run_batched(off, [job(COPY, max_tokens=40, session=f"t{i}")[0] for i in range(2)])
    assert [o.raw_text for o in outs] == [o.raw_text for o in plain]
    widths = {w for (r, w) in spec.costs.seen if r == 2}
    assert 1 in widths and any(w > 1 for w in widths), spec.costs.seen
    assert 2 in spec.costs.plain and all(spec.costs.cost(2, w) >= 1.0 for w in widths)
    proposed, accepted = spec_totals(outs)
    assert accepted > proposed / 2                                 # copying: most drafts accepted
    stats = spec.stats()
    assert stats["plain_step_ms"]["2"] == round(spec.costs.plain[2] * 1000, 1)
    # every recorded (rows, width): the two rows may end a step apart (their drafts accepted
    # differently), and the last one's steps are a row count of their own
    assert set(stats["speculative_cost"]) == {f"{r}x{w}" for (r, w) in spec.costs.ratio}
    assert {f"2x{w}" for w in widths if w > 1} <= set(stats["speculative_cost"])


def test_where_a_wider_step_is_measured_dear_rows_stop_drafting_and_replies_stay_the_same(embedded_model_path):
    """The same copy-heavy request on a machine where every wider step was measured at 10 plain
    steps: no drafts (a plain step is best), the same reply as with cheap positions."""
    cheap, _ = engines(embedded_model_path, prompt_cache_max_entries_global=0)
    dear, _ = engines(embedded_model_path, prompt_cache_max_entries_global=0)
    dear.speculation.costs.record(1, 1, 0.1)
    for w in range(2, 10):
        dear.speculation.costs.record(1, w, 1.0)
    a = alone(cheap, job(COPY, max_tokens=30, session="a")[0])
    b = alone(dear, job(COPY, max_tokens=30, session="b")[0])
    assert a.raw_text == b.raw_text
    assert a.timings["spec_accepted"] > 0 and b.timings["spec_proposed"] == 0


def test_ranks_in_lockstep_decide_from_the_prior_never_from_their_clocks(embedded_model_path):
    """With several ranks every rank must take the same steps (the same collectives in the same
    order): wall times differ per rank, so a replicated engine ignores what it measured -- here a
    measured 10 plain steps for any wider step -- and drafts as the prior says."""
    eng, _ = engines(embedded_model_path, prompt_cache_max_entries_global=0)
    eng.state.replicated = eng.runner.replicated = True    # as engine/lockstep.py bind leaves them
    eng.speculation.costs.record(1, 1, 0.1)
    for w in range(2, 10):
        eng.speculation.costs.record(1, w, 1.0)
    out = alone(eng, job(COPY, max_tokens=30, session="r")[0])
    assert out.timings["spec_accepted"] > 0


def test_step_costs_are_timed_at_load_on_the_models_own_forward(tiny_dense_path, tiny_hybrid_path):
    """SPEC_CALIBRATE=auto: forwards of 1 and 2..13 positions for 1 and 8 rows, timed once at load,
    are the width chooser's prior (non-decreasing in width, never below a plain step); a model whose
    cache cannot be cut back keeps the constant; off, or speculation off: nothing is timed."""
    from mlxstack.runner.spec.calibration import WIDTHS

    eng = build_engine(engine_settings(tiny_dense_path, spec_calibrate="auto"))
    table = eng.speculation.costs.table
    assert sorted(table) == [(r, w) for r in (1, 8) for w in WIDTHS]
    for r in (1, 8):
        row = [table[(r, w)] for w in WIDTHS]
        assert row == sorted(row) and row[0] >= 1.0
    assert eng.speculation.costs.prior_cost(8, 4) == table[(8, 4)]
    assert eng.speculation.stats()["calibrated_cost"]["8x13"] == table[(8, 13)]
    assert build_engine(engine_settings(tiny_dense_path, spec_calibrate="auto", max_concurrent_sequences=2)
                        ).speculation.costs.table.keys() == {(r, w) for r in (1, 2) for w in WIDTHS}
    assert build_engine(engine_settings(tiny_hybrid_path, spec_calibrate="auto")).speculation.costs.table == {}
    assert build_engine(engine_settings(tiny_dense_path, spec_calibrate="auto", speculative="off")
                        ).speculation.costs.table == {}
    assert build_engine(engine_settings(tiny_dense_path)).speculation.costs.table == {}


def test_calibration_pairs_each_wide_forward_with_a_plain_one_so_a_busy_machine_cannot_price_it_out(tiny_dense_path):
    """The guard found the width chooser never drafting for single streams: the table was timed
    while the other stack was starting (one plain timing, then wide ones on a busy machine: 1x2 =
    4.4 plain steps), and a prior that says "never" is never measured again. Now every wide forward
    is timed right after a plain one and the smallest ratio kept, and no width costs more than that
    many plain steps. A scripted clock: the machine turns 3x slower after the first plain forward."""
    from mlx_lm import load

    from mlxstack.runner.spec.calibration import calibrate

    model, _ = load(str(tiny_dense_path))

    def scripted(durations):
        it, now, started = iter(durations), [0.0], [False]

        def clock():
            started[0] = not started[0]
            if not started[0]:
                now[0] += next(it)
            return now[0]
        return clock

    def run(wide):
        durations = [1.0]                                  # the first plain forward, before the load
        for w in (2, 4):
            durations.append(9.9)                          # this width's warm-up
            for _ in range(3):
                durations += [3.0, 3.0 * wide(w)]          # plain, then wide: both under the load
        return calibrate(model, rows=(1,), widths=(2, 4), repeats=2, clock=scripted(durations))

    assert run(lambda w: 1 + 0.05 * (w - 1)) == {(1, 2): 1.05, (1, 4): 1.15}
    assert run(lambda w: 50.0) == {(1, 2): 2.0, (1, 4): 4.0}       # never above w plain steps
