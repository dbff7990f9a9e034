"""Token-level constraints (mlxstack/constraints/) on real tokenizers: the embedded SmolLM2 one,
a Qwen-style one (``<tool_call>`` / ``</think>`` added tokens) and a harmony one (special tokens).

Rows are driven two ways: ``write`` makes the model "want" a text and follows the mask (fails when
the mask forbids it), ``walk`` picks random allowed tokens until the grammar ends -- every walk
must parse back (parsing/) into output that validates against the schema.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from mlxstack.constraints import (GLM, HARMONY, HERMES, QWEN_XML, TOOL_FORMATS, BatchMasks, GrammarCompiler,
                                  GrammarTooComplex, SchemaError, SpecError, compiler_options, json_spec,
                                  spec_for_request, tool_format_for)
from mlxstack.constraints import grammars
from mlxstack.parsing import tool_calls
from mlxstack.parsing.harmony import split_harmony
from mlxstack.parsing.tool_calls import parse_tool_calls

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["c", "f"]},
    "alerts": {"type": "boolean"}}, "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


class Tok:
    """A tokenizer with its compiler, token bytes, and stop ids."""

    def __init__(self, folder: Path, stop: list[str]) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(folder))
        self.stop = [self.hf.convert_tokens_to_ids(t) for t in stop]
        self.compiler = GrammarCompiler.for_tokenizer(self.hf, stop_ids=self.stop)
        llt = self.compiler.tokenizer
        self.vocab = llt.vocab_size
        self.bytes = [llt.decode_bytes([i]) for i in range(self.vocab)]

    def row(self, spec, width: int | None = None):
        return self.compiler.compile(spec).new_row(self.stop, width or self.vocab)

    def text(self, ids) -> str:
        return b"".join(self.bytes[i] for i in ids if i not in self.stop).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def smol(embedded_model_path) -> Tok:
    return Tok(embedded_model_path, ["<|im_end|>"])


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, embedded_model_path) -> Tok:
    from tests.fixtures.tiny_models import _write_tokenizer

    folder = tmp_path_factory.mktemp("qwen_tok")
    _write_tokenizer(folder, embedded_model_path)
    return Tok(folder, ["<|im_end|>"])


@pytest.fixture(scope="module")
def harmony(tmp_path_factory, embedded_model_path) -> Tok:
    from tests.fixtures.tiny_gpt_oss import write_harmony_tokenizer

    folder = tmp_path_factory.mktemp("harmony_tok")
    write_harmony_tokenizer(folder, embedded_model_path)
    return Tok(folder, ["<|return|>", "<|call|>"])


def write(tok: Tok, row, text: str) -> list[int]:
    """Write ``text`` through the mask, longest allowed token first; AssertionError when it cannot."""
    rest, out = text.encode(), []
    while rest:
        allowed = row.allowed()
        ids = range(tok.vocab) if allowed is None else allowed.tolist()
        best = max((i for i in ids if tok.bytes[i] and rest.startswith(tok.bytes[i])),
                   key=lambda i: len(tok.bytes[i]), default=None)
        assert best is not None, f"the mask forbids {rest[:20]!r} after {tok.text(out)!r} ({row.state})"
        row.consume(best)
        out.append(best)
        rest = rest[len(tok.bytes[best]):]
    return out


def walk(tok: Tok, row, rng: random.Random, steps: int = 400, stop_p: float = 0.5) -> list[int]:
    """Random allowed tokens until a stop token (taken with ``stop_p`` whenever it is allowed)."""
    out = []
    for _ in range(steps):
        allowed = row.allowed()
        assert allowed is not None and len(allowed), (row.state, tok.text(out))
        stops = [i for i in allowed.tolist() if i in tok.stop]
        pick = rng.choice(stops) if stops and (rng.random() < stop_p or len(stops) == len(allowed)) \
            else rng.choice([i for i in allowed.tolist() if i not in tok.stop])
        out.append(pick)
        if pick in tok.stop:
            return out
        row.consume(pick)
    raise AssertionError(f"no stop within {steps} tokens: {tok.text(out)[:300]!r}")


def allows(row, tid: int) -> bool:
    a = row.allowed()
    return a is None or tid in set(a.tolist())


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


# ------------------------------------------------------------------ JSON
def test_json_object_is_forced_from_the_first_token_then_only_stop(smol):
    row = smol.row(spec_for_request(response_format={"type": "json_object"}))
    first = row.allowed()
    assert all(smol.bytes[i].lstrip(b" \t\r\n").startswith(b"{") or not smol.bytes[i].strip()
               for i in first.tolist())                      # "{", or a little whitespace first
    write(smol, row, '{"a": [1, 2], "b": {"c": "d"}}')
    assert row.finished and row.allowed().tolist() == smol.stop


def test_json_schema_walks_validate(smol):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["name", "age"], "additionalProperties": False}
    spec = spec_for_request(response_format={"type": "json_schema", "json_schema": {"schema": schema, "strict": True}})
    rng = random.Random(7)
    for _ in range(12):
        ids = walk(smol, smol.row(spec), rng)
        jsonschema.validate(json.loads(smol.text(ids)), schema)


def _accepts(tok: Tok, spec, text: str) -> bool:
    """Whether the grammar lets ``text`` through whole and then allows the end of the reply."""
    row = tok.row(spec)
    try:
        write(tok, row, text)
    except AssertionError:
        return False
    return bool(set(row.allowed().tolist()) & set(tok.stop))


def _field(sub: dict, strict: bool = True):
    schema = {"type": "object", "properties": {"n": sub}, "required": ["n"], "additionalProperties": False}
    return spec_for_request(response_format={"type": "json_schema", "json_schema": {"schema": schema, "strict": strict}})


SAFE = 2**53 - 1     # 9007199254740991: the largest integer every JSON client holds exactly


@pytest.mark.parametrize("strict", [True, False])
def test_an_integer_has_at_most_the_safe_range_16_digits(smol, strict):
    spec = _field({"type": "integer"}, strict)
    for n in ("1234567890123456", str(SAFE), str(-SAFE), "0", "-7"):
        assert _accepts(smol, spec, '{"n": %s}' % n), n
    for n in ("12345678901234567", str(SAFE + 1), str(-SAFE - 1), "1" * 60):
        assert not _accepts(smol, spec, '{"n": %s}' % n), n


def test_the_schemas_own_integer_bounds_are_kept_and_loose_ones_capped(smol):
    tight = _field({"type": "integer", "minimum": 1, "exclusiveMaximum": 15})
    assert [_accepts(smol, tight, '{"n": %d}' % n) for n in (0, 1, 14, 15)] == [False, True, True, False]
    beyond = _field({"type": "integer", "minimum": 10**17, "maximum": 10**18})   # nothing in the safe range:
    assert _accepts(smol, beyond, '{"n": %d}' % (10**17 + 5))                     # the schema's own, unchanged
    capped = _field({"type": ["integer", "null"], "maximum": 10**30})
    assert _accepts(smol, capped, '{"n": %d}' % SAFE) and _accepts(smol, capped, '{"n": null}')
    assert not _accepts(smol, capped, '{"n": %d}' % (SAFE + 1))
    assert not _accepts(smol, capped, '{"n": %d}' % -(SAFE + 1))


def test_a_number_has_at_most_16_integer_and_9_fraction_digits_and_no_exponent(smol):
    spec = _field({"type": "number"})
    for n in ("3", "-2.5", "9999999999999999.123456789", "-0.000000001", "1234567890123456"):
        assert _accepts(smol, spec, '{"n": %s}' % n), n
    for n in ("10000000000000000", "0.1234567891", "1.5e3", "1E-7", "3." + "3" * 40):
        assert not _accepts(smol, spec, '{"n": %s}' % n), n
    own = _field({"type": "number", "multipleOf": 0.25, "minimum": 0})            # its own multipleOf decides the fraction
    assert [_accepts(smol, own, '{"n": %s}' % n) for n in ("0.75", "0.7", "-0.25")] == [True, False, False]


def test_numbers_anywhere_a_value_is_free_are_bounded_too(smol):
    obj = spec_for_request(response_format={"type": "json_object"})
    assert _accepts(smol, obj, '{"a": [1234567890123456, 2.5, {"b": -0.125}], "c": "x", "d": null}')
    for bad in ('{"a": 12345678901234567}', '{"a": [1, {"b": 0.1234567891}]}', '{"a": 1e5}'):
        assert not _accepts(smol, obj, bad), bad
    anything = spec_for_request(response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    assert _accepts(smol, anything, "[1234567890123456]") and not _accepts(smol, anything, "[12345678901234567]")
    call = spec_for_request(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"description": "anything"}}}}}], tool_choice="required")
    assert _accepts(smol, call, '<tool_call>\n{"name": "f", "arguments": {"q": [7], "extra": 1.5}}\n</tool_call>')
    assert not _accepts(smol, call, '<tool_call>\n{"name": "f", "arguments": {"q": [%s]}}\n</tool_call>' % ("9" * 17))


def test_strict_schema_with_an_unsupported_keyword_is_an_error_non_strict_ignores_it(smol):
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    with pytest.raises(SchemaError) as err:
        smol.compiler.compile(spec_for_request(response_format={
            "type": "json_schema", "json_schema": {"schema": schema, "strict": True}}))
    assert err.value.param == "response_format.json_schema.schema#/properties/a" and "not" in err.value.reason
    smol.compiler.compile(spec_for_request(response_format={"type": "json_schema", "json_schema": {"schema": schema}}))


@pytest.mark.parametrize("schema, pointer, words", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "#/properties/a", "Invalid type"),
    ({"type": "object", "properties": {"b": {"type": "array", "items": {"type": "string", "pattern": "(?<=x)y"}}}},
     "#/properties/b/items", "look-around"),
    ({"type": "object", "properties": {"when": {"type": "string", "format": "weird"}}}, "#/properties/when",
     "Unknown format"),
    ({"$defs": {"x": {"type": "integer", "minimum": "zero"}}, "type": "object",
      "properties": {"n": {"$ref": "#/$defs/x"}}}, "#/$defs/x", "minimum"),
    ({"type": "object", "properties": {"r": {"$ref": "#/$defs/missing"}}}, "#/properties/r", "does not exist"),
])
def test_bad_schema_error_names_the_path(smol, schema, pointer, words):
    fmt = {"type": "json_schema", "json_schema": {"schema": schema, "strict": True}}
    with pytest.raises(SchemaError) as err:
        smol.compiler.compile(spec_for_request(response_format=fmt))
    assert err.value.pointer == pointer and words in err.value.reason, str(err.value)
    assert str(err.value).startswith(f"response_format.json_schema.schema{pointer}: ")


def test_bad_tool_schema_names_the_tool(smol):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "maximum": "ten"}}}}}]
    with pytest.raises(SchemaError) as err:
        smol.compiler.compile(spec_for_request(tools=tools, tool_choice="required", specials=smol.compiler.specials))
    assert err.value.param == "tools[1].function.parameters#/properties/x"
    with pytest.raises(SpecError, match="not in tools"):
        spec_for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_schema_too_large_fails_fast_and_a_slow_compile_times_out(smol):
    big = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(3000)}}
    small = GrammarCompiler(smol.compiler.tokenizer, smol.compiler.specials, limits={"max_grammar_size": 2000})
    t0 = time.perf_counter()
    with pytest.raises(GrammarTooComplex) as err:
        small.compile(json_spec(big, strict=True))
    assert time.perf_counter() - t0 < 2.0 and "too big" in err.value.reason
    hasty = GrammarCompiler(smol.compiler.tokenizer, smol.compiler.specials, timeout_s=0.01)
    t0 = time.perf_counter()
    with pytest.raises(GrammarTooComplex, match="did not compile within"):
        hasty.compile(json_spec(big, strict=True))
    assert time.perf_counter() - t0 < 1.0
    assert hasty.stats.timeouts == 1


def test_compile_cache_hits_and_stays_bounded(smol):
    comp = GrammarCompiler(smol.compiler.tokenizer, smol.compiler.specials, cache_entries=2)
    specs = [json_spec({"type": "object", "properties": {f"p{i}": {"type": "integer"}}}) for i in range(3)]
    first = comp.compile(specs[0])
    assert comp.compile(specs[0]) is first and comp.stats.hits == 1 and comp.stats.compiles == 1
    t0 = time.perf_counter()
    comp.compile(specs[0])
    assert time.perf_counter() - t0 < 0.005                       # a hit is a dict lookup
    comp.compile(specs[1])
    comp.compile(specs[2])                                         # evicts specs[0] (least recently used)
    assert comp.stats.evictions == 1
    assert comp.compile(specs[0]) is not first and comp.stats.compiles == 4


# ------------------------------------------------------------------ tool calls
@pytest.mark.parametrize("who", ["smol", "qwen"])
def test_auto_is_free_text_until_the_opener_then_forces_a_valid_call(who, request):
    tok = request.getfixturevalue(who)
    spec = spec_for_request(tools=TOOLS, tool_choice="auto", specials=tok.compiler.specials)
    row = tok.row(spec)
    write(tok, row, "Let me look that up for you. ")
    assert row.state == "dormant" and row.allowed() is None        # no mask at all in free text
    write(tok, row, '<tool_call>\n{"name": "get_')
    assert row.engaged
    assert not any(tok.bytes[i].startswith(b"x") for i in row.allowed().tolist())
    with pytest.raises(AssertionError, match="forbids"):
        write(tok, tok.row(spec), 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"days": 3')  # city first
    rng = random.Random(3)
    for _ in range(8):
        row = tok.row(spec)
        prefix = write(tok, row, "Checking. <tool_call>")
        ids = prefix + walk(tok, row, rng)
        content, calls = parse_tool_calls(tok.text(ids), TOOLS)
        assert content == "Checking." and len(calls) >= 1
        check_calls(calls)


def test_required_and_named_force_the_call_from_the_first_token(smol):
    row = smol.row(spec_for_request(tools=TOOLS, tool_choice="required", specials=smol.compiler.specials))
    assert all(b"<tool_call>".startswith(smol.bytes[i].lstrip(b" \t\r\n")) for i in row.allowed().tolist())
    named = spec_for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                             specials=smol.compiler.specials)
    rng = random.Random(5)
    for _ in range(6):
        _, calls = parse_tool_calls(smol.text(walk(smol, smol.row(named), rng)), TOOLS)
        assert {c.name for c in calls} == {"get_time"}
        check_calls(calls)


def test_parallel_tool_calls_false_allows_one_call_only(smol):
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    one = smol.row(spec_for_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    write(smol, one, call)
    assert {smol.bytes[i] for i in one.allowed().tolist() if i not in smol.stop} == {b"\n"}
    write(smol, one, "\n")
    assert one.finished and one.allowed().tolist() == smol.stop
    many = smol.row(spec_for_request(tools=TOOLS, tool_choice="required"))
    write(smol, many, call + "\n" + call)
    assert many.engaged and set(smol.stop) <= set(many.allowed().tolist())


def test_a_named_tool_choice_allows_exactly_one_call_even_when_parallel_calls_are_allowed(smol):
    """Issue 43: the embedded model repeated a named call until max_tokens when more calls were allowed."""
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for fmt in (HERMES, QWEN_XML, GLM):
        spec = spec_for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                parallel_tool_calls=True, tool_format=fmt)
        assert spec.kind == "tool_named" and "call)*" not in spec.lark
    row = smol.row(spec_for_request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                    parallel_tool_calls=True))
    write(smol, row, call)
    assert {smol.bytes[i] for i in row.allowed().tolist() if i not in smol.stop} == {b"\n"}
    write(smol, row, "\n")
    assert row.finished and row.allowed().tolist() == smol.stop


def test_none_never_lets_the_opener_through(smol, qwen, harmony):
    for tok in (smol, qwen):
        row = tok.row(spec_for_request(tools=TOOLS, tool_choice="none", specials=tok.compiler.specials))
        write(tok, row, "No tools needed: <tool_ call> is fine, so is <|im_start|> text. <tool_call")
        assert not any((b"<tool_call" + tok.bytes[i]).find(b"<tool_call>") >= 0 for i in row.allowed().tolist())
    qid = qwen.hf.convert_tokens_to_ids("<tool_call>")
    assert not allows(qwen.row(spec_for_request(tools=TOOLS, tool_choice="none", specials=qwen.compiler.specials)), qid)
    row = harmony.row(spec_for_request(tools=TOOLS, tool_choice="none", tool_format=HARMONY,
                                       specials=harmony.compiler.specials))
    write(harmony, row, "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary to=functions")
    assert not any(harmony.bytes[i].startswith(b".") for i in row.allowed().tolist())


@pytest.mark.parametrize("fmt, family", [(HERMES, "generic"), (QWEN_XML, "qwen3"), (GLM, "glm4")])
def test_each_tool_call_format_parses_back_valid(smol, fmt, family):
    spec = spec_for_request(tools=TOOLS, tool_choice="required", tool_format=fmt, specials=smol.compiler.specials)
    rng = random.Random(11)
    for _ in range(8):
        text = smol.text(walk(smol, smol.row(spec), rng))
        content, calls = parse_tool_calls(text, TOOLS, family)
        assert content == "", text
        check_calls(calls)


def test_xml_string_values_are_free_text_up_to_the_closing_tag(smol):
    tools = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}, "required": ["text"]}}}]
    row = smol.row(spec_for_request(tools=tools, tool_choice="required", tool_format=QWEN_XML))
    body = "<tool_call>\n<function=note>\n<parameter=text>\nline 1\n<b>line 2</b>\n</parameter>\n</function>\n</tool_call>"
    write(smol, row, body)
    assert parse_tool_calls(body, tools, "qwen3")[1][0].arguments == json.dumps({"text": "line 1\n<b>line 2</b>"})


def test_xml_values_are_typed_exactly_as_the_parser_types_them_back(smol):
    # anyOf [integer, null]: the parser reads the value as JSON (parsing.tool_calls.schema_type),
    # so the grammar must force JSON there too -- free text would parse back as a string
    tools = [{"type": "function", "function": {"name": "page", "parameters": {
        "type": "object", "properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["n"]}}}]
    spec = spec_for_request(tools=tools, tool_choice="required", tool_format=QWEN_XML)
    body = "<tool_call>\n<function=page>\n<parameter=n>\n12\n</parameter>\n</function>\n</tool_call>"
    write(smol, smol.row(spec), body)
    assert parse_tool_calls(body, tools, "qwen3")[1][0].arguments == json.dumps({"n": 12})
    with pytest.raises(AssertionError, match="the mask forbids"):
        write(smol, smol.row(spec), body.replace("12", "twelve"))


def test_harmony_required_and_auto(harmony):
    sp = harmony.compiler.specials
    assert {"<|channel|>", "<|message|>", "<|call|>"} <= set(sp)
    req = spec_for_request(tools=TOOLS, tool_choice="required", tool_format=HARMONY, specials=sp)
    rng = random.Random(2)
    for _ in range(6):
        row = harmony.row(req)
        ids = write(harmony, row, "<|channel|>commentary to=")      # (not the free analysis branch)
        ids += walk(harmony, row, rng, stop_p=1.0)
        text = b"".join(harmony.bytes[i] for i in ids).decode()
        assert text.endswith("<|call|>")
        check_calls(split_harmony(text, tools=TOOLS).tool_calls)
    auto = spec_for_request(tools=TOOLS, tool_choice="auto", tool_format=HARMONY, specials=sp)
    row = harmony.row(auto)
    pre = write(harmony, row, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
                              "<|channel|>commentary ")
    assert row.state == "dormant"
    pre += write(harmony, row, "to=functions.")
    assert row.engaged
    ids = pre + walk(harmony, row, rng, stop_p=1.0)
    check_calls(split_harmony(b"".join(harmony.bytes[i] for i in ids).decode(), tools=TOOLS).tool_calls)


def test_reasoning_stays_free_until_it_closes_then_the_grammar_applies(smol, qwen):
    for tok in (smol, qwen):
        spec = spec_for_request(response_format={"type": "json_object"}, reasoning_close="</think>",
                                specials=tok.compiler.specials)
        row = tok.row(spec)
        allowed = row.allowed()
        assert len(allowed) == tok.vocab - 1 and tok.stop[0] not in allowed    # anything but stopping
        write(tok, row, "Let me think: {not json} <tool_call> is just text here.")
        assert row.state == "dormant"
        write(tok, row, "</think>\n\n")
        assert row.engaged and all(tok.bytes[i][:1] in b"{ \t\r\n" for i in row.allowed().tolist())
        write(tok, row, '{"ok": true}')
        assert row.finished
    auto = qwen.row(spec_for_request(tools=TOOLS, tool_choice="auto", reasoning_close="</think>",
                                     specials=qwen.compiler.specials))
    write(qwen, auto, "maybe <tool_call> later</think>\n\nCalling.")
    assert auto.state == "dormant" and auto.allowed() is None        # an opener inside reasoning is text
    write(qwen, auto, "<tool_call>")
    assert auto.engaged


def test_reasoning_can_be_added_per_row_after_compiling(qwen):
    """The engine knows whether the prompt opened a reasoning block only after rendering, on the
    inference thread; the grammar was compiled on the handler thread without it."""
    sp = qwen.compiler.specials
    json_g = qwen.compiler.compile(spec_for_request(response_format={"type": "json_object"}))
    row = json_g.new_row(qwen.stop, qwen.vocab, reasoning_close="</think>")
    assert row.state == "dormant" and qwen.stop[0] not in row.allowed()          # must reach the JSON
    write(qwen, row, "hmm</think>\n\n{}")
    assert row.finished
    auto = qwen.compiler.compile(spec_for_request(tools=TOOLS, tool_choice="auto", specials=sp))
    row = auto.new_row(qwen.stop, qwen.vocab, reasoning_close="</think>")
    assert [st.trigger for st in row.stages] == ["</think>", "<tool_call>"] and row.allowed() is None
    none = qwen.compiler.compile(spec_for_request(tools=TOOLS, tool_choice="none", specials=sp))
    assert none.new_row(qwen.stop, qwen.vocab, reasoning_close="</think>").engaged   # covers reasoning too
    assert json_g.new_row(qwen.stop, qwen.vocab).engaged


def test_trigger_inside_a_token_feeds_the_rest_to_the_grammar(smol):
    row = smol.row(spec_for_request(response_format={"type": "json_object"}, reasoning_close="ab"))
    ids = smol.hf.encode("xxab{", add_special_tokens=False)
    for i in ids:
        row.consume(i)
    assert row.engaged and row.matcher.compute_ff_bytes() != b"{" and not row.dead_end


def test_dead_end_ends_the_reply_with_stop_tokens_never_an_exception(smol):
    row = smol.row(spec_for_request(response_format={"type": "json_object"}))
    row.consume(smol.hf.encode("hello", add_special_tokens=False)[0])      # not allowed by the mask
    assert row.dead_end and row.error
    assert row.allowed().tolist() == smol.stop
    row.consume(5)                                                        # still no exception
    assert row.dead_end


def test_ids_past_the_tokenizer_vocabulary_are_never_allowed(smol):
    width = smol.vocab + 100
    for spec in (spec_for_request(response_format={"type": "json_object"}, reasoning_close="</think>"),
                 spec_for_request(tools=TOOLS, tool_choice="none", specials=smol.compiler.specials)):
        row = smol.row(spec, width)
        words = row.mask_words()
        assert words.shape == ((width + 31) // 32,)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:width]
        assert bits[smol.vocab:].sum() == 0 and bits[:smol.vocab].sum() > 0


def test_batch_masks_equal_row_masks(smol):
    specs = [spec_for_request(response_format={"type": "json_object"}), None,
             spec_for_request(tools=TOOLS, tool_choice="auto"),
             spec_for_request(tools=TOOLS, tool_choice="required", specials=smol.compiler.specials)]
    texts = ['{"a": ', "", "free text", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "']
    def rows():
        out = []
        for spec, text in zip(specs, texts):
            row = smol.row(spec, smol.vocab + 64) if spec else None
            if row is not None:
                write(smol, row, text)
            out.append(row)
        return out
    batch = BatchMasks(2).fill(rows(), smol.vocab + 64)
    single = rows()
    assert batch.shape == (4, (smol.vocab + 64 + 31) // 32)
    for i, row in enumerate(single):
        want = row.mask_words() if row is not None else None
        if want is None:
            assert (batch[i] == -1).all()
        else:
            assert (batch[i] == want).all(), i
    assert BatchMasks(2).fill([None, None]) is None


# ------------------------------------------------------------------ plumbing
def test_markers_match_the_parsers():
    assert grammars.TOOL_CALL_OPEN == tool_calls.TOOL_CALL_OPEN
    assert grammars.TOOL_CALL_CLOSE == tool_calls.TOOL_CALL_CLOSE


def test_tool_format_for_templates():
    assert tool_format_for("harmony") == HARMONY
    assert tool_format_for("qwen3", "{% if x %}<function={{ name }}>") == QWEN_XML
    assert tool_format_for("glm4", "<arg_key>{{ k }}</arg_key>") == GLM
    assert tool_format_for("generic", "") == HERMES and set(TOOL_FORMATS) == {HERMES, QWEN_XML, GLM, HARMONY}


def test_compiler_options_come_from_settings():
    from mlxstack.config.settings import load_settings

    opts = compiler_options(load_settings(env={"GRAMMAR_CACHE_ENTRIES": "3", "GRAMMAR_MAX_SIZE": "5000",
                                               "GRAMMAR_MAX_PENDING": "4"}))
    assert opts == {"cache_entries": 3, "timeout_s": 5.0, "limits": {"max_grammar_size": 5000}, "max_pending": 4}


def test_spec_keys_are_stable_and_distinct():
    a = spec_for_request(response_format={"type": "json_object"})
    assert a.key == spec_for_request(response_format={"type": "json_object"}).key
    assert a.key != spec_for_request(response_format={"type": "json_object"}, reasoning_close="</think>").key
    assert spec_for_request() is None and spec_for_request(response_format={"type": "text"}) is None
