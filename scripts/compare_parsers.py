"""Parser parity: our output parsers against the libraries that could replace them (issue 21 item 3).

    .venv/bin/python scripts/compare_parsers.py                  # both tables, first failures
    .venv/bin/python scripts/compare_parsers.py --json out.json  # also every case's verdict
    .venv/bin/python scripts/compare_parsers.py --only harmony --show 20

Harmony (parsing/harmony.py) against openai-harmony, on every harmony text in tests/test_harmony.py
(string constants and stop-test token lists before its fixture section), hand-written realistic
GPT-OSS outputs, and seeded random near-harmony texts. Our results are the reference: they are what
the existing tests pin. The library is given every advantage: text is re-encoded with its own o200k
vocab (our models' tokenizers are not o200k), and its messages go through OUR classification
(`_kind`, `_tool_call`, whitespace rule), so only its message grammar is measured. Checks:

- messages   `parse_messages_from_completion_tokens(strict=False)` vs `parse_harmony_messages`
             (role, channel, recipient, content type, body byte for byte; bodies only)
- split      the response fields (reasoning, content, typed tool calls) built from its messages
- stream     `StreamableParser` fed (a) o200k tokens of the whole text, (b) text chunks char by
             char, each re-encoded behind a held-back partial marker (what a server streaming
             another tokenizer's detokenizer segments would have to do), (c) the tiny GPT-OSS
             fixture tokenizer's own ids (what the engine actually holds)
- stop       stop position: its `stop_tokens_for_assistant_actions()` / `stop_tokens()` vs
             `HarmonyStopper`

Tool calls and reasoning (parsing/tool_calls.py, parsing/reasoning.py) against mlx-lm 0.32's
`tool_parsers/` (json_tools, qwen3_coder, glm47; there is no harmony parser) driven the way
`mlx_lm.server` drives them: `TextStateMachine` splits `<think>` / `<tool_call>` blocks, each block
goes to the model's one parser, failures are dropped with a warning. Expected values are written
per case (from tests/test_tool_calls.py and tests/test_reasoning.py asserts, plus realistic and
malformed extras), not taken from either implementation. A case passes when the calls (name and
arguments byte for byte), the content (compared after .strip(): lenient to mlx-lm, which does not
strip) and the reasoning (.strip() too) match, whole and streamed char by char.

Over 500 lines on purpose: about half is the cases and their written expectations, kept next to
the harness that runs them so each verdict can be read with its input.

Needs the dev venv (openai-harmony, quicktok-v1 for the o200k vocab, mlx-lm, tokenizers, and
~/.cache/mlxstack's SmolLM2 tokenizer for (c)). Results are written down in .context/notes/parsers.md.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import logging
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxstack.parsing import harmony_messages as H  # noqa: E402
from mlxstack.parsing.harmony import HarmonyStopper, split_harmony  # noqa: E402
from mlxstack.parsing.reasoning import (  # noqa: E402
    CONTENT,
    REASONING,
    ReasoningStreamSplitter,
    split_output,
)

# --------------------------------------------------------------------------------------------
# harmony cases
# --------------------------------------------------------------------------------------------

HARMONY_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "metric": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "filters": {"type": "object"}, "tags": {"type": "array"}}}}},
]

CALL = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
REALISTIC_HARMONY = {
    "analysis_final_markdown_unicode": (
        "<|channel|>analysis<|message|>User wants a haiku about Zürich in 日本語? Keep it short. 🙂<|end|>"
        "<|start|>assistant<|channel|>final<|message|>**Zürich**\n\n```python\nprint('a <b> c')\n```\n"
        "- é\n- 日本<|return|>"),
    "call_nested_unicode_args": (
        "<|channel|>analysis<|message|>Search with filters.<|end|>"
        + CALL.format("search", '{"query":"caf\\u00e9 \\"best\\"\\n","filters":{"open":true,"stars":[4,5]},'
                                '"tags":["é","a</tool_call>b"]}')),
    "call_pretty_json_args": (
        "<|channel|>analysis<|message|>Call.<|end|>"
        + CALL.format("get_weather", '{\n  "city": "Paris",\n  "days": 2\n}')),
    "call_recipient_in_header": (
        "<|channel|>analysis<|message|>Tool.<|end|><|start|>assistant to=functions.get_time"
        "<|channel|>commentary <|constrain|>json<|message|>{}<|call|>"),
    "preamble_then_call": (
        "<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Let me look that up.<|end|>" + CALL.format("get_weather", '{"city":"Oslo"}')),
    "two_analysis_then_final": (
        "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>"
        "Second.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"),
    "builtin_python_then_final": (
        "<|channel|>analysis to=python code<|message|>print(2+2)<|call|>"),
    "browser_tool": (
        "<|channel|>analysis<|message|>Need to browse.<|end|><|start|>assistant<|channel|>analysis "
        'to=browser.search code<|message|>{"query":"mlx"}<|call|>'),
    "truncated_in_analysis": "<|channel|>analysis<|message|>I am still thinking about th",
    "truncated_in_args": "<|channel|>analysis<|message|>Go.<|end|>" + CALL.format("get_weather", '{"city":"Pa')[:-8],
    "final_stop_token_stripped": (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4"),
    "call_stop_token_stripped": "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}",
    "final_ended_by_end": "<|channel|>final<|message|>Bye.<|end|>",
    "body_mentions_markup_words": (
        "<|channel|>final<|message|>Write to=functions.x or json in a sentence; 1<2 and |> too.<|return|>"),
    "skips_end_start": "<|channel|>analysis<|message|>R<|channel|>final<|message|>A",
    "empty_args_call": "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|><|call|>",
    "args_typed_by_schema": CALL.format("get_weather", '{"city":"Rome","days":"3","metric":"true"}')[len("<|start|>assistant"):],
    "no_markup_at_all": "Hello there, plain text.",
    "model_writes_user_turn": "<|channel|>final<|message|>Hi.<|end|><|start|>user<|message|>again<|end|>",
    "leading_space_role_continuation": " to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
}


def harmony_test_cases() -> dict[str, str]:
    """Every harmony output text in tests/test_harmony.py before its fixture/template section: the
    module's upper-case string constants and, inside test functions (decorators included), string
    constants holding a marker (not a lone marker) and `first_stop([...])` token lists (joined);
    each text once. Plus the tests' `.removesuffix(stop token)` variants."""
    src = (ROOT / "tests" / "test_harmony.py").read_text()
    cutoff = next(i for i, line in enumerate(src.splitlines(), 1) if line.startswith("# --- the tiny gpt_oss"))
    found: dict[str, str] = {}

    def add(name: str, text: str) -> None:
        if any(m in text for m in H.HARMONY_MARKERS) and text not in H.HARMONY_MARKERS and text not in found.values():
            found[name] = text

    for top in ast.parse(src).body:
        if top.lineno >= cutoff:
            break
        if (isinstance(top, ast.Assign) and isinstance(top.targets[0], ast.Name) and top.targets[0].id.isupper()
                and isinstance(top.value, ast.Constant) and isinstance(top.value.value, str)):
            add(top.targets[0].id, top.value.value)
            if top.targets[0].id in ("REASON_THEN_ANSWER", "CALL_AFTER_CHANNEL"):
                add(top.targets[0].id + ".removesuffix", top.value.value.rsplit("<|", 1)[0])
        if not (isinstance(top, ast.FunctionDef) and top.name.startswith("test_")):
            continue
        expected = {id(n) for c in ast.walk(top) if isinstance(c, ast.Compare)  # what asserts expect
                    for right in c.comparators for n in ast.walk(right)}
        for node in ast.walk(top):
            if id(node) in expected:
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                add(f"{top.name}:{node.lineno}", node.value)
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "first_stop"
                  and isinstance(node.args[0], ast.List)):
                add(f"{top.name}:{node.lineno}", "".join(e.value for e in node.args[0].elts))
    return found


_HEADERS = ["<|channel|>analysis", "<|channel|>final", "<|channel|>commentary",
            "<|channel|>commentary to=functions.get_weather <|constrain|>json", "<|channel|>commentary json",
            " to=functions.get_time<|channel|>commentary", "<|channel|>analysis to=python code", "", "<|channel|>",
            " to=functions.", "x"]
_ROLES = ["assistant", "assistant", "user", "functions.get_weather to=assistant", ""]
_TERMS = ["<|end|>", "<|return|>", "<|call|>", "", "<|end|>"]
_ARGS = ['{"city":"Paris"}', '{"city":"Rome","days":"2"}', "{}", "", "[1]", '{"a":', "nope", "plain words"]


def random_harmony_cases(n: int, seed: int = 21) -> dict[str, str]:
    """Near-harmony texts from the same pieces as test_harmony's hypothesis strategy, seeded."""
    rng = random.Random(seed)
    out = {}
    for k in range(n):
        parts = []
        for i in range(rng.randint(1, 4)):
            if (i > 0 or rng.random() < 0.5) and rng.random() < 0.8:
                parts.append("<|start|>" + rng.choice(_ROLES))
            parts.append(rng.choice(_HEADERS))
            if rng.random() < 0.85:
                parts.append("<|message|>" + rng.choice(_ARGS))
            parts.append(rng.choice(_TERMS))
        text = "".join(parts)
        if rng.random() < 0.3:
            a = rng.randint(0, len(text))
            b = rng.randint(a, len(text))
            text = text[:a] + text[b:]
        out[f"random:{k}"] = text
    return out


# --------------------------------------------------------------------------------------------
# harmony: ours vs openai-harmony
# --------------------------------------------------------------------------------------------


def load_encoding():
    """openai-harmony's GPT-OSS encoding, its o200k vocab rebuilt offline from quicktok-v1."""
    import openai_harmony as oh

    from tests.test_harmony import _o200k_vocab_dir

    vocab_dir = _o200k_vocab_dir(Path(tempfile.mkdtemp(prefix="o200k")))
    if vocab_dir is None:
        raise SystemExit("needs quicktok-v1 (requirements.txt) for the o200k vocab")
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab_dir)
    try:
        return oh, oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old


Msg = tuple  # (role, channel, recipient, content type, body)


def ours_messages(text: str) -> list[Msg]:
    """Messages with a body, or closed by a terminator (the library reports those with body "")."""
    return [(m.role, m.channel, m.recipient, m.constrain, m.content)
            for m in H.parse_harmony_messages(text) if m.has_body or m.terminator]


def _lib_tuple(m) -> Msg:
    ctype = m.content_type
    if ctype is not None and ctype.startswith(H.CONSTRAIN):
        ctype = ctype[len(H.CONSTRAIN):]
    return (m.author.role.value, m.channel, m.recipient, ctype, "".join(c.text for c in m.content))


def lib_messages(oh, enc, text: str) -> list[Msg]:
    tokens = enc.encode(text, allowed_special="all")
    return [_lib_tuple(m) for m in enc.parse_messages_from_completion_tokens(tokens, oh.Role.ASSISTANT, strict=False)]


def split_from_messages(messages: list[Msg], tools=HARMONY_TOOLS, salt="s") -> tuple:
    """split_harmony's rules applied to already-segmented messages (bodies only)."""
    pieces = {REASONING: [], CONTENT: []}
    calls = []
    for role, channel, recipient, ctype, body in messages:
        kind = H.message_kind(role, channel, recipient)
        if kind == H.DROP:
            continue
        if kind == H.TOOL:
            call = H.call_from_body(recipient or "", body, tools, len(calls), salt)
            if call is None:  # the library keeps no raw text: rebuild the canonical form
                head = f"{H.CHANNEL}{channel} to={recipient}" + (f" {H.CONSTRAIN}{ctype}" if ctype else "")
                pieces[CONTENT].append((head + H.MESSAGE + body).strip())
            else:
                calls.append(call)
            continue
        pieces[kind].append(body.strip())
    return ("\n\n".join(p for p in pieces[REASONING] if p), "\n\n".join(p for p in pieces[CONTENT] if p), calls)


def ours_split(text: str) -> tuple:
    return tuple(split_harmony(text, tools=HARMONY_TOOLS, id_salt="s"))


def lib_stream_tokens(oh, enc, chunks_of_tokens) -> list[Msg]:
    """StreamableParser over token chunks; the messages after EOS, plus a body left open."""
    parser = oh.StreamableParser(enc, oh.Role.ASSISTANT, strict=False)
    deltas: list[str] = []
    for chunk in chunks_of_tokens:
        for tok in chunk:
            parser.process(tok)
            if parser.last_content_delta:
                deltas.append(parser.last_content_delta)
    parser.process_eos()
    msgs = [_lib_tuple(m) for m in parser.messages]
    if "".join(deltas) != "".join(m[4] for m in msgs):
        raise AssertionError("streamed deltas differ from the messages' bodies")
    return msgs


def held_back_chunks(enc, text: str):
    """Char-by-char text, each piece re-encoded once no partial marker is pending (our
    `_partial_marker_start` hold-back: without it a marker cut across chunks is never special)."""
    pending = ""
    for ch in text:
        buf = pending + ch
        keep = H.partial_marker_start(buf, H.HARMONY_MARKERS)
        pending = buf[keep:]
        if buf[:keep]:
            yield enc.encode(buf[:keep], allowed_special="all")
    if pending:
        yield enc.encode(pending, allowed_special="all")


def fixture_tokenizer(tokenizer_dir: Path | None = None):
    """The tiny GPT-OSS fixture's tokenizer (SmolLM2 + harmony specials), or None."""
    try:
        from tokenizers import Tokenizer

        from tests.fixtures.tiny_gpt_oss import write_harmony_tokenizer

        folder = Path(tempfile.mkdtemp(prefix="tiny_gpt_oss_tok"))
        with contextlib.redirect_stderr(io.StringIO()):
            write_harmony_tokenizer(folder, tokenizer_dir)
        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # no cached SmolLM2 tokenizer: skip that column
        print(f"(fixture tokenizer unavailable: {exc})", file=sys.stderr)
        return None


def ours_stop_at(pieces: list[str]) -> int | None:
    stopper = HarmonyStopper()
    for i, p in enumerate(pieces):
        if stopper.push(p):
            return i
    return None


def lib_stop_at(tokens: list[int], stops: set[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stops), None)


def compare_harmony(cases: dict[str, str], tokenizer_dir: Path | None = None) -> tuple[list[dict], dict]:
    """One row per case: for each check, whether the library (as described in the module
    docstring) gives our result; `<check>_got` / `_want` where not. Plus the passes per check."""
    oh, enc = load_encoding()
    fixture = fixture_tokenizer(tokenizer_dir)
    action_stops = set(enc.stop_tokens_for_assistant_actions())
    all_stops = set(enc.stop_tokens())
    rows = []
    for name, text in cases.items():
        row = {"case": name, "text": text}
        ours_m, ours_s = ours_messages(text), ours_split(text)

        def check(key, fn, expected):
            try:
                got = fn()
            except Exception as exc:
                row[key] = False
                row[key + "_got"] = f"{type(exc).__name__}: {exc}"
                return
            row[key] = got == expected
            if got != expected:
                row[key + "_got"] = repr(got)
                row[key + "_want"] = repr(expected)

        check("messages", lambda: lib_messages(oh, enc, text), ours_m)
        check("split", lambda: split_from_messages(lib_messages(oh, enc, text)), ours_s)
        check("stream_o200k_tokens",
              lambda: split_from_messages(lib_stream_tokens(oh, enc, [[t] for t in enc.encode(text, allowed_special="all")])),
              ours_s)
        check("stream_text_chunks", lambda: split_from_messages(lib_stream_tokens(oh, enc, held_back_chunks(enc, text))),
              ours_s)
        if fixture is not None:
            check("stream_fixture_ids",
                  lambda: split_from_messages(lib_stream_tokens(oh, enc, [fixture.encode(text, add_special_tokens=False).ids])),
                  ours_s)
        tokens = enc.encode(text, allowed_special="all")
        pieces = [enc.decode([t]) for t in tokens]
        want = ours_stop_at(pieces)
        row["stop_actions"] = lib_stop_at(tokens, action_stops) == want
        row["stop_all"] = lib_stop_at(tokens, all_stops) == want
        rows.append(row)
    checks = [k for k in rows[0] if k not in ("case", "text") and not k.endswith(("_got", "_want"))]
    summary = {k: sum(r[k] for r in rows) for k in checks}
    return rows, summary


# --------------------------------------------------------------------------------------------
# tool calls and reasoning: ours vs mlx-lm tool_parsers
# --------------------------------------------------------------------------------------------

from tests.test_tool_calls import (  # noqa: E402
    EXPECTED_ARGS,
    GLM_LEGACY,
    HERMES_JSON,
    QWEN_XML,
    TOOLS,
)

READ_TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "limit": {"type": "integer"}}}}}]
EDIT_TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "code": {"type": "string"}, "line": {"type": "integer"}, "zip": {"type": "string"}}}}}]


def dumps(d: dict) -> str:
    return json.dumps(d, ensure_ascii=False)


# (name, format, family, text, tools, thinking_started, want_reasoning, want_content, want_calls)
# format: which mlx-lm parser the model would have (json -> json_tools, xml -> qwen3_coder, glm -> glm47),
# "any" for malformed input (run against each of the three).
S = dumps(EXPECTED_ARGS)
TOOL_CASES = [
    ("all_formats/json", "json", "generic", "Looking.\n" + HERMES_JSON + "\n", TOOLS, False, "", "Looking.", [("search", S)]),
    ("all_formats/xml", "xml", "qwen3", "Looking.\n" + QWEN_XML + "\n", TOOLS, False, "", "Looking.", [("search", S)]),
    ("all_formats/glm", "glm", "glm4", "Looking.\n" + GLM_LEGACY + "\n", TOOLS, False, "", "Looking.", [("search", S)]),
    ("hermes_arguments_as_json_string", "json", "generic",
     '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\", \\"limit\\": \\"3\\"}"}</tool_call>', TOOLS,
     False, "", "", [("search", '{"query": "x", "limit": 3}')]),
    ("two_calls_same_format/json", "json", "generic", f"A {HERMES_JSON} B {HERMES_JSON} C", TOOLS, False, "",
     "A  B  C", [("search", S)] * 2),
    ("two_calls_same_format/xml", "xml", "qwen3", f"A {QWEN_XML} B {QWEN_XML} C", TOOLS, False, "", "A  B  C",
     [("search", S)] * 2),
    ("two_calls_same_format/glm", "glm", "glm4", f"A {GLM_LEGACY} B {GLM_LEGACY} C", TOOLS, False, "", "A  B  C",
     [("search", S)] * 2),
    ("mixed_formats_one_reply", "xml", "qwen3", f"A {QWEN_XML} B {GLM_LEGACY} C {HERMES_JSON} D", TOOLS, False, "",
     "A  B  C  D", [("search", S)] * 3),
    ("missing_final_close/json", "json", "generic", HERMES_JSON.removesuffix("</tool_call>"), TOOLS, False, "", "",
     [("search", S)]),
    ("missing_final_close/xml", "xml", "qwen3", "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n",
     TOOLS, False, "", "", [("search", '{"query": "x"}')]),
    ("missing_final_close/glm", "glm", "glm4", "<tool_call>search\n<arg_key>limit</arg_key><arg_value>9", TOOLS,
     False, "", "", [("search", '{"limit": 9}')]),
    ("unterminated_then_call/json", "json", "generic", HERMES_JSON.removesuffix("</tool_call>") + "\n" + HERMES_JSON,
     TOOLS, False, "", "", [("search", S)] * 2),
    ("no_argument_call/glm_word", "glm", "glm4", "<tool_call>list_files</tool_call>", None, False, "", "",
     [("list_files", "{}")]),
    ("no_argument_call/json", "json", "generic", '<tool_call>{"name": "ls"}</tool_call>', None, False, "", "",
     [("ls", "{}")]),
    ("no_argument_call/xml", "xml", "qwen3", "<tool_call><function=ls></function></tool_call>", None, False, "", "",
     [("ls", "{}")]),
    ("schema_typing_falls_back_to_string", "xml", "qwen3",
     "<tool_call><function=search><parameter=limit>many</parameter><parameter=regex>yes</parameter>"
     "<parameter=filters>{broken</parameter><parameter=query>42</parameter></function></tool_call>", TOOLS, False, "",
     "", [("search", '{"limit": "many", "regex": "yes", "filters": "{broken", "query": "42"}')]),
    ("untyped_values_only_parse_when_unambiguous", "xml", "qwen3",
     '<tool_call><function=other><parameter=obj>{"a": 1}</parameter><parameter=arr>[1, 2]</parameter>'
     "<parameter=num>42</parameter><parameter=neg>-1.5</parameter><parameter=zip>007</parameter>"
     "<parameter=big>1e3</parameter><parameter=flag>true</parameter><parameter=nul>null</parameter>"
     "<parameter=text>hello</parameter></function></tool_call>", TOOLS, False, "", "",
     [("other", '{"obj": {"a": 1}, "arr": [1, 2], "num": 42, "neg": -1.5, "zip": "007", "big": "1e3", '
                '"flag": "true", "nul": "null", "text": "hello"}')]),
    # realistic extras
    ("xml_multiline_code_value", "xml", "qwen3",
     "<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=code>\nif a < b:\n"
     "    return {\"k\": 1}\n</parameter>\n<parameter=line>\n12\n</parameter>\n<parameter=zip>\n007\n</parameter>\n"
     "</function>\n</tool_call>", EDIT_TOOLS, False, "", "",
     [("edit", '{"path": "src/a.py", "code": "if a < b:\\n    return {\\"k\\": 1}", "line": 12, "zip": "007"}')]),
    ("json_unicode_nested", "json", "generic",
     '<tool_call>\n{"name": "search", "arguments": {"query": "café 日本 🙂", "filters": {"a": [1, {"b": null}]}}}\n</tool_call>',
     TOOLS, False, "", "", [("search", '{"query": "café 日本 🙂", "filters": {"a": [1, {"b": null}]}}')]),
    ("glm_json_value_and_string_number", "glm", "glm4",
     '<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>007</arg_value>\n<arg_key>line</arg_key>\n'
     "<arg_value>3</arg_value>\n</tool_call>", EDIT_TOOLS, False, "", "", [("edit", '{"path": "007", "line": 3}')]),
    ("qwen3_think_then_call", "xml", "qwen3",
     "<think>\nI should read the file.\n</think>\n\n<tool_call>\n<function=read_file>\n<parameter=path>\n"
     "src/main.py\n</parameter>\n<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>", READ_TOOLS, False,
     "I should read the file.", "", [("read_file", '{"path": "src/main.py", "limit": 40}')]),
    ("text_around_two_json_calls", "json", "generic",
     'Let me check.\n<tool_call>{"name": "read_file", "arguments": {"path": "a"}}</tool_call>\n'
     '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"b\\"}"}</tool_call>\ntrailing words\n',
     READ_TOOLS, False, "", "Let me check.\n\n\ntrailing words",
     [("read_file", '{"path": "a"}'), ("read_file", '{"path": "b"}')]),
]
# Malformed: nothing is a call, and the text stays visible (never dropped silently).
MALFORMED = [
    "<tool_call>not a call at all</tool_call>", '<tool_call>{"name": 3}</tool_call>', "<tool_call>{broken json</tool_call>",
    "<tool_call></tool_call>", "<tool_call>", "</tool_call> stray close",
    '<tool_call>{"name": "x", "arguments": "not json"}</tool_call>', '<tool_call>{"name": "x", "arguments": [1]}</tool_call>',
    "<tool_call><function=>oops</tool_call>",
]
for i, bad in enumerate(MALFORMED):
    TOOL_CASES.append((f"malformed:{i}", "any", "generic", f"before {bad} after", TOOLS, False, "",
                       f"before {bad} after", []))
# Cut by max_tokens inside the arguments: a JSON call cannot be completed, so its text stays visible;
# XML names every value as it goes, so the parameters written so far are a call (test_missing_final_close).
TRUNC_JSON = 'Checking.\n<tool_call>{"name": "search", "arguments": {"query": "trunc'
TOOL_CASES += [
    ("truncated_in_arguments/json", "json", "generic", TRUNC_JSON, TOOLS, False, "", TRUNC_JSON, []),
    ("truncated_in_arguments/xml", "xml", "qwen3", "Checking.\n<tool_call>\n<function=search>\n<parameter=query>\nfoo",
     TOOLS, False, "", "Checking.", [("search", '{"query": "foo"}')]),
]

REASONING_CASES = [
    ("qwen3_think", "<think>\nThe user wants a greeting.\nKeep it short.\n</think>\n\nHello! How can I help?", False,
     "The user wants a greeting.\nKeep it short.", "Hello! How can I help?"),
    ("prompt_opened_think", "Short plan.\n</think>\n\nDone.", True, "Short plan.", "Done."),
    ("glm_orphan_close", "The user asks for 2+2.\nThat is 4.</think>\n\nThe answer is 4.", True,
     "The user asks for 2+2.\nThat is 4.", "The answer is 4."),
    ("stray_close_never_leaks", "The user asks for 2+2.\nThat is 4.</think>\n\nThe answer is 4.", False, "",
     "The user asks for 2+2.\nThat is 4.\n\nThe answer is 4."),
    ("unterminated_think", "<think>\nstill thinking when max_tokens hit", False, "still thinking when max_tokens hit", ""),
    ("content_only", "Plain answer with <b>html</b> and a < sign.\n\nSecond paragraph.", False, "",
     "Plain answer with <b>html</b> and a < sign.\n\nSecond paragraph."),
    ("tool_call_inside_reasoning", "<think>maybe <tool_call>{...}</tool_call> later</think>answer", False,
     "maybe <tool_call>{...}</tool_call> later", "answer"),
    ("nested_think_dropped", "<think>a <think>b</think>c", False, "a b", "c"),
]

MLX_PARSERS = {"json": "json_tools", "xml": "qwen3_coder", "glm": "glm47"}
FAMILY_OF = {"json": "generic", "xml": "qwen3", "glm": "glm4"}   # our family argument for that format


def mlxlm_run(text: str, fmt: str, tools, thinking_started: bool, chunks: list[str]) -> tuple:
    """mlx_lm.server's loop (0.32) on `chunks`: TextStateMachine segments, tool blocks parsed at the
    end of each block by the model's parser, failures dropped (the server logs a warning)."""
    import importlib

    from mlx_lm.generate import TextStateMachine

    parser = importlib.import_module(f"mlx_lm.tool_parsers.{MLX_PARSERS[fmt]}")
    sm = TextStateMachine({"normal": [("<think>", "reasoning"), (parser.tool_call_start, "tool")],
                           "reasoning": [("</think>", "normal")], "tool": [(parser.tool_call_end, "normal")]})
    initial = "reasoning" if thinking_started else "normal"
    state = sm.make_state(initial)
    prev, reasoning, content, tool_text, blocks = initial, "", "", "", []
    for i, chunk in enumerate(chunks):
        state, segments = TextStateMachine.split(state, chunk)
        if i == len(chunks) - 1:   # the text ends without a stop token: flush, as for "length"
            state, flushed, cur = TextStateMachine.flush(state)
            segments.append((cur, flushed))
        for cur, clean in segments:
            if cur == "reasoning":
                reasoning += clean
            elif cur == "tool":
                tool_text += clean
            elif cur == "normal":
                if prev == "tool":
                    blocks.append(tool_text)
                    tool_text = ""
                content += clean
            prev = cur
    if prev == "tool" and tool_text:
        blocks.append(tool_text)
    calls = []
    for block in blocks:
        try:
            parsed = parser.parse_tool_call(block, tools)
        except (ValueError, json.JSONDecodeError):
            continue  # the server drops it with a warning
        for tc in parsed if isinstance(parsed, list) else [parsed]:
            calls.append((tc["name"], json.dumps(tc["arguments"], ensure_ascii=False)))
    return reasoning.strip(), content.strip(), calls


def ours_run(text: str, family: str, tools, thinking_started: bool, chunks: list[str] | None) -> tuple:
    if chunks is None:
        out = split_output(text, thinking_started=thinking_started, tools=tools, family=family)
        return out.reasoning, out.content, [(c.name, c.arguments) for c in out.tool_calls]
    splitter = ReasoningStreamSplitter(thinking_started=thinking_started, tools=tools, family=family)
    events = [e for c in chunks for e in splitter.feed(c)] + splitter.finish()
    calls = [(c.name, c.arguments) for e in events if e.kind == "tool_calls" for c in e.calls]
    return ("".join(e.text for e in events if e.kind == "reasoning"),
            "".join(e.text for e in events if e.kind == "content"), calls)


def _verdict(fn) -> tuple[bool, str]:
    try:
        return True, fn()
    except Exception as exc:  # a crash is a failure (the server would 500)
        return False, f"{type(exc).__name__}: {exc}"


def compare_tool_calls() -> tuple[list[dict], list[dict]]:
    """Rows for TOOL_CASES (one per mlx-lm parser tried) and REASONING_CASES: `ours`, `mlx_lm`
    (whole text) and `*_stream` (char by char) each True when the written expectation is met."""
    logging.disable(logging.WARNING)
    rows = []
    for name, fmt, family, text, tools, started, want_r, want_c, want_calls in TOOL_CASES:
        want = (want_r, want_c, want_calls)
        for parser_fmt in (MLX_PARSERS if fmt == "any" else [fmt]):
            row = {"case": name, "parser": MLX_PARSERS[parser_fmt], "text": text}
            fam = FAMILY_OF[parser_fmt] if fmt == "any" else family   # malformed: as that parser's family
            for who, run in (("ours", lambda ch: ours_run(text, fam, tools, started, ch)),
                             ("mlx_lm", lambda ch: mlxlm_run(text, parser_fmt, tools, started, ch if ch else [text]))):
                _score(row, who, run, text, want)
            rows.append(row)
    reasoning_rows = []
    for name, text, started, want_r, want_c in REASONING_CASES:
        want = (want_r, want_c, [])
        row = {"case": name, "text": text}
        for who, run in (("ours", lambda ch: ours_run(text, "generic", None, started, ch)),
                         ("mlx_lm", lambda ch: mlxlm_run(text, "json", None, started, ch if ch else [text]))):
            _score(row, who, run, text, want)
        reasoning_rows.append(row)
    return rows, reasoning_rows


def _score(row: dict, who: str, run: Callable[[list[str] | None], Any], text: str, want: tuple) -> None:
    """One parser's verdict on one case, whole and streamed char by char, into ``row``."""
    ok_w, whole = _verdict(lambda: run(None))
    ok_s, streamed = _verdict(lambda: run(list(text)))
    row[who] = ok_w and whole == want
    row[who + "_stream"] = ok_s and streamed == want
    if not row[who] or not row[who + "_stream"]:
        row[who + "_got"] = repr(whole if whole != want else streamed)


# --------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["harmony", "tools"])
    ap.add_argument("--random", type=int, default=300, help="random near-harmony texts (default 300)")
    ap.add_argument("--show", type=int, default=6, help="failures to print per check")
    ap.add_argument("--json", type=Path, help="write every case's verdict here")
    args = ap.parse_args()
    report: dict = {}
    if args.only in (None, "harmony"):
        groups = {"tests": harmony_test_cases(), "realistic": REALISTIC_HARMONY,
                  "random": random_harmony_cases(args.random)}
        print("harmony: openai-harmony (o200k re-encoded, our classification) vs parsing/harmony.py (reference)")
        report["harmony"] = {}
        for group, cases in groups.items():
            rows, summary = compare_harmony(cases)
            report["harmony"][group] = {"summary": summary, "rows": rows}
            print(f"  {group:10s} {len(rows):4d} cases  " + "  ".join(f"{k}={v}" for k, v in summary.items()))
        for group in groups:
            rows = report["harmony"][group]["rows"]
            for key in report["harmony"][group]["summary"]:
                bad = [r for r in rows if not r[key]]
                for r in bad[: args.show if group != "random" else 2]:
                    print(f"    FAIL {key} [{r['case']}] {r['text'][:90]!r}\n"
                          f"         got {str(r.get(key + '_got', '-'))[:160]}")
    if args.only in (None, "tools"):
        rows, reasoning_rows = compare_tool_calls()
        report["tools"], report["reasoning"] = rows, reasoning_rows
        print("\ntool calls: ours (parsing/tool_calls.py) vs mlx-lm 0.32 tool_parsers via its server loop")
        print(f"  {'parser':12s} {'cases':>5s} {'ours':>5s} {'ours~':>5s} {'mlx':>5s} {'mlx~':>5s}   (~ = streamed char by char)")
        for parser in MLX_PARSERS.values():
            sub = [r for r in rows if r["parser"] == parser]
            print(f"  {parser:12s} {len(sub):5d} {sum(r['ours'] for r in sub):5d} {sum(r['ours_stream'] for r in sub):5d}"
                  f" {sum(r['mlx_lm'] for r in sub):5d} {sum(r['mlx_lm_stream'] for r in sub):5d}")
        sub = reasoning_rows
        print(f"  {'<think>':12s} {len(sub):5d} {sum(r['ours'] for r in sub):5d} {sum(r['ours_stream'] for r in sub):5d}"
              f" {sum(r['mlx_lm'] for r in sub):5d} {sum(r['mlx_lm_stream'] for r in sub):5d}")
        for r in rows + reasoning_rows:
            for who in ("ours", "mlx_lm"):
                if not r[who] or not r[who + "_stream"]:
                    print(f"    FAIL {who:6s} {r.get('parser', '<think>'):11s} [{r['case']}] "
                          f"got {str(r.get(who + '_got'))[:150]}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False, default=repr))


if __name__ == "__main__":
    main()
