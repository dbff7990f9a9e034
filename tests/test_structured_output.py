"""Structured output and guaranteed tool calls (#18) through the engine and the MLX server's three
fronts, in process: grammars compiled by the api layer (server/common/structured.py) exactly as a request's
handler compiles them, decoded by the real engine and scheduler on the embedded SmolLM2 and tiny
fixtures (Qwen XML and GLM templates on the dense fixture, harmony on the gpt_oss one).

A model that "wants" a text (``Steer``) makes the grammar's work visible: each step the longest token
that continues the wanted text gets a large bias, the grammar masks after it -- where the grammar
forbids the wanted token the model's own best allowed token comes instead. The same conversation
through port 4000 with the official SDKs: tests/test_structured_stack.py.
"""
from __future__ import annotations

import json
import logging

import jsonschema
import pytest

from mlxstack.server.common.structured import Structured
from mlxstack.server.common.validation import parse_chat_request
from mlxstack.engine.chat import GRAMMAR_DEAD_END
from mlxstack.parsing.output import split_reply
from mlxstack.runner.sampling import Sampler
from tests.conftest import LiveServer, build_engine, engine_settings, http_json
from tests.fixtures.tiny_models import CHAT_TEMPLATE
from tests.test_batching import run_batched
from tests.test_engine import job
from tests.test_prefix_stability import _swap, variant

pytestmark = pytest.mark.slow  # constrained decoding on the embedded model through the engine and HTTP, ~4 min here (docs/testing.md#tiers)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "alerts": {"type": "boolean"}}, "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "enum": ["UTC", "CET"]}},
                                               "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TOOLS[1]["function"]["parameters"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Rome for three days?"}]
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]
# The same call in each format, with an argument the schema forbids ("Rome" is not in the enum).
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>',
    "qwen_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n</function>\n</tool_call>",
    "glm": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n<arg_key>days</arg_key>\n"
           "<arg_value>3</arg_value>\n</tool_call>",
    "harmony": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome", "days": 3}'
               "<|call|>",
}


# ------------------------------------------------------------------ helpers
class Steer:
    """Makes the model want a text (see the module docstring); ``install`` patches the engine's Sampler
    so every request whose prompt contains a marker wants that marker's text, then the end of turn."""

    BIAS = 1e4

    def __init__(self, engine) -> None:
        tok = engine.loaded.tokenizer
        self.tok = tok
        self.bytes: list[bytes] = []
        self.ids: dict[bytes, int] = {}
        for i in range(engine.token_count):
            text = tok.decode([i])
            b = b"" if "\ufffd" in text else text.encode()
            self.bytes.append(b)
            if b and b not in self.ids:
                self.ids[b] = i
        self.longest = max(len(b) for b in self.ids)
        vocab = tok.get_vocab()
        self.end = vocab.get("<|im_end|>", vocab.get("<|return|>"))

    def next_token(self, want: bytes | None, wrote: bytes) -> int | None:
        if want is None or not want.startswith(wrote):
            return None                               # not wanted, or the grammar took another way
        rest = want[len(wrote):]
        if not rest:
            return self.end
        for n in range(min(len(rest), self.longest), 0, -1):
            if rest[:n] in self.ids:
                return self.ids[rest[:n]]
        return None

    def install(self, monkeypatch, scripts: dict[str, str]) -> None:
        steer = self

        class Steered(Sampler):
            def __init__(s, params, history, vocab_size, constraint=None):
                super().__init__(params, history, vocab_size, constraint)
                prompt = steer.tok.decode(list(history))
                found = [(prompt.rfind(m), t) for m, t in scripts.items() if m in prompt]
                s.want = max(found)[1].encode() if found else None      # the marker the prompt ends nearest
                s.wrote = b""

            def accept(s, tok):
                super().accept(tok)
                s.wrote += steer.bytes[int(tok.item())]

            def _process(s, logits):
                logits = super()._process(logits)
                t = steer.next_token(s.want, s.wrote)
                return logits if t is None else logits.at[t].add(steer.BIAS)

        monkeypatch.setattr("mlxstack.engine.chat.Sampler", Steered)


def constrained(structured, engine, messages, *, max_tokens=120, thinking=False, session="s1", **fields):
    """A job with the grammar its request fields ask for, compiled as a handler thread compiles it."""
    req = parse_chat_request({"messages": messages, "max_tokens": max_tokens, **fields}, engine.settings,
                             engine.token_count)
    j, streamed = job(req.messages, tools=req.tools, max_tokens=max_tokens, thinking=thinking, session=session)
    j.tool_choice, j.response_format, j.parallel_tool_calls = req.tool_choice, req.response_format, req.parallel_tool_calls
    j.params.grammar = structured.grammar_for(req) if structured is not None else None
    return j, streamed


def calls_of(out, engine, tools=TOOLS):
    return split_reply(out.text, thinking_started=out.thinking_started, tools=tools,
                       family=engine.loaded.family).tool_calls


def check_calls(calls, n=None):
    assert calls and (n is None or len(calls) == n), calls
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


# ------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def smol(embedded_model_path):
    engine = build_engine(engine_settings(embedded_model_path))
    return engine, Structured.for_model(engine.loaded, engine, engine.settings), Steer(engine)


def _coder_template(kind: str) -> str:
    """The dense fixture's template writing its calls as Qwen3-Coder XML or GLM key/value."""
    old = """{{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}"""
    if kind == "qwen_xml":
        new = """{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
                {%- if tool_call.arguments is mapping %}{%- for k, v in tool_call.arguments.items() %}
                    {{- '<parameter=' + k + '>\\n' + (v if v is string else v | tojson) + '\\n</parameter>\\n' }}
                {%- endfor %}{%- endif %}
                {{- '</function>\\n</tool_call>' }}"""
    else:
        new = """{{- '<tool_call>' + tool_call.name + '\\n' }}
                {%- if tool_call.arguments is mapping %}{%- for k, v in tool_call.arguments.items() %}
                    {{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>\\n' }}
                {%- endfor %}{%- endif %}
                {{- '</tool_call>' }}"""
    return _swap(CHAT_TEMPLATE, old, new)


@pytest.fixture(scope="module")
def formats(tmp_path_factory, tiny_dense_path, tiny_kind_paths, embedded_model_path):
    """format -> (engine, structured, steer), built on first use."""
    tmp = tmp_path_factory.mktemp("formats")
    paths = {"hermes": embedded_model_path, "qwen_xml": None, "glm": None, "harmony": None}
    built: dict[str, tuple] = {}

    def get(fmt: str):
        if fmt not in built:
            path = paths[fmt]
            if fmt in ("qwen_xml", "glm"):
                path = variant(tmp, tiny_dense_path, fmt, _coder_template(fmt))
            elif fmt == "harmony":
                path = tiny_kind_paths("gpt_oss")
            engine = build_engine(engine_settings(path))
            structured = Structured.for_model(engine.loaded, engine, engine.settings)
            assert structured.tool_format == fmt
            built[fmt] = (engine, structured, Steer(engine))
        return built[fmt]
    return get


# ------------------------------------------------------------------ tool calls
@pytest.mark.parametrize("fmt", ["hermes", "qwen_xml", "glm", "harmony"])
def test_auto_is_free_text_until_the_model_opens_a_call_then_the_call_is_valid(formats, fmt, monkeypatch):
    """tool_choice auto is lazy in every format: the text before the call is the model's own, word
    for word; once it opens a call the grammar forces a listed name and schema-valid arguments (the
    city it wanted, Rome, is not in the enum)."""
    engine, structured, steer = formats(fmt)
    prose = "Let me check that for you. " if fmt != "harmony" else \
        "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant"
    steer.install(monkeypatch, {"weather in Rome": prose + CALLS[fmt]})
    j, _ = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False)
    out = engine.run(j)
    assert out.finish_reason == "stop", out
    assert out.text.startswith(prose if fmt != "harmony" else "<|channel|>analysis<|message|>The user wants weather.")
    check_calls(calls_of(out, engine), n=1)
    assert "Rome" not in out.text[len(prose):]


def test_required_and_named_force_a_call_over_prose(smol, monkeypatch):
    engine, structured, steer = smol
    steer.install(monkeypatch, {"weather in Rome": "Sure! It will be sunny all week."})
    j, _ = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    out = engine.run(j)
    assert out.finish_reason == "stop" and out.text.startswith("<tool_call>")
    check_calls(calls_of(out, engine), n=1)
    named = {"type": "function", "function": {"name": "get_time"}}
    j, _ = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    out = engine.run(j)
    calls = calls_of(out, engine)
    check_calls(calls, n=1)
    assert calls[0].name == "get_time"


def test_none_never_lets_a_call_open(smol, monkeypatch):
    engine, structured, steer = smol
    steer.install(monkeypatch, {"weather in Rome": CALLS["hermes"]})
    j, _ = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=40)
    out = engine.run(j)
    assert "<tool_call>" not in out.text and not calls_of(out, engine)
    assert engine._logit_bias(j) is None                      # the grammar bans the opener, not a logit_bias


UTC = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
CET = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def test_a_repeated_call_ends_the_reply_and_is_never_shown(smol, monkeypatch):
    """Issue 43: parallel calls allowed, the model repeats a call -- the reply ends before the repeat
    (a finished reply: stop, not length), alone and in the batch, streamed exactly as returned."""
    engine, structured, steer = smol
    steer.install(monkeypatch, {"weather in Rome": f"{UTC}\n{CET}\n{UTC}\n{CET}\n{UTC}"})
    before = engine.state.counters.get("tool_call_gate_stops")
    j, streamed = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice="required", session="rep")
    out = engine.run(j)
    assert (out.finish_reason, out.text) == ("stop", f"{UTC}\n{CET}\n") and "".join(streamed) == out.text
    assert out.raw_text.startswith(out.text + UTC[:-1])         # generated, never shown
    assert [(c.name, c.arguments) for c in calls_of(out, engine)] == [("get_time", '{"zone": "UTC"}'),
                                                                       ("get_time", '{"zone": "CET"}')]
    j, streamed = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice="required", session="rep2")
    (batched,), _ = run_batched(engine, [j])
    assert (batched.finish_reason, batched.text, "".join(streamed)) == ("stop", out.text, out.text)
    assert engine.state.counters.get("tool_call_gate_stops") == before + 2


def test_one_call_without_a_grammar_ends_the_reply_after_it(smol, monkeypatch):
    """parallel_tool_calls false served without a grammar (no compiler, or tools it cannot take):
    the gate ends the reply after the first call."""
    engine, _, steer = smol
    steer.install(monkeypatch, {"weather in Rome": f"Let me check. {UTC}\n{CET}"})
    j, streamed = constrained(None, engine, ASK_WEATHER, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False,
                              session="one")
    out = engine.run(j)
    assert (out.finish_reason, out.text, "".join(streamed)) == ("stop", f"Let me check. {UTC}", f"Let me check. {UTC}")


def test_a_reply_cut_inside_a_call_never_shows_it(smol, monkeypatch):
    """max_tokens ends the reply inside the second call: the first is kept, the cut one is not text."""
    engine, structured, steer = smol
    steer.install(monkeypatch, {"weather in Rome": f"{UTC}\n{CET}"})
    first = len(engine.loaded.tokenizer.encode(f"{UTC}\n", add_special_tokens=False))
    j, streamed = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice="required",
                              max_tokens=first + 10, session="cut")
    out = engine.run(j)
    assert (out.finish_reason, out.text, "".join(streamed)) == ("length", f"{UTC}\n", f"{UTC}\n")
    assert out.raw_text.startswith(f"{UTC}\n<tool_call>")
    j, streamed = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice="required", max_tokens=6,
                              session="cut2")
    (cut,), _ = run_batched(engine, [j])
    assert (cut.finish_reason, cut.text, streamed) == ("length", "", [])


# ------------------------------------------------------------------ JSON
def test_json_schema_and_json_object_replies_validate_and_the_prompt_is_unchanged(smol, monkeypatch):
    engine, structured, steer = smol
    steer.install(monkeypatch, {"person as JSON": 'Here you go: {"name": "Ada", "age": 36, "city": "Rome"}'})
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    j, streamed = constrained(structured, engine, ASK_PERSON, response_format=fmt)
    out = engine.run(j)
    assert out.finish_reason == "stop" and out.text.startswith("{")
    jsonschema.validate(json.loads(out.text), PERSON)
    assert "".join(streamed) == out.text
    j, _ = constrained(structured, engine, ASK_PERSON, response_format={"type": "json_object"}, session="o")
    out2 = engine.run(j)
    assert isinstance(json.loads(out2.text), dict)
    free, _ = job(ASK_PERSON, max_tokens=4, session="free")
    assert engine.run(free).prompt_tokens == out.prompt_tokens == out2.prompt_tokens   # nothing forced into it
    assert engine.state.counters.get("grammar_invalid_output") == 0


def test_reasoning_stays_free_then_the_answer_is_json(formats, monkeypatch):
    """A prompt that opened a reasoning block: the reasoning is the model's, the grammar starts at
    </think> (the dense fixture's thinking-on prompt ends in "<think>\\n")."""
    engine, structured, steer = formats("qwen_xml")
    steer.install(monkeypatch, {"person as JSON": 'Rome is nice. {"a": 1}\n</think>\n\nSure: {"name": "Ada", "age": 36, '
                                                  '"city": "Paris"}'})
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    j, _ = constrained(structured, engine, ASK_PERSON, response_format=fmt, thinking=True, session="think")
    out = engine.run(j)
    assert out.thinking_started and out.finish_reason == "stop", out
    parsed = split_reply(out.text, thinking_started=True, family=engine.loaded.family)
    assert parsed.reasoning.strip() == 'Rome is nice. {"a": 1}'
    jsonschema.validate(json.loads(parsed.content), PERSON)


def test_a_reply_cut_by_max_tokens_says_length(smol):
    engine, structured, _ = smol
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    j, _ = constrained(structured, engine, ASK_PERSON, response_format=fmt, max_tokens=4)
    assert engine.run(j).finish_reason == "length"


# ------------------------------------------------------------------ dead end, batch, cache
def test_a_dead_end_ends_the_reply_clearly_and_the_batch_goes_on(smol, monkeypatch, caplog):
    """'<tool_call>,' opens a call (the trigger) that no call can continue: only stop tokens are
    left, the reply ends with finish_reason grammar_dead_end (an error in the log, a counter), and a
    free request decoding in the same batch returns exactly what it returns alone."""
    engine, structured, steer = smol
    free_msgs = [{"role": "user", "content": "Name three colours."}]
    solo = engine.run(job(free_msgs, max_tokens=16, session="free")[0])
    steer.install(monkeypatch, {"weather in Rome": "Look: <tool_call>, then more text."})
    dead, _ = constrained(structured, engine, ASK_WEATHER, tools=TOOLS, session="dead")
    before = engine.state.counters.get("grammar_dead_ends")
    with caplog.at_level(logging.ERROR, logger="mlxstack.request"):
        (out, free), sizes = run_batched(engine, [dead, job(free_msgs, max_tokens=16, session="free")[0]])
    assert out.finish_reason == GRAMMAR_DEAD_END and out.text == "Look: <tool_call>,"
    assert engine.state.counters.get("grammar_dead_ends") == before + 1
    assert any("dead end" in r.getMessage() for r in caplog.records)
    assert max(sizes) == 2 and free.raw_text == solo.raw_text


def test_constrained_and_free_rows_share_decode_steps_and_the_free_one_is_unchanged(smol):
    engine, structured, _ = smol
    free_msgs = [{"role": "user", "content": "Name three animals."}]
    solo = engine.run(job(free_msgs, max_tokens=24, session="free2")[0])
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    rows = [constrained(structured, engine, ASK_PERSON, response_format=fmt, session="json2")[0],
            job(free_msgs, max_tokens=24, session="free2")[0],
            constrained(structured, engine, ASK_WEATHER, tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False, session="tools2")[0]]
    (person, free, call), sizes = run_batched(engine, rows)
    assert max(sizes) == 3 and run_batched.sched.group.batching       # one DecodeGroup forward for all three
    jsonschema.validate(json.loads(person.text), PERSON)
    check_calls(calls_of(call, engine), n=1)
    assert free.raw_text == solo.raw_text


def test_warm_turns_reuse_exactly_as_much_with_and_without_constraints(embedded_model_path, monkeypatch):
    """Constraints change sampling, never the prompt: the same three-turn conversation (the model
    writes the same replies either way) reuses the same number of tokens on every turn."""
    def converse(with_grammar: bool) -> list[tuple[int, int, str]]:
        engine = build_engine(engine_settings(embedded_model_path))
        structured = Structured.for_model(engine.loaded, engine, engine.settings) if with_grammar else None
        replies = {f"Person {i}": json.dumps({"name": n, "age": a, "city": c})
                   for i, (n, a, c) in enumerate([("Ada", 36, "London"), ("Alan", 41, "London"), ("Emmy", 53, "Berlin")])}
        Steer(engine).install(monkeypatch, {m: r for m, r in replies.items()})
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
        messages = [{"role": "system", "content": "You answer with one JSON object describing a person. " * 4}]
        out = []
        for marker in replies:
            messages.append({"role": "user", "content": f"{marker}: describe someone."})
            extra = {"response_format": fmt} if with_grammar else {}
            j, _ = constrained(structured, engine, list(messages), session="conv", **extra)
            o = engine.run(j)
            out.append((o.prompt_tokens, o.cached_tokens, o.text))
            messages.append({"role": "assistant", "content": o.text})
        return out

    free, strict = converse(False), converse(True)
    assert [t for _, _, t in strict] == [t for _, _, t in free]           # the same replies ...
    assert strict == free                                                  # ... the same prompts, the same reuse
    assert all(cached > 0 for _, cached, _ in strict[1:])


# ------------------------------------------------------------------ the three fronts (in process)
@pytest.fixture(scope="module")
def server(tmp_path_factory, embedded_model_path):
    s = LiveServer(engine_settings(None, log_root=str(tmp_path_factory.mktemp("logs"))))
    yield s
    s.close()


def test_a_dead_end_on_the_three_fronts(server, monkeypatch):
    """Chat: finish_reason content_filter (streamed too); Responses: status incomplete, reason
    content_filter; Anthropic: stop_reason refusal -- never "stop", never an error."""
    steer = Steer(server.app.engine)
    steer.install(monkeypatch, {"weather in Rome": "Look: <tool_call>, then more text."})
    tools = TOOLS[:1]
    status, body, _ = http_json(server.base + "/v1/chat/completions", {"messages": ASK_WEATHER, "tools": tools,
                                                                       "max_tokens": 40})
    assert status == 200 and body["choices"][0]["finish_reason"] == "content_filter", body
    status, raw, _ = http_json(server.base + "/v1/chat/completions", {"messages": ASK_WEATHER, "tools": tools,
                                                                      "max_tokens": 40, "stream": True})
    finals = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in raw.splitlines()
              if line.startswith("data: {") and json.loads(line[6:]).get("choices")]
    assert finals[-1] == "content_filter"
    status, body, _ = http_json(server.base + "/v1/responses", {
        "input": ASK_WEATHER[0]["content"], "max_output_tokens": 40,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]})
    assert status == 200 and body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "content_filter"}
    status, body, _ = http_json(server.base + "/v1/messages", {
        "max_tokens": 40, "messages": ASK_WEATHER, "tools": [{"name": "get_weather", "input_schema": WEATHER}]})
    assert status == 200 and body["stop_reason"] == "refusal", body
    assert server.app.state.counters.get("grammar_dead_ends") >= 4


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "weird"}}}}}},
     "response_format.json_schema.schema#/properties/a"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}}}],
        "tool_choice": "required"}, "tools[0].function.parameters#/properties/a"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "strict": True,
                                           "schema": {"type": "object", "properties": {"b": {"type": "weird"}}}}}},
     "text.format.schema#/properties/b"),
    ("/v1/messages", {"output_config": {"format": {"type": "json_schema",
                                                   "schema": {"type": "object", "properties": {"c": {"type": "weird"}}}}}},
     None),
])
def test_an_unsupported_schema_is_400_naming_its_path(server, path, body, param):
    base = {"max_tokens": 8, **({"input": "hi"} if path == "/v1/responses" else {"messages": ASK_PERSON})}
    status, reply, _ = http_json(server.base + path, {**base, **body})
    assert status == 400, reply
    if path == "/v1/messages":
        assert reply["type"] == "error" and "output_config.format.schema#/properties/c" in reply["error"]["message"]
    else:
        assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error"


def test_a_schema_too_large_to_compile_is_400_quickly(server):
    import time

    big = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20000)}}
    t0 = time.monotonic()
    status, reply, _ = http_json(server.base + "/v1/chat/completions", {
        "messages": ASK_PERSON, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big, "strict": True}}})
    limit = server.app.settings.grammar_compile_timeout_seconds
    assert status == 400 and reply["error"]["code"] == "grammar_too_complex", reply
    assert time.monotonic() - t0 < limit + 10
    status, _, _ = http_json(server.base + "/v1/chat/completions", {"messages": ASK_PERSON, "max_tokens": 4})
    assert status == 200                                       # the inference thread was never involved


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_dense_path):
    s = LiveServer(engine_settings(tiny_dense_path, log_root=str(tmp_path_factory.mktemp("logs"))))
    yield s
    s.close()


def test_a_model_that_wants_digits_forever_still_answers_numbers_a_json_client_holds(tiny_server):
    """The random-weight fixture pushed to digits 1-9 (logit_bias +100): an unbounded integer grammar let it
    write digits until max_tokens (no JSON at all); the bounded one closes each number in time."""
    tok = tiny_server.app.loaded.tokenizer
    digits = [tok.encode(d, add_special_tokens=False) for d in "123456789"]
    assert all(len(ids) == 1 for ids in digits)
    schema = {"type": "object", "properties": {"population": {"type": "integer"}, "area": {"type": "number"}},
              "required": ["population", "area"], "additionalProperties": False}
    status, body, _ = http_json(tiny_server.base + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "How many people live in Paris, on how many km2? Answer in JSON."}],
        "max_tokens": 96, "temperature": 0, "enable_thinking": False,
        "logit_bias": {str(ids[0]): 100 for ids in digits},
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    reply = json.loads(choice["message"]["content"])
    jsonschema.validate(reply, schema)
    population, area = reply["population"], reply["area"]
    assert isinstance(population, int) and 10**15 <= abs(population) <= 2**53 - 1   # the bound stopped it, not the model
    integer, _, fraction = choice["message"]["content"].split('"area": ')[1].rstrip("}").partition(".")
    assert len(integer.lstrip("-")) <= 16 and len(fraction) <= 9 and abs(area) < 1e16


def test_auto_with_tools_the_grammar_cannot_take_is_served_unconstrained(server):
    """Agent clients send tool schemas of every kind: with tool_choice auto and no strict tool, a
    tool set that cannot become a grammar is served as before (and counted), never refused."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "weird"}}}}}]
    before = server.app.state.counters.get("grammar_fallbacks")
    status, body, _ = http_json(server.base + "/v1/chat/completions", {"messages": ASK_PERSON, "max_tokens": 4,
                                                                       "tools": tools})
    assert status == 200, body
    assert server.app.state.counters.get("grammar_fallbacks") == before + 1
    tools[0]["function"]["strict"] = True
    assert http_json(server.base + "/v1/chat/completions", {"messages": ASK_PERSON, "max_tokens": 4,
                                                             "tools": tools})[0] == 400


def test_tools_the_front_door_carried_past_litellm_are_the_ones_enforced():
    """LiteLLM strips strict / additionalProperties: false (and a property named "strict"): the
    front door copies the client's tools to mlxstack_tools, which the server prefers when the names agree."""
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # importing litellm: no network
    from mlxstack.server.common import validation
    from mlxstack.config.settings import load_settings
    from mlxstack.routing import front_door

    assert front_door.ORIGINAL_TOOLS_FIELD == validation.ORIGINAL_TOOLS_FIELD
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"strict": {"type": "string"}}, "required": ["strict"], "additionalProperties": False}}}
    data = front_door.keep_original_tools({"messages": ASK_PERSON, "tools": [tool]})
    stripped = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {},
                                                                              "required": ["strict"]}}}
    data["tools"] = [stripped]                                  # what LiteLLM forwards
    req = parse_chat_request(data, load_settings(env={}))
    assert req.tools == [tool]
    other = dict(data, mlxstack_tools=[{"type": "function", "function": {"name": "g"}}])
    assert parse_chat_request(other, load_settings(env={})).tools == [stripped]     # names differ: ignored


def test_the_front_door_hands_the_servers_own_400_through_litellm():
    """LiteLLM wraps a backend's 400 in its own message (param and code lost): the front door answers
    the MLX server's error as it sent it; other errors and every success pass unchanged."""
    import asyncio
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from mlxstack.routing.front_door import FrontDoor, backend_error

    ours = {"error": {"message": "response_format.json_schema.schema#/properties/a: Invalid type: weird",
                      "type": "invalid_request_error", "param": "response_format.json_schema.schema#/properties/a",
                      "code": "invalid_json_schema"}}
    wrapped = {"error": {"message": "litellm.BadRequestError: Hosted_vllmException - " + json.dumps(ours)
                         + "\n\nLiteLLM: model group 'm' failed with the error above.", "type": "invalid_request_error",
                         "param": None, "code": "400"}}
    assert json.loads(backend_error(json.dumps(wrapped).encode())) == ours
    assert backend_error(json.dumps({"error": {"message": "No connected db."}}).encode()) is None

    def through(status: int, body: dict, path="/v1/chat/completions"):
        async def app(scope, receive, send):
            raw = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
            await send({"type": "http.response.body", "body": raw[:10], "more_body": True})
            await send({"type": "http.response.body", "body": raw[10:]})
        out = []

        async def receive():
            return {"type": "http.request", "body": b'{"messages": [{"role": "user", "content": "hi"}]}'}

        async def send(m):
            out.append(m)
        asyncio.run(FrontDoor(app, master_key="")({"type": "http", "method": "POST", "path": path, "headers": []},
                                                    receive, send))
        raw = b"".join(m.get("body", b"") for m in out[1:])
        length = dict(out[0]["headers"])[b"content-length"]
        assert int(length) == len(raw)
        return out[0]["status"], json.loads(raw)
    assert through(400, wrapped) == (400, ours)
    assert through(200, {"ok": 1}) == (200, {"ok": 1})
    assert through(404, {"error": {"message": "no"}}) == (404, {"error": {"message": "no"}})
