"""NORMALIZE_WRITE_TOOL_CONTENT_FOR_PROMPT: old file writes replaced by a stable placeholder in
the model input (prompt/write_content.py), and on a tiny model: the normalized history is a
prefix the next turn shares token for token (a cache hit), parity with a cold prefill of the same
normalized tokens, healing and the session records still following what the client sent."""
from __future__ import annotations

import copy
import json

import pytest

from mlxstack.cache.lcp import lcp
from mlxstack.prompt.healing import HealingStore, history_digest
from mlxstack.prompt.render import encode
from mlxstack.prompt.write_content import omit_written_content, placeholder
from tests.conftest import build_engine, engine_settings
from tests.test_engine import SYSTEM, job

PY = "print(1)\n" * 200            # 1800 bytes, sha256 56ef53eb...
E_ACUTE = "é" * 100                # 200 UTF-8 bytes


def _call(cid, name, args, as_string=True, compact=False):
    text = json.dumps(args, separators=(",", ":") if compact else (", ", ": "), ensure_ascii=False)
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": text if as_string else args}}


def _assistant(*calls, content=""):
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


def _tool(cid, text):
    return {"role": "tool", "tool_call_id": cid, "content": text}


def test_placeholder_is_size_and_digest_of_the_utf8_content():
    assert placeholder(PY) == "[file content omitted: 1800 bytes, sha256 56ef53eb]"
    assert placeholder(E_ACUTE) == "[file content omitted: 200 bytes, sha256 f42ec48e]"


def test_only_earlier_assistant_turns_lose_their_write_content():
    messages = [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "build it"},
        _assistant(_call("c1", "Write", {"file_path": "/a.py", "content": PY})),                 # Claude Code
        _tool("c1", "File created successfully at: /a.py\n" + PY),                               # a result: kept
        _assistant(_call("c2", "write", {"path": "b.txt", "content": E_ACUTE}, compact=True),    # PI / OpenClaw
                   _call("c3", "read", {"path": "b.txt"}, compact=True)),
        _tool("c2", "ok"), _tool("c3", E_ACUTE),
        _assistant(_call("c4", "Edit", {"file_path": "/a.py", "old_string": PY, "new_string": PY + "x"}),
                   _call("c5", "write_file", {"path": "c.md", "content": PY}, as_string=False),
                   _call("c6", "create_file", {"path": "d.md", "content": "short"})),            # shorter than its stand-in
        _tool("c4", "ok"), _tool("c5", "ok"), _tool("c6", "ok"),
        _assistant(_call("c7", "Write", {"file_path": "/e.py", "content": PY})),                 # the last turn: kept
        _tool("c7", "ok"),
    ]
    before = copy.deepcopy(messages)
    out, changed, omitted = omit_written_content(messages)
    assert messages == before                                                    # the input is never mutated
    assert (changed, omitted) == (3, 1800 + 200 + 1800)
    assert out[2]["tool_calls"][0]["function"]["arguments"] == \
        '{"file_path": "/a.py", "content": "[file content omitted: 1800 bytes, sha256 56ef53eb]"}'
    assert out[4]["tool_calls"][0]["function"]["arguments"] == \
        '{"path":"b.txt","content":"[file content omitted: 200 bytes, sha256 f42ec48e]"}'   # the client's separators
    assert out[4]["tool_calls"][1] is messages[4]["tool_calls"][1]                 # read: untouched
    assert out[7]["tool_calls"][0] is messages[7]["tool_calls"][0]                 # Edit: untouched
    assert out[7]["tool_calls"][1]["function"]["arguments"] == \
        {"path": "c.md", "content": "[file content omitted: 1800 bytes, sha256 56ef53eb]"}
    assert out[7]["tool_calls"][2] is messages[7]["tool_calls"][2]
    assert [out[i] is messages[i] for i in (0, 1, 3, 5, 6, 8, 9, 10, 11, 12)] == [True] * 10
    # the same history one turn later: the same placeholders, and the turn that was last now has one
    later = messages + [_assistant(_call("c8", "Bash", {"command": "ls"})), _tool("c8", "a.py")]
    out2, changed2, _ = omit_written_content(later)
    assert out2[:11] == out[:11] and changed2 == 4
    assert json.loads(out2[11]["tool_calls"][0]["function"]["arguments"])["content"] == placeholder(PY)


def test_arguments_it_cannot_read_and_other_tools_stay_as_sent():
    messages = [{"role": "user", "content": "x"},
                _assistant({"id": "c1", "type": "function", "function": {"name": "Write", "arguments": "{not json"}},
                           _call("c2", "Bash", {"command": "cat", "content": PY}),
                           _call("c3", "Write", {"file_path": "/a", "content": 7})),
                _tool("c1", "err"), {"role": "assistant", "content": "done"}]
    out, changed, omitted = omit_written_content(messages)
    assert (changed, omitted) == (0, 0) and out == messages


def test_a_healed_earlier_turn_is_taken_from_the_clients_calls():
    client = [{"role": "user", "content": "go"},
              _assistant(_call("c1", "Write", {"file_path": "/a.py", "content": PY}, compact=True)),
              _tool("c1", "ok"),
              _assistant(_call("c2", "Write", {"file_path": "/b.py", "content": PY}, compact=True)),
              _tool("c2", "ok")]
    raw = '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "Write", "arguments": {"file_path": "/a.py", "content": ' \
        + json.dumps(PY) + '}}\n</tool_call>'
    healed = list(client)
    healed[1] = {"role": "assistant", "content": raw}                   # what the healing store put back
    healed[3] = {"role": "assistant", "content": raw.replace("/a.py", "/b.py")}
    out, changed, _ = omit_written_content(healed, client)
    assert changed == 1
    assert out[1]["tool_calls"][0]["function"]["arguments"] == \
        '{"file_path":"/a.py","content":"[file content omitted: 1800 bytes, sha256 56ef53eb]"}'
    assert out[3] is healed[3]                                          # the last assistant turn stays healed


# --- on a tiny model ---------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "Write", "description": "Write a file", "parameters": {
    "type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["file_path", "content"]}}}]


def _file(i):
    return f"# module {i}\n" + f"def f{i}(x):\n    return x * {i}\n" * 30


def _escaped(text):
    return json.dumps(text)[1:-1]      # how a rendered tool call carries it


def _session(turns):
    """The requests of an agent writing one file per turn: request t holds the writes of turns < t."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write the modules."}]
    requests = []
    for t in range(turns):
        requests.append(list(messages))
        messages += [_assistant(_call(f"w{t}", "Write", {"file_path": f"/m{t}.py", "content": _file(t)})),
                     _tool(f"w{t}", f"File created successfully at: /m{t}.py")]
    return requests


@pytest.fixture(scope="module")
def normalizing(tiny_dense_path):
    return (build_engine(engine_settings(tiny_dense_path, normalize_write_tool_content_for_prompt=True)),
            build_engine(engine_settings(tiny_dense_path, normalize_write_tool_content_for_prompt=True,
                                         prompt_cache_max_entries_global=0)),
            build_engine(engine_settings(tiny_dense_path)))


def test_normalized_history_is_shared_token_for_token_and_hit_with_cold_parity(normalizing):
    warm, cold, plain = normalizing
    preps, outcomes, colds = [], [], []
    for t, messages in enumerate(_session(5)):
        j, _ = job(messages, tools=TOOLS, session="writer", max_tokens=6)
        preps.append(warm.prepare(j))
        outcomes.append(warm.run(job(messages, tools=TOOLS, session="writer", max_tokens=6)[0]))
        colds.append(cold.run(job(messages, tools=TOOLS, session="writer-cold", max_tokens=6)[0]))
        if t:   # every write but the last one's is a placeholder; the last one is whole
            text = preps[-1].model_text
            assert [placeholder(_file(k)) in text for k in range(t)] == [True] * (t - 1) + [False]
            assert _escaped(_file(t - 1)) in text and all(_escaped(_file(k)) not in text for k in range(t - 1))
    assert [o.raw_text for o in outcomes] == [o.raw_text for o in colds]       # parity on the normalized tokens
    tok = warm.loaded.tokenizer
    for t in range(2, 5):
        before, now = preps[t - 1], preps[t]
        # the prompts agree up to the content of the write that was the last one before (whole
        # there, a placeholder now), every earlier placeholder included, token for token
        chars = next(i for i, (a, b) in enumerate(zip(before.model_text, now.model_text)) if a != b)
        assert now.model_text.index(placeholder(_file(t - 2))) == chars
        assert all(now.model_text.index(placeholder(_file(k))) < chars for k in range(t - 2))
        shared = lcp(before.model_np, now.model_np)
        assert shared >= len(encode(tok, now.model_text[:chars])) - 2
        assert outcomes[t].cached_tokens == shared       # the hit reuses all of it
    c = warm.state.counters
    assert c.get("write_contents_omitted") == 2 * (0 + 0 + 1 + 2 + 3)         # prepare() and run() per turn
    assert c.get("write_content_bytes_omitted") == 2 * sum(len(_file(k).encode()) for t in range(5) for k in range(t - 1))
    assert c.get("exact_key_rejected_by_model_lcp") == 0
    # the same requests without the setting: every write whole, every turn
    last = plain.prepare(job(_session(5)[-1], tools=TOOLS, session="plain")[0])
    assert all(_escaped(_file(k)) in last.model_text for k in range(4))
    assert len(last.model_tokens) > len(preps[-1].model_tokens)


def test_healing_and_the_turn_store_follow_what_the_client_sent(normalizing):
    warm, _, _ = normalizing
    # two writes, both placeholders in the model input (a plain reply is the last assistant turn)
    messages = _session(3)[-1] + [{"role": "assistant", "content": "Both files are written."},
                                  {"role": "user", "content": "Think about caches."}]
    o1 = warm.run(job(list(messages), tools=TOOLS, session="heal-w", thinking=True, max_tokens=12)[0])
    assert o1.thinking_started and o1.text
    record = warm.state.turns.get("heal-w")
    assert json.loads(record[2]["tool_calls"][0]["function"]["arguments"])["content"] == _file(0)   # as sent
    assert warm.prepare(job(list(messages), tools=TOOLS)[0]).model_text.count("[file content omitted: ") == 2
    healed_before = warm.state.healing.healed
    # all of the reply was reasoning and the client strips it (content ""): it is healed back only if
    # the store's digest covered the history as sent
    messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "Now answer."}]
    o2 = warm.run(job(messages, tools=TOOLS, session="heal-w", thinking=True, max_tokens=12)[0])
    assert warm.state.healing.healed == healed_before + 1
    assert o2.cached_tokens >= o1.prompt_tokens + o1.completion_tokens - 1
    assert warm.state.turns.stable_prefix("heal-w", warm.prepare(job(messages, tools=TOOLS)[0]).record_canonical) \
        == len(messages)


def test_a_store_digest_over_the_sent_history_heals_in_the_next_turn():
    # the rule the engine keeps (finish.py remembers over prep.history_messages): heal() digests the
    # messages as sent, so a digest over the normalized ones would never match
    sent = _session(3)[-1]
    normalized, changed, _ = omit_written_content(sent)
    assert changed == 1
    store = HealingStore()
    store.remember(history_digest(normalized), "A.", [], "<think>\nx\n</think>\n\nA.")
    assert store.heal(sent + [{"role": "assistant", "content": "A."}])[-1]["content"] == "A."
    store.remember(history_digest(sent), "A.", [], "<think>\nx\n</think>\n\nA.")
    assert store.heal(sent + [{"role": "assistant", "content": "A."}])[-1]["content"] == "<think>\nx\n</think>\n\nA."
