"""The per-request sampler with a grammar (runner/sampling.py + constraints/): every sampled token
is one the grammar allows on the greedy and the sampled path, logit_bias and penalties keep working,
and real decodes -- alone and in one batched step with an unconstrained request, through the real
engine and scheduler -- produce JSON that validates, while the unconstrained row is unchanged.
"""
from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from mlxstack.constraints import GrammarCompiler, spec_for_request
from mlxstack.runner.sampling import Sampler, SamplingParams
from tests.conftest import build_engine, engine_settings
from tests.test_batching import run_batched
from tests.test_engine import job

pytestmark = pytest.mark.slow  # constrained sampling on the embedded model (docs/testing.md#tiers)

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


@pytest.fixture(scope="module")
def engine(embedded_model_path):
    return build_engine(engine_settings(embedded_model_path))


@pytest.fixture(scope="module")
def compiler(engine):
    return GrammarCompiler.for_tokenizer(engine.loaded.tokenizer, stop_ids=engine.stop_ids)


def person_grammar(compiler):
    return compiler.compile(spec_for_request(response_format={
        "type": "json_schema", "json_schema": {"schema": PERSON, "strict": True}}))


def allowed_set(row) -> set[int] | None:
    a = row.allowed()
    return None if a is None else set(a.tolist())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=60),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=3, max_tokens=60),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                   logprobs=True, top_logprobs=3, max_tokens=60),
], ids=["greedy", "sampled", "penalties"])
def test_every_sampled_token_is_allowed_even_against_logit_bias(compiler, params):
    """Random logits, and a bias of +100 on a token the grammar never allows here ("Hello")."""
    width = compiler.tokenizer.vocab_size + 64                   # logits wider than the vocabulary
    rng = np.random.default_rng(0)
    grammar = person_grammar(compiler)
    params = replace(params, logit_bias={9906: 100.0, width - 1: 100.0}, grammar=grammar,
                     stop_token_ids=frozenset({2}))
    sampler = Sampler(params, history=[1, 2, 3], vocab_size=width)
    shadow = grammar.new_row({2}, width)                         # the same grammar, advanced alongside
    out = []
    for _ in range(60):
        allowed = allowed_set(shadow)
        tok = sampler.sample(mx.array(rng.normal(size=(1, width)).astype(np.float32)))
        t = int(tok.item())
        assert t in allowed, (t, len(out))
        if t == 2:
            break
        out.append(t)
        sampler.accept(tok)
        shadow.consume(t)
    text = compiler.tokenizer.decode_str(out)
    assert t == 2 and sampler.constraint.finished, text
    jsonschema.validate(json.loads(text), PERSON)
    if params.logprobs:
        assert all(np.isfinite(lp.logprob.item()) for lp in sampler.logprobs)


def test_grammar_after_the_engine_forced_prefix(compiler):
    """The engine may still write the opening itself (chat.py ``_reply_prefix``): consume_prefix."""
    grammar = person_grammar(compiler)
    s = Sampler(SamplingParams(grammar=grammar, stop_token_ids=frozenset({2})), [1], compiler.tokenizer.vocab_size)
    s.constraint.consume_prefix(compiler.tokenizer.tokenize_str("{"))
    assert not s.constraint.dead_end
    first = int(s.sample(mx.zeros((compiler.tokenizer.vocab_size,))).item())
    assert compiler.tokenizer.decode_str([first]).startswith('"')


def test_real_greedy_decode_produces_valid_json(engine, compiler):
    params = SamplingParams(temperature=0.0, max_tokens=80, grammar=person_grammar(compiler))
    j, streamed = job(ASK, max_tokens=80)
    j.params = params
    out = engine.run(j)
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), PERSON)
    assert "".join(streamed) == out.text


def test_constrained_and_free_rows_decode_in_the_same_batch_step(engine, compiler):
    free_msgs = [{"role": "user", "content": "Name three colours."}]
    solo = engine.run(job(free_msgs, max_tokens=24, session="free")[0])
    constrained, _ = job(ASK, max_tokens=80, session="json")
    constrained.params = SamplingParams(temperature=0.0, max_tokens=80, grammar=person_grammar(compiler))
    outs, sizes = run_batched(engine, [constrained, job(free_msgs, max_tokens=24, session="free")[0]])
    assert max(sizes) == 2                                       # they really shared decode steps
    jsonschema.validate(json.loads(outs[0].text), PERSON)
    assert outs[1].raw_text == solo.raw_text                     # the free row is untouched
