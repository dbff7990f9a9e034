"""Issue 21: one render per request.

The request assembly pass (engine/assembly.py) renders the chat template once; the cache key,
the history boundary, the generation prompt, the implicit session id and the next turn's stable
prefix are derived from that render. Proven three ways:
- the derivations equal what a render of their own gives (the old way), for every template
  variant and conversation shape here;
- a spy on the renderer counts exactly one template call per request, through each front door
  (chat completions, Responses, Messages) and model family (ChatML dense, hybrid, harmony, VLM);
- the ``renders`` counter and each request's row say the same.
"""
from __future__ import annotations

import json

import base64
import io

import pytest

from mlxstack.cache.lcp import lcp
from mlxstack.cache.summary import opening_session_id
from mlxstack.prompt.key_text import canonical_text, message_texts
from mlxstack.prompt.render import encode
from mlxstack.prompt.scrub import scrub_cache_key
from mlxstack.prompt.session_context import session_opening
from mlxstack.routing.session_key import routing_session
from tests.conftest import LiveServer, build_engine, engine_settings, http_json
from tests.fixtures import agent_shapes as shapes
from mlxstack.engine.request import ChatJob
from mlxstack.runner.sampling import SamplingParams
from tests.test_prefix_stability import (NO_REASONING_TEMPLATE, REFUSING_TEMPLATE, _qwen_template,
                                         variant)

# A Llama-3-style template: content trimmed, turn markup the SmolLM2 tokenizer does not know.
LLAMA_TRIM_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{- m['content'] | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
# A template that escapes content: the key cannot be found verbatim, so it is rendered (counted).
ESCAPING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | tojson }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


# ----------------------------------------------------------------------------------- pure: key text
def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + "<|im_start|>assistant\n"


def test_unchanged_texts_return_the_model_text_itself():
    original = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi", "message_id": "42"}]
    canonical = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi", "message_id": "X"}]
    text = chatml(("system", "S"), ("user", "hi"))
    assert canonical_text(text, original, canonical) is text


def test_a_changed_text_is_replaced_where_its_message_was_written_not_where_it_first_occurs():
    # The system prompt quotes the user's text: the search starts after the system message.
    original = [{"role": "system", "content": "quote: id=7"}, {"role": "user", "content": "id=7"}]
    canonical = [{"role": "system", "content": "quote: id=7"}, {"role": "user", "content": "id=X"}]
    text = chatml(("system", "quote: id=7"), ("user", "id=7"))
    assert canonical_text(text, original, canonical) == chatml(("system", "quote: id=7"), ("user", "id=X"))


def test_text_parts_are_replaced_one_by_one():
    original = [{"role": "user", "content": [{"type": "text", "text": "a1"}, {"type": "image_url", "image_url": {}},
                                             {"type": "text", "text": "b1"}]}]
    canonical = [{"role": "user", "content": [{"type": "text", "text": "a1"}, {"type": "image_url", "image_url": {}},
                                              {"type": "text", "text": "b2"}]}]
    assert message_texts(original[0]) == ["a1", "b1"]
    assert canonical_text("<u>a1<img>b1</u>", original, canonical) == "<u>a1<img>b2</u>"


def test_a_trimmed_text_is_replaced_trimmed():
    original = [{"role": "user", "content": "  id=7\n"}]
    canonical = [{"role": "user", "content": "  id=X\n"}]
    assert canonical_text("[user]id=7[end]", original, canonical) == "[user]id=X[end]"


def test_a_changed_text_the_template_did_not_write_verbatim_needs_a_render():
    original = [{"role": "user", "content": 'say "7"'}]
    canonical = [{"role": "user", "content": 'say "X"'}]
    assert canonical_text('[user]"say \\"7\\""[end]', original, canonical) is None
    assert canonical_text("x", original, canonical + canonical) is None       # message counts differ


# ----------------------------------------------------------------------------------- pure: session ids
def test_the_implicit_session_id_is_the_routers_and_hashes_the_scrubbed_opening():
    system = {"role": "system", "content": "Be brief.\nCurrent time is 10:00"}
    first = {"role": "user", "content": "hello"}
    later = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    opening = session_opening([system, first, *later])
    scrubbed = {"role": "system", "content": "Be brief.\nCurrent time is __SCRUBBED_TIME__"}
    assert opening == [scrubbed, first, later[0]]              # through the first reply
    assert session_opening([system, first]) == [scrubbed, first]   # a first turn has none yet
    sid = opening_session_id(opening)
    assert sid.startswith("msg:") and len(sid) == 4 + 24
    # The clock in the system prompt moved: same session. Another first message or another first
    # reply: another session.
    moved = {"role": "system", "content": "Be brief.\nCurrent time is 10:05"}
    assert opening_session_id(session_opening([moved, first, *later])) == sid
    assert opening_session_id(session_opening([system, {"role": "user", "content": "bye"}, *later])) != sid
    assert opening_session_id(session_opening([system, first, {"role": "assistant", "content": "yo"}])) != sid
    # The router spells it the same way.
    assert routing_session({}, {}, [system, first, *later]).session_id == sid


# ----------------------------------------------------------------------------------- engines
def job(messages: list[dict], thinking: bool = False) -> ChatJob:
    """A request without a session id of its own (the implicit id is derived)."""
    return ChatJob(request_id="t", messages=messages, tools=None, enable_thinking=thinking,
                   params=SamplingParams(temperature=0.0, max_tokens=4), stop=[], body={}, headers={},
                   emit=lambda _: None, is_cancelled=lambda: False)


@pytest.fixture(scope="module")
def template_engines(tmp_path_factory, tiny_dense_path, tiny_kind_paths):
    tmp = tmp_path_factory.mktemp("one_render_templates")
    paths = {
        "chatml": tiny_dense_path,
        "refusing": variant(tmp, tiny_dense_path, "refusing", REFUSING_TEMPLATE),
        "no_reasoning": variant(tmp, tiny_dense_path, "no_reasoning", NO_REASONING_TEMPLATE),
        "qwen": variant(tmp, tiny_dense_path, "qwen", _qwen_template(False)),
        "llama_trim": variant(tmp, tiny_dense_path, "llama_trim", LLAMA_TRIM_TEMPLATE),
        "escaping": variant(tmp, tiny_dense_path, "escaping", ESCAPING_TEMPLATE),
        "harmony": tiny_kind_paths("gpt_oss"),
    }
    return {name: build_engine(engine_settings(path)) for name, path in paths.items()}


def conversations() -> dict[str, list[dict]]:
    system = {"role": "system", "content": shapes.openclaw_system()}
    first = shapes.openclaw_user("What is on my calendar?", message_id=101, minute=5)
    reply = {"role": "assistant", "content": "Two meetings."}
    second = shapes.openclaw_user("Move the first one.", message_id=102, minute=7)
    return {
        "one_user": [{"role": "user", "content": "Say hello."}],
        "openclaw_turn_2": [system, first, reply, second],
        "reasoning_kept": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4", "reasoning_content": "Two plus two."},
                           {"role": "user", "content": "And 3+3?  "}],
        "claude_code": [shapes.claude_code_first_user("List the files.")],
    }


CASES = [(t, c, think) for t in ("chatml", "refusing", "no_reasoning", "qwen", "llama_trim", "escaping", "harmony")
         for c in conversations() for think in (False, True)]


@pytest.mark.parametrize("template,conversation,thinking", CASES)
def test_every_derivation_equals_its_own_render(template_engines, template, conversation, thinking):
    eng = template_engines[template]
    j = job(conversations()[conversation], thinking)
    prep = eng.prepare(j)
    renderer, tok = eng.renderer, eng.loaded.tokenizer
    # The key: what rendering the canonical messages gives, scrubbed.
    key_text = scrub_cache_key(renderer.render(prep.canonical, j.tools, thinking))
    assert prep.key_tokens == (prep.model_tokens if key_text == prep.model_text else encode(tok, key_text))
    # The history boundary and the generation prompt: what rendering the history on its own gives.
    history = renderer.render(prep.original, j.tools, thinking, add_generation_prompt=False)
    assert prep.model_text.startswith(history)
    assert prep.generation_text == prep.model_text[len(history):]
    assert prep.history_end == lcp(encode(tok, history), prep.model_np)
    # One render, except where the template escapes content it canonicalised (then two, counted).
    changed = prep.canonical != prep.original and any(
        a != b for o, c in zip(prep.original, prep.canonical) for a, b in zip(message_texts(o), message_texts(c)))
    assert prep.renders == (2 if template == "escaping" and changed else 1)


def test_the_next_turns_stable_prefix_comes_from_the_turn_store(template_engines):
    eng = template_engines["qwen"]
    turn1 = conversations()["openclaw_turn_2"][:2]
    out1 = eng.run(job(turn1))
    turn2 = turn1 + [{"role": "assistant", "content": out1.text}, {"role": "user", "content": "Thanks."}]
    calls = spy_renders(eng)
    prep = eng.prepare(job(turn2))
    session = eng.session_of(prep, job(turn2))
    assert session.session_id == out1.session_id and session.source == "message-prefix"
    stable_msgs, stable_tokens = eng.stable_prefix(prep, session.session_id, job(turn2))
    assert calls == [1] and prep.renders == 1      # prepare's render; the stable prefix cost none
    # exactly where the turn-1 history ends in turn 2's tokens, as rendering it would say
    history1 = eng.renderer.render(prep.original[:2], None, False, add_generation_prompt=False)
    assert (stable_msgs, stable_tokens) == (2, lcp(encode(eng.loaded.tokenizer, history1), prep.model_np))


def spy_renders(eng) -> list[int]:
    """Count the template calls the engine makes from now on (calls[0])."""
    calls = [0]
    real = eng.renderer.render

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    eng.renderer.render = counted
    return calls


def spy_replies(eng) -> list[str]:
    """The visible content of every reply the engine finishes from now on (what a client echoes)."""
    from mlxstack.parsing.output import split_reply

    seen: list[str] = []
    real = eng.finish

    def finish(seq, *args, **kwargs):
        out = real(seq, *args, **kwargs)
        seen.append(split_reply(out.text, thinking_started=out.thinking_started, tools=seq.job.tools,
                                family=eng.loaded.family).content)
        return out

    eng.finish = finish
    return seen


# ----------------------------------------------------------------------------------- every front door
def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 30, 30)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


FAMILIES = ["dense", "hybrid", "gpt_oss", "vlm"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request, tiny_kind_paths, tiny_vlm_path, tmp_path_factory):
    path = tiny_vlm_path if request.param == "vlm" else tiny_kind_paths(request.param)
    # Room for every conversation's snapshots: which of them the snapshot pool keeps is its own
    # question (.context/TASKS.md), not this test's.
    srv = LiveServer(engine_settings(path, log_root=str(tmp_path_factory.mktemp("logs")), snapshot_max_entries=64))
    try:
        yield request.param, srv
    finally:
        srv.close()


def _turns(front: str, family: str, stream: bool) -> list[tuple[str, dict]]:
    """Two requests of a new conversation (the second extends the first) for a front door."""
    image = [{"type": "image_url", "image_url": {"url": _png()}}] if family == "vlm" else []
    first_text = f"Describe {front} {'streamed' if stream else 'whole'} in one word."
    if front == "chat":
        m1 = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": [{"type": "text", "text": first_text}, *image]}]
        m2 = m1 + [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Again."}]
        return [("/v1/chat/completions", {"model": "m", "messages": m, "max_tokens": 3}) for m in (m1, m2)]
    if front == "responses":
        parts = [{"type": "input_text", "text": first_text}] + (
            [{"type": "input_image", "image_url": _png()}] if family == "vlm" else [])
        i1 = [{"role": "user", "content": parts}]
        i2 = i1 + [{"role": "assistant", "content": [{"type": "output_text", "text": "Fine."}]},
                   {"role": "user", "content": "Again."}]
        return [("/v1/responses", {"model": "m", "instructions": "Be brief.", "input": i, "max_output_tokens": 3})
                for i in (i1, i2)]
    parts = [{"type": "text", "text": first_text}] + (
        [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png().split(",", 1)[1]}}]
        if family == "vlm" else [])
    a1 = [{"role": "user", "content": parts}]
    a2 = a1 + [{"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Again."}]
    return [("/v1/messages", {"model": "m", "system": "Be brief.", "messages": a, "max_tokens": 3}) for a in (a1, a2)]


@pytest.mark.parametrize("front", ["chat", "responses", "messages"])
@pytest.mark.parametrize("stream", [False, True])
def test_one_render_per_request_through_every_front_door(family_server, front, stream):
    family, srv = family_server
    state = srv.app.state
    calls = spy_renders(srv.app.engine)
    before, echoes = state.counters.get("renders"), state.counters.get("echo_renders")
    rows_before = len(state.rows)
    turns = _turns(front, family, stream)
    replies = spy_replies(srv.app.engine)
    for i, (path, body) in enumerate(turns):
        if i:   # the client echoes the reply it saw (its implicit session is the conversation's from here)
            body = json.loads(json.dumps(body).replace('"Fine."', json.dumps(replies[-1])))
        status, reply, _ = http_json(srv.base + path, {**body, "model": srv.app.model_id, "stream": stream})
        assert status == 200, reply
    rows = list(state.rows)[rows_before:]
    # one render per request; closing a text model's turn renders its echo twice (engine/finish.py
    # echo_ids: before a user turn and before a tool result; harmony refuses a tool result without
    # a call, so a second user turn), an image prompt's never
    echoed = state.counters.get("echo_renders") - echoes
    assert echoed == {"vlm": 0, "gpt_oss": 3}.get(family, 2) * len(turns)
    assert calls == [len(turns) + echoed]
    assert state.counters.get("renders") - before == len(turns)
    assert [r["renders"] for r in rows] == [1] * len(turns)
    # the second turn found the first one's session without an id of its own, and reused its KV
    assert rows[1]["session"] == rows[0]["session"] and rows[1]["stable_prefix_msgs"] >= 1
    assert rows[1]["cached_tokens"] > 0, [{k: r[k] for k in ("session", "prompt_tokens", "cached_tokens", "match_type", "stable_prefix_msgs", "finish_reason")} for r in rows]
