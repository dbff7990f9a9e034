"""scripts/compare_parsers.py, the parity harness behind .context/notes/parsers.md: our harmony,
tool-call and reasoning parsers against openai-harmony and mlx-lm's tool_parsers.

Ours must meet every expectation the harness writes down. The library checks record why ours is
kept (parsing/harmony.py's docstring, the notes): if one starts failing, a library may now do the
job -- re-run the script and revisit the decision rather than editing the expectation.

Run: python -m mlxstack.launcher.test_runner tests/test_compare_parsers.py -q
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_parsers.py"


@pytest.fixture(scope="module")
def cp():
    spec = importlib.util.spec_from_file_location("compare_parsers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool_rows(cp):
    return cp.compare_tool_calls()


@pytest.fixture(scope="module")
def harmony_rows(cp, embedded_model_path):
    pytest.importorskip("openai_harmony", reason="openai-harmony is not installed (requirements.txt)")
    pytest.importorskip("quicktok", reason="quicktok-v1 provides openai-harmony's o200k vocab offline")
    cases = {**cp.harmony_test_cases(), **cp.REALISTIC_HARMONY}
    rows, _ = cp.compare_harmony(cases, tokenizer_dir=embedded_model_path)
    return {r["case"]: r for r in rows}


def test_harness_reads_every_harmony_text_of_the_tests(cp):
    from tests.test_harmony import (
        CALL_AFTER_CHANNEL,
        CALL_IN_HEADER,
        REASON_THEN_ANSWER,
    )

    cases = cp.harmony_test_cases()
    assert len(cases) >= 35
    assert {REASON_THEN_ANSWER, CALL_AFTER_CHANNEL, CALL_IN_HEADER} <= set(cases.values())
    assert "<|channel|>final<|message|>Hi<|return|>" in cases.values()  # a stop test's token list, joined
    assert not [t for t in cases.values() if t.startswith("assistant<|channel|>")]  # asserted headers are not inputs


def test_our_tool_call_and_reasoning_parsers_meet_every_expectation(tool_rows):
    rows, reasoning = tool_rows
    failed = [(r["case"], r.get("parser")) for r in rows + reasoning if not (r["ours"] and r["ours_stream"])]
    assert not failed


def test_mlx_lm_tool_parsers_fall_short_where_the_notes_say(tool_rows):
    rows, reasoning = tool_rows
    by = {(r["case"], r["parser"]): r for r in rows}
    assert by[("all_formats/json", "json_tools")]["mlx_lm"]            # the plain case works...
    assert "KeyError" in by[("no_argument_call/json", "json_tools")]["mlx_lm_got"]  # ...a call without arguments crashes
    assert not by[("malformed:0", "json_tools")]["mlx_lm"]              # a malformed call vanishes from the reply
    assert "'not'" in by[("malformed:0", "glm47")]["mlx_lm_got"]        # or glm47 invents a call "not"
    assert not by[("missing_final_close/xml", "qwen3_coder")]["mlx_lm"]  # a call cut before </function> is lost
    assert not by[("schema_typing_falls_back_to_string", "qwen3_coder")]["mlx_lm"]  # "many" for an integer drops it
    assert sum(r["mlx_lm"] for r in rows) < len(rows) // 2
    assert not {r["case"]: r for r in reasoning}["stray_close_never_leaks"]["mlx_lm"]


def test_openai_harmony_falls_short_where_the_docstring_says(harmony_rows):
    rows = harmony_rows
    assert rows["REASON_THEN_ANSWER"]["split"] and rows["CALL_IN_HEADER"]["split"]  # recorded shapes: parity
    assert not any(r.get("stream_fixture_ids", False) for r in rows.values())       # not our tokenizer's ids
    by_text = {r["text"]: r for r in rows.values()}
    assert by_text["<|channel|>analy"]["split_got"].startswith("HarmonyError")      # a cut inside a header
    assert rows["no_markup_at_all"]["split_got"].startswith("HarmonyError")
    assert "R<|channel|>final<|message|>A" in rows["skips_end_start"]["split_got"]  # the answer leaks into reasoning
    assert not rows["final_ended_by_end"]["stop_actions"]                          # no stop at a final's <|end|>
    assert not rows["REASON_THEN_ANSWER"]["stop_all"]                              # stop_tokens() stops at <|end|>
