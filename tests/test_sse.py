"""SSE frames are byte-identical to json.dumps of the equivalent chunk.

Run: python -m pytest tests/test_sse.py
"""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxstack.server.http.sse import DONE, ChunkEncoder, chunk_dict
from mlxstack.parsing.tool_calls import ToolCall

ID, CREATED, MODEL = "chatcmpl-abc", 1700000000, "mlx-community/Qwen3-0.6B-4bit"


def reference(delta, finish_reason=None, usage=None, *, choices=True, id=ID, model=MODEL):
    chunk = chunk_dict(id, CREATED, model, delta, finish_reason, usage, choices=choices)
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


# any code point, surrogates and control characters included
any_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF))


@settings(max_examples=500)
@given(any_text)
def test_content_and_reasoning_frames_match_json_dumps(text):
    enc = ChunkEncoder(ID, CREATED, MODEL)
    assert enc.content_frame(text) == reference({"content": text})
    assert enc.reasoning_frame(text) == reference({"reasoning_content": text})


@settings(max_examples=200)
@given(id=any_text, model=any_text, text=any_text)
def test_odd_ids_and_model_names_are_escaped(id, model, text):
    enc = ChunkEncoder(id, CREATED, model)
    assert enc.content_frame(text) == reference({"content": text}, id=id, model=model)


def test_fixed_strings():
    enc = ChunkEncoder(ID, CREATED, MODEL)
    for text in ["", "hi", '"quoted"', "back\\slash", "\n\r\t\b\f\x00\x1f\x7f", "é日本🙂", "\ud800"]:
        assert enc.content_frame(text) == reference({"content": text})
    frame = enc.content_frame("hi")
    assert frame.startswith(b"data: {") and frame.endswith(b"}\n\n")
    assert json.loads(frame[6:]) == chunk_dict(ID, CREATED, MODEL, {"content": "hi"})


def test_once_per_stream_frames():
    enc = ChunkEncoder(ID, CREATED, MODEL)
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
             "prompt_tokens_details": {"cached_tokens": 8}}
    assert enc.role_frame() == reference({"role": "assistant", "content": ""})
    assert enc.final_frame("stop") == reference({}, "stop")
    assert enc.final_frame("length", usage) == reference({}, "length", usage)
    assert enc.usage_frame(usage) == reference({}, None, usage, choices=False)
    assert json.loads(enc.usage_frame(usage)[6:])["choices"] == []
    calls = [ToolCall("f", '{"a": 1}', "call_1"), ToolCall("g", "{}", "call_2")]
    expected = [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    assert enc.tool_calls_frame(calls) == reference({"tool_calls": expected})
    assert DONE == b"data: [DONE]\n\n"
