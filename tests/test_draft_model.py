"""Speculative decoding with a draft model (issue 19, DRAFT_MODEL): the draft model's greedy tokens
verified by the target in its batched step.

Parity is the proof again: whatever the draft model proposes, greedy replies are token for token
the replies with SPECULATIVE=off (batched and alone, for cache kinds that cut and that replay). A
draft model identical to the target has every draft accepted (the verification agrees with the
drafts exactly); a different one has drafts rejected and changes nothing else. The draft model's
cache is cut back to the accepted tokens and reused by the next turn: its drafts after a reuse or a
cut equal a fresh cache's. A draft model with another vocabulary is refused at start.
"""
from __future__ import annotations

import pytest

from mlxstack.config.settings import SettingsError
from mlxstack.cache.lcp import lcp
from mlxstack.runner.spec.draft_model import DraftModel
from mlxstack.models.loaded import ModelLoadError
from mlxstack.models.loader import tokenizer_mismatch
from mlxstack.runner.spec.drafting import Chained
from tests.conftest import build_engine, engine_settings
from tests.test_batching import run_batched
from tests.test_engine import job
from tests.test_speculation import COPY, FREE, LOOP, alone, spec_totals

pytestmark = pytest.mark.slow  # draft models on every tiny kind, ~1 min here (docs/testing.md#tiers)


def draft_engines(path, draft, mode="draft", **extra):
    """(speculating engine, SPECULATIVE=off engine); the draft model's cost and the wider step's are
    set to zero so every step drafts (the adaptive switch and the measured costs are tested apart:
    these tests are about what drafts do)."""
    on = build_engine(engine_settings(path, speculative=mode, draft_model=str(draft), **extra))
    on.speculation.draft.cost = 0.0
    free = on.speculation.costs                # and wider steps measured as free, no plain yardstick
    free.wants_plain = lambda rows: False
    free.cost = lambda rows, width: 1.0
    off = build_engine(engine_settings(path, speculative="off", **extra))
    return on, off


def three():
    return [job(LOOP, max_tokens=24, session="a")[0], job(FREE, max_tokens=16, session="b")[0],
            job(COPY, max_tokens=20, session="c")[0]]


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_dense_path):
    on, off = draft_engines(tiny_dense_path, tiny_dense_path)
    spec, _ = run_batched(on, three())
    plain, _ = run_batched(off, three())
    assert [o.raw_text for o in spec] == [o.raw_text for o in plain]
    proposed, accepted = spec_totals(spec)
    assert proposed > 20 and accepted == proposed
    assert all(o.timings["spec_proposed"] > 0 for o in spec)
    # drafts were decoded by the draft model, one step of drafts per verifying step
    assert on.speculation.draft.drafted >= proposed


@pytest.mark.parametrize("kind", ["dense", "hybrid", "gemma3"])
def test_a_different_draft_model_changes_nothing_but_speed(kind, tiny_kind_paths):
    """Random drafts from another model: rejected (mostly), taken back -- cut for plain KV rows in
    the batch, put back and replayed for recurrent state / rotated windows alone -- and the replies
    and the next turn's reuse are those of SPECULATIVE=off."""
    on, off = draft_engines(tiny_kind_paths(kind), tiny_kind_paths("dense_hd64"))
    if kind == "dense":
        spec, _ = run_batched(on, three())
        plain, _ = run_batched(off, three())
    else:
        spec = [alone(on, j) for j in three()]
        plain = [alone(off, j) for j in three()]
    assert [o.raw_text for o in spec] == [o.raw_text for o in plain]
    proposed, accepted = spec_totals(spec)
    assert proposed > 0 and accepted < proposed
    if kind != "dense":
        assert on.state.counters.get("spec_replays") > 0
    follow = COPY + [{"role": "assistant", "content": spec[2].text}, {"role": "user", "content": "again"}]
    follow_off = COPY + [{"role": "assistant", "content": plain[2].text}, {"role": "user", "content": "again"}]
    wa = alone(on, job(follow, max_tokens=10, session="c")[0])
    wb = alone(off, job(follow_off, max_tokens=10, session="c")[0])
    assert wa.raw_text == wb.raw_text and wa.cached_tokens == wb.cached_tokens > 0


def test_auto_tries_prompt_lookup_first_then_the_draft_model(tiny_dense_path):
    on, off = draft_engines(tiny_dense_path, tiny_dense_path, mode="auto")
    row_drafter = on.speculation.row

    kinds = []

    def row(seq):
        spec = row_drafter(seq)
        kinds.append(type(spec.drafter))
        return spec

    on.speculation.row = row
    spec, _ = run_batched(on, three())
    plain, _ = run_batched(off, three())
    assert [o.raw_text for o in spec] == [o.raw_text for o in plain]
    assert kinds == [Chained] * 3
    proposed, accepted = spec_totals(spec)
    # the target drafting for itself: every draft, looked up or decoded, is accepted
    assert proposed > 0 and accepted == proposed and on.speculation.draft.drafted > 0


def test_seeded_sampling_with_a_draft_model_is_reproducible(tiny_dense_path):
    from mlxstack.runner.sampling import SamplingParams

    on, _ = draft_engines(tiny_dense_path, tiny_dense_path, prompt_cache_max_entries_global=0)

    def sampled(session):
        j, _ = job(COPY, max_tokens=30, session=session)
        j.params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=11)
        return alone(on, j)

    a, b = sampled("x"), sampled("y")
    assert a.raw_text == b.raw_text and a.timings["spec_proposed"] > 0


# ------------------------------------------------------------------ the draft model's own cache
def draft_of(path, **kw):
    from mlx_lm import load

    model, tok = load(str(path))
    return DraftModel(model, vocab=len(tok._tokenizer) if hasattr(tok, "_tokenizer") else 10 ** 6, cost=0.1, **kw), tok


def test_drafts_after_a_cut_or_a_reused_cache_equal_a_fresh_caches(tiny_dense_path):
    dm, tok = draft_of(tiny_dense_path)
    prompt = tok.encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")
    d = dm.drafter(prompt)
    first = d.propose(5)
    assert len(first) == 5 and dm.fed == len(prompt) and dm.drafted == 5
    # the target kept 2 drafts and chose its own next token: the cache is cut to the agreement
    d.extend(first[:2] + [7])
    fresh = DraftModel(dm.model, vocab=dm.vocab, cost=0.1).drafter(prompt + first[:2] + [7])
    assert d.propose(4) == fresh.propose(4)
    assert dm.fed == len(prompt) + 1          # only the target's own token was new to the cache
    d.close()
    assert len(dm.store) == 1
    # the next turn: a longer prompt sharing the first turn's tokens reuses them
    turn2 = prompt + first[:2] + [7] + tok.encode(" and again")
    held = dm.store.items()[0][1][1]
    shared = lcp(held, turn2)
    before = dm.fed
    e = dm.drafter(turn2)
    assert len(dm.store) == 0 and dm.reused == shared
    again = DraftModel(dm.model, vocab=dm.vocab, cost=0.1).drafter(turn2)
    assert e.propose(3) == again.propose(3)
    assert dm.fed - before == len(turn2) - shared


def test_the_draft_model_catches_up_on_at_most_its_window(tiny_dense_path):
    """DRAFT_WINDOW: a long prompt is drafted from its last ``window`` tokens (the drafts of that
    window as a prompt), a turn that extends it reuses the cache past its skipped context, and a
    row that fell further behind than the window starts over on the last ``window`` tokens."""
    dm, tok = draft_of(tiny_dense_path, window=8)
    unbounded = DraftModel(dm.model, vocab=dm.vocab, cost=0.1)
    prompt = tok.encode("one two three four five six seven eight nine ten eleven twelve thirteen")
    assert len(prompt) > 12
    d = dm.drafter(prompt)
    first = d.propose(3)
    assert dm.fed == 8 and first == unbounded.drafter(prompt[-8:]).propose(3)
    d.extend(first[:1] + [5])
    assert d.propose(3) == unbounded.drafter(prompt[-8:] + first[:1] + [5]).propose(3)
    assert dm.fed == 9                          # the target's own token only
    held = list(d.held)
    d.close()
    turn2 = prompt + first[:1] + [5, 9, 10]
    e = dm.drafter(turn2)
    base = len(prompt) - 8
    assert lcp(held, turn2) >= len(prompt) + 2     # the accepted draft and the target's token
    assert dm.reused == lcp(held, turn2) - base     # what the cache holds of them
    assert e.propose(2) == unbounded.drafter(turn2[base:]).propose(2)
    assert dm.fed == 9 + len(turn2) - lcp(held, turn2)
    far = list(range(200, 220))                 # 20 tokens behind: more than the window
    e.extend(far)
    fed = dm.fed
    assert e.propose(2) == unbounded.drafter((turn2 + far)[-8:]).propose(2)
    assert dm.fed == fed + 8


def test_the_store_is_bounded_in_entries_and_bytes(tiny_dense_path):
    dm, tok = draft_of(tiny_dense_path, max_entries=2)
    drafters = [dm.drafter(tok.encode(text)) for text in ("alpha beta", "gamma delta", "epsilon")]
    for d in drafters:
        d.propose(2)
    drafters[0].close()
    drafters[0].close()                       # closing twice gives back once
    assert len(dm.store) == 1
    drafters[1].close()
    drafters[2].close()                       # the oldest goes first
    prompts = [tok.encode("gamma delta"), tok.encode("epsilon")]
    held = [h for _, (_, h, _, _) in dm.store.items()]
    assert [h[:len(p)] for h, p in zip(held, prompts)] == prompts and [len(h) for h in held] == [len(p) + 1 for p in prompts]
    small, _ = draft_of(tiny_dense_path, max_bytes=1)
    d = small.drafter(tok.encode("hello there"))
    d.propose(2)
    d.close()
    assert len(small.store) == 0 and small.store.nbytes == 0


# ------------------------------------------------------------------ refused at start
def test_a_draft_model_with_another_vocabulary_is_refused(tiny_dense_path, embedded_model_path):
    # the tiny fixtures add Qwen's special tokens to SmolLM2's 49152: the embedded model lacks them
    with pytest.raises(ModelLoadError, match="does not share the tokenizer.*tokens vs"):
        build_engine(engine_settings(tiny_dense_path, speculative="draft", draft_model=str(embedded_model_path)))


class _Vocab:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_tokenizer_mismatch_names_the_difference():
    a = _Vocab({"a": 0, "b": 1, "c": 2})
    assert tokenizer_mismatch(a, _Vocab({"a": 0, "b": 1, "c": 2})) == ""
    assert tokenizer_mismatch(a, _Vocab({"a": 0, "b": 1})) == "2 tokens vs 3"
    assert tokenizer_mismatch(a, _Vocab({"a": 0, "c": 1, "b": 2})) == "2 tokens map to other ids, e.g. 'b'"
    assert tokenizer_mismatch(a, object()) == "a tokenizer without a vocabulary to compare"


def test_draft_mode_needs_a_draft_model():
    with pytest.raises(SettingsError, match="SPECULATIVE=draft needs DRAFT_MODEL"):
        engine_settings("", speculative="draft")


def test_ngram_mode_leaves_the_draft_model_unloaded(tiny_dense_path):
    eng = build_engine(engine_settings(tiny_dense_path, speculative="ngram", draft_model=str(tiny_dense_path)))
    assert eng.speculation.draft is None and "draft model" not in eng.speculation.describe()


def test_one_request_at_a_time_still_drafts(tiny_dense_path):
    """MAX_CONCURRENT_SEQUENCES=1 runs through a one-slot scheduler, whose decode group drafts:
    a request over HTTP has drafts accepted, and its reply is the one SPECULATIVE=off gives."""
    import json
    import urllib.request

    from tests.conftest import LiveServer

    body = {"messages": LOOP, "max_tokens": 24, "temperature": 0}
    server = LiveServer(engine_settings(tiny_dense_path, max_concurrent_sequences=1, speculative="draft",
                                        draft_model=str(tiny_dense_path)))
    try:
        server.app.engine.speculation.draft.cost = 0.0
        assert server.app.worker.core is not None and server.app.worker.core.max_sequences == 1
        req = urllib.request.Request(server.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = json.loads(resp.read())["choices"][0]["message"]["content"]
        counters = server.app.engine.state.counters
        assert counters.get("spec_accepted") == counters.get("spec_proposed") > 0
        with urllib.request.urlopen(server.base + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        draft = server.app.engine.speculation.draft
        for name, value in (("tokens", draft.drafted), ("fed", draft.fed)):
            key = f"mlxstack_draft_model_{name + '_' if name == 'fed' else ''}tokens_total"
            assert f"{key} {float(value)}" in metrics and value > 0, key
    finally:
        server.close()
    off = build_engine(engine_settings(tiny_dense_path, speculative="off"))
    assert alone(off, job(LOOP, max_tokens=24, session="h")[0]).text == text
