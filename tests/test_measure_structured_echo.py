"""scripts/measure_structured_echo.py's pure parts: the target, the RESULT line, which server rows
each turn made, the measure, the table, the exit code and the request-log evidence. No network,
no frameworks."""
from __future__ import annotations

import json
import sys

import pytest

from scripts import measure_structured_echo as mse


def row(rid: str, prompt: int, cached: int, reply: int, api: str = "chat", explain: str = "hit") -> dict:
    return {"request_id": rid, "api": api, "prompt_tokens": prompt, "cached_tokens": cached,
            "completion_tokens": reply, "cache_explain": explain, "cache_diagnosis": {"status": explain}}


def result(marks, **kw) -> dict:
    return {"framework": "fw", "version": "1.0", "api": "chat", "mode": "m", "marks": marks, "echo": "e", **kw}


def test_target_is_the_prompt_and_the_reply_less_two():
    assert mse.target(36, 26) == 60
    assert mse.target(1, 1) == 0


def test_parse_result_takes_the_last_result_line():
    out = "noise\nRESULT {\"a\": 1}\nmore\nRESULT {\"a\": 2}\n"
    assert mse.parse_result(out) == {"a": 2}
    assert mse.parse_result("no result here") is None
    assert mse.parse_result("RESULT {broken") is None
    assert mse.parse_result("RESULT [1]") is None


def test_slice_turns_between_marks():
    rows = [row("old", 5, 0, 1), row("a", 36, 0, 26), row("b", 70, 62, 24)]
    assert mse.slice_turns(rows, ["old", "a", "b"]) == [[rows[1]], [rows[2]]]
    # no row before turn 1: the mark is None and turn 1 starts at the first row
    assert mse.slice_turns(rows[1:], [None, "a", "b"]) == [[rows[1]], [rows[2]]]
    # a turn with a retry holds two rows
    more = [row("old", 5, 0, 1), row("r1", 36, 0, 60), row("r2", 40, 30, 26), row("t2", 70, 62, 24)]
    assert [len(t) for t in mse.slice_turns(more, ["old", "r2", "t2"])] == [2, 1]
    with pytest.raises(ValueError, match="gone"):
        mse.slice_turns(rows, ["gone", "a", "b"])


def test_measure_pass_and_miss():
    rows = [row("x", 5, 0, 1), row("a", 36, 0, 26, explain="first"), row("b", 70, 62, 24)]
    m = mse.measure(result(["x", "a", "b"]), rows)
    assert (m.t1_prompt, m.t1_reply, m.t2_prompt, m.t2_cached, m.target) == (36, 26, 70, 62, 60)
    assert m.status == "pass" and m.requests == [1, 1] and m.server_api == "chat" and m.note == ""
    assert (m.t1_request, m.t2_request, m.t2_explain) == ("a", "b", "hit")

    rows[2] = row("b", 70, 41, 24, explain="first")
    m = mse.measure(result(["x", "a", "b"]), rows)
    assert m.status == "miss" and m.t2_cached - m.target == -19


def test_measure_exactly_at_the_target_passes():
    rows = [row("a", 36, 0, 26), row("b", 70, 60, 24)]
    assert mse.measure(result([None, "a", "b"]), rows).status == "pass"
    rows[1] = row("b", 70, 59, 24)
    assert mse.measure(result([None, "a", "b"]), rows).status == "miss"


def test_measure_uses_the_last_row_of_turn_1_and_the_first_of_turn_2():
    rows = [row("r1", 36, 0, 60), row("r2", 40, 30, 26), row("t2a", 70, 64, 24), row("t2b", 99, 90, 3)]
    m = mse.measure(result([None, "r2", "t2b"]), rows)
    assert (m.t1_prompt, m.t1_reply, m.t2_cached) == (40, 26, 64)
    assert m.requests == [2, 2] and "requests per turn" in m.note and m.status == "pass"


def test_measure_skipped_error_and_lost_marks():
    m = mse.measure({"framework": "fw", "mode": "m", "skipped": "not importable: x"}, [])
    assert m.status == "skipped" and m.note == "not importable: x"
    # an error after both turns ran: numbers kept, still a failure
    rows = [row("a", 36, 0, 26), row("b", 70, 62, 24)]
    m = mse.measure(result([None, "a", "b"], error="ValueError: late"), rows)
    assert m.status == "fail" and m.t2_cached == 62 and "late" in m.note
    # an error in turn 1: no rows for turn 2
    m = mse.measure(result([None, "a"], error="TimeoutError"), rows)
    assert m.status == "fail" and m.t1_prompt is None
    m = mse.measure(result(["gone", "a", "b"]), rows)
    assert m.status == "fail" and "not among" in m.note


def test_table_rows_and_render():
    rows = [row("a", 36, 0, 26), row("b", 70, 62, 24, api="chat"), row("c", 38, 0, 27, api="chat"),
            row("d", 70, 41, 25, api="chat")]
    ok = mse.measure(result([None, "a", "b"]), rows)
    miss = mse.measure({**result(["b", "c", "d"]), "api": "responses", "mode": "n"}, rows)
    skip = mse.measure({"framework": "gone", "version": "", "api": "", "mode": "z", "skipped": "no"}, [])
    got = mse.table_rows([ok, miss, skip])
    assert got[0] == ["fw", "1.0", "chat", "m", "36", "26", "62", "60", "pass"]
    assert got[1] == ["fw", "1.0", "responses->chat", "n", "38", "27", "41", "63", "miss (-22)"]
    assert got[2] == ["gone", "", "", "z", "-", "-", "-", "-", "skipped"]
    text = mse.render_table([ok, miss, skip]).splitlines()
    assert text[0].split() == ["framework", "version", "API", "mode", "t1", "prompt", "t1", "reply", "t2", "cached",
                               "target", "result"]
    assert set(text[1]) <= {"-", " "} and len(text) == 5
    assert text[2].index("36") + 2 == text[0].index("t1 prompt") + len("t1 prompt")   # numbers right-aligned


def test_exit_code():
    ok = mse.Measure("a", "1", "chat", "m", status="pass")
    bad = mse.Measure("b", "1", "chat", "m", status="miss")
    skip = mse.Measure("c", "", "", "m", status="skipped")
    assert mse.exit_code([ok, skip]) == 0
    assert mse.exit_code([ok, bad, skip]) == 1
    assert mse.exit_code([skip]) == 2 and mse.exit_code([]) == 2


def test_find_records_and_evidence(tmp_path):
    day = tmp_path / "2026-12-02"
    day.mkdir()
    prompt = "<|im_start|>user\nDescribe.<|im_end|>\n<|im_start|>assistant\n"
    t1 = {"request_id": "a", "model_text": prompt, "model_tokens": [1, 2, 3],
          "output": {"text_head": '{"name": "Ada", "age": 36}'}}
    t2 = {"request_id": "b", "model_text": prompt + '{"name":"Ada","age":36}<|im_end|>\n', "model_tokens": [1, 2, 3, 9]}
    (day / "cache-session-x.log").write_text("not json\n" + json.dumps(t1) + "\n" + json.dumps(t2) + "\n[1]\n")
    (day / "cache-session-y.log").write_text(json.dumps({"request_id": "other"}) + "\n")
    recs = mse.find_records(tmp_path, {"a", "b"})
    assert sorted(recs) == ["a", "b"]
    assert mse.find_records(tmp_path / "missing", {"a"}) == {}
    ev = mse.evidence(recs["a"], recs["b"])
    assert ev["t1_prompt_is_prefix_of_t2"] and ev["common_prompt_tokens"] == 3
    assert ev["reply_echo_parts_at_char"] == len('{"name":')
    assert ev["reply_at"].startswith(' "Ada"') and ev["echo_at"].startswith('"Ada",')
    # a turn 2 that does not even start with turn 1's prompt
    ev = mse.evidence(recs["a"], {"model_text": "<|im_start|>system\nX", "model_tokens": [7]})
    assert not ev["t1_prompt_is_prefix_of_t2"] and ev["prompts_part_at_char"] == len("<|im_start|>")
    assert ev["common_prompt_tokens"] == 0


def test_every_case_has_its_child_script():
    for script, modes in mse.CASES:
        assert (mse.CHILDREN / script).is_file() and modes


def test_child_command():
    import argparse

    conn = {"proxy": "http://p", "key": "k", "model": "M", "mlx": "http://m", "mlx_key": ""}
    args = argparse.Namespace(framework_python="/fw/python", node="node", node_dir="", max_tokens=60)
    cmd = mse.child_command("fw_langchain.py", "json_schema", args, conn)
    assert cmd[:2] == ["/fw/python", str(mse.CHILDREN / "fw_langchain.py")]
    assert cmd[cmd.index("--mode") + 1] == "json_schema" and cmd[cmd.index("--max-tokens") + 1] == "60"
    assert "(langchain json_schema)" in cmd[cmd.index("--system") + 1]     # each case its own conversation
    args.node = sys.executable                                              # any binary on PATH or by path
    assert "--node-dir" in mse.child_command("fw_vercel_ai.mjs", "x", args, conn)     # a reason to skip
    args.node_dir = "/some/dir"
    cmd = mse.child_command("fw_vercel_ai.mjs", "x", args, conn)
    assert cmd[0] == sys.executable and cmd[-2:] == ["--node-dir", "/some/dir"]
    args.node = "no-such-node-binary"
    assert mse.child_command("fw_vercel_ai.mjs", "x", args, conn) == "node not found"
