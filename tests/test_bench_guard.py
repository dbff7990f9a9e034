"""The benchmark guard's pure logic (benchmarks/guard/verdict.py): the pass / fail rule against a
baseline, targets, identical replies, figures not run, the baseline update, the median of
per-round ratios, the tables and the docs/benchmarks.md block between its markers. No model, no timing."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.guard import verdict as g

REPO = Path(__file__).resolve().parents[1]

META = {"date": "2025-01-02", "commit": "abc1234", "machine": {"cpu": "Test CPU", "cores": 2, "ram_gib": 24.0},
        "backend": "cpu", "total_seconds": 600.0}


def base(**figures: float) -> dict:
    b = {"tolerance": 0.15, "tolerances": {}, "targets": {}, "backends": {"cpu": {"figures": dict(figures)}}}
    return b


def one(name: str, fig: dict | None, baseline: dict, backend: str = "cpu") -> g.Verdict:
    return g.judge_one(name, fig, baseline, backend)


# ----------------------------------------------------------------------------- the rule
def test_a_drop_past_the_tolerance_fails_and_says_why():
    v = one("grammar8", {"value": 0.84}, base(grammar8=1.0))
    assert v.status == "fail" and v.failed
    assert v.reasons == ["0.84× is 16% below the baseline 1.00× (tolerance 15%: floor 0.85×)"]


def test_within_the_tolerance_passes():
    assert one("grammar8", {"value": 0.85}, base(grammar8=1.0)).status == "pass"    # exactly at the floor
    assert one("grammar8", {"value": 0.9}, base(grammar8=1.0)).status == "pass"
    assert one("grammar8", {"value": 1.7}, base(grammar8=1.0)).status == "pass"     # a rise never fails


def test_per_figure_tolerance_overrides_the_default_and_a_backend_overrides_both():
    b = base(agents8_short=2.0)
    b["tolerances"] = {"agents8_short": 0.3}
    assert one("agents8_short", {"value": 1.45}, b).status == "pass"                # floor 1.40
    assert one("agents8_short", {"value": 1.35}, b).status == "fail"
    b["backends"]["cpu"]["tolerances"] = {"agents8_short": 0.1}
    assert one("agents8_short", {"value": 1.75}, b).status == "fail"                # floor 1.80
    assert g.tolerance_for(b, "cuda", "agents8_short") == 0.3
    assert g.tolerance_for(b, "cpu", "grammar8") == 0.15


def test_below_the_target_fails_even_without_a_baseline():
    b = {"targets": {"spec_copy": 2.5}, "backends": {}}
    v = one("spec_copy", {"value": 2.4, "identical": True}, b)
    assert v.status == "fail"
    assert v.reasons == ["2.40× is below the target 2.50×", "no baseline for backend 'cpu'"]
    assert one("spec_copy", {"value": 2.5, "identical": True}, b).status == "pass"


def test_below_the_target_fails_even_when_level_with_the_baseline():
    b = base(spec_loop=2.0)
    b["targets"] = {"spec_loop": 3.0}
    v = one("spec_loop", {"value": 2.0, "identical": True}, b)
    assert v.status == "fail" and v.reasons == ["2.00× is below the target 3.00×"]


def test_a_backend_can_drop_a_target_with_null():
    b = base()
    b["targets"] = {"spec_free": 0.95}
    b["backends"]["cpu"]["targets"] = {"spec_free": None}
    assert g.target_for(b, "cpu", "spec_free") is None
    assert g.target_for(b, "cuda", "spec_free") == 0.95


def test_replies_not_identical_fail_whatever_the_speed():
    v = one("spec_free", {"value": 5.0, "identical": False}, base(spec_free=1.0))
    assert v.status == "fail" and v.reasons == ["replies not identical between the two sides"]
    assert one("spec_free", {"value": 1.0, "identical": True}, base(spec_free=1.0)).status == "pass"


def test_a_figure_not_run_does_not_fail():
    v = one("spec_copy", None, {"targets": {"spec_copy": 2.5}, "backends": {"cpu": {"figures": {"spec_copy": 3.0}}}})
    assert v.status == "not run" and not v.failed and v.value is None and v.baseline == 3.0


def test_a_stage_error_or_a_missing_value_fails():
    v = one("grammar8", {"error": "RuntimeError: boom", "seconds": 3}, base(grammar8=1.0))
    assert v.status == "fail" and v.reasons == ["error: RuntimeError: boom"]
    assert one("grammar8", {"value": None}, base()).reasons == ["no value measured"]
    assert one("grammar8", {"value": float("nan")}, base()).status == "fail"


def test_judge_and_exit_code_over_every_figure():
    figures = {"grammar8": {"value": 1.0}, "spec_copy": {"value": 3.0, "identical": True}}
    b = base(grammar8=1.0, spec_copy=3.0)
    verdicts = g.judge(figures, b, "cpu")
    assert [v.name for v in verdicts] == [f.name for f in g.FIGURES]
    assert {v.name: v.status for v in verdicts if v.status != "not run"} == {"grammar8": "pass", "spec_copy": "pass"}
    assert g.exit_code(verdicts) == 0
    figures["spec_copy"]["identical"] = False
    assert g.exit_code(g.judge(figures, b, "cpu")) == 1
    assert g.exit_code(g.judge({}, b, "cpu")) == 0                                  # nothing run, nothing failed


def test_baselines_are_per_backend():
    b = {"backends": {"cpu": {"figures": {"grammar8": 1.0}}, "cuda": {"figures": {"grammar8": 2.0}}}}
    assert one("grammar8", {"value": 1.0}, b, "cpu").status == "pass"
    assert one("grammar8", {"value": 1.0}, b, "cuda").status == "fail"


# ----------------------------------------------------------------------------- the baseline update
def test_updated_baseline_keeps_tolerances_targets_other_backends_and_figures_not_run():
    old = {"tolerance": 0.2, "tolerances": {"grammar8": 0.3}, "targets": {"spec_copy": 2.5},
           "backends": {"cuda": {"figures": {"grammar8": 9.0}},
                        "cpu": {"date": "old", "figures": {"grammar8": 1.0, "spec_copy": 3.0}}}}
    figures = {"grammar8": {"value": 1.23456, "parts": {}}, "spec_copy": {"error": "x"},
               "decode_bandwidth": {"value": 0.5}}
    new = g.updated_baseline(old, "cpu", figures, META)
    assert new["tolerance"] == 0.2 and new["tolerances"] == {"grammar8": 0.3} and new["targets"] == {"spec_copy": 2.5}
    assert new["backends"]["cuda"] == {"figures": {"grammar8": 9.0}}
    cpu = new["backends"]["cpu"]
    assert cpu["figures"] == {"spec_copy": 3.0, "grammar8": 1.2346, "decode_bandwidth": 0.5}
    assert (cpu["date"], cpu["commit"], cpu["machine"]) == ("2025-01-02", "abc1234", META["machine"])
    assert old["backends"]["cpu"]["figures"] == {"grammar8": 1.0, "spec_copy": 3.0}      # not modified in place


def test_updated_baseline_from_nothing_has_the_default_tolerances_and_targets():
    new = g.updated_baseline(None, "cpu", {"spec_copy": {"value": 2.0, "identical": True}}, META)
    assert new["tolerance"] == 0.15 and new["targets"]["spec_copy"] == 2.5 and new["targets"]["spec_loop"] == 3.0
    assert new["backends"]["cpu"]["figures"] == {"spec_copy": 2.0}


# ----------------------------------------------------------------------------- helpers
def test_median_of_ratios():
    assert g.median_of_ratios([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0
    assert g.median_of_ratios([1.0, 4.0], [1.0, 2.0]) == 1.5                        # even count: the mean of the middle two
    assert g.median_of_ratios([1.0, 5.0, 3.0], [0.0, 1.0, 1.0]) == 4.0              # a zero denominator left out
    with pytest.raises(ValueError):
        g.median_of_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        g.median_of_ratios([1.0], [0.0])


def test_parse_sets_and_stages_for():
    assert g.parse_sets(["speculative=off", "SPEC_MAX_DRAFT=4", "X=a=b"]) == {"SPECULATIVE": "off",
                                                                             "SPEC_MAX_DRAFT": "4", "X": "a=b"}
    for bad in (["SPECULATIVE"], ["=off"]):
        with pytest.raises(ValueError):
            g.parse_sets(bad)
    assert g.stages_for(None) == g.STAGES
    assert g.stages_for(["spec", "agents"]) == ("agents", "spec")
    assert g.stages_for(["spec_copy", "grammar8"]) == ("spec", "grammar")
    with pytest.raises(ValueError):
        g.stages_for(["nope"])


# ----------------------------------------------------------------------------- tables and the docs block
def test_markdown_table():
    figures = {"spec_copy": {"value": 2.0, "identical": True, "what": "copy | through LiteLLM"},
               "decode_bandwidth": {"value": 0.4567}, "restart_warm_4k": {"value": 123.4}}
    b = base(spec_copy=3.0, decode_bandwidth=0.5)
    b["targets"] = {"spec_copy": 2.5}
    md = g.render_markdown(g.judge(figures, b, "cpu"), figures, META)
    lines = md.splitlines()
    assert lines[0] == ("**Bench guard, 2025-01-02**: commit `abc1234`, Test CPU, 2 cores, 24.0 GiB RAM, backend cpu; "
                        "10.0 min; 2 passed, 1 failed, 8 not run.")
    assert lines[2] == "| Figure | What | Ratio | Baseline | Target |"
    assert "| `spec_copy` | copy \\| through LiteLLM | 2.00× ✗ | 3.00× | ≥ 2.50× |" in lines
    assert "| `restart_warm_4k` | TTFT of a continuing turn at ~4k tokens: cold / after a restart (disk tier) " \
           "| 123× | - | - |" in lines
    assert any(line.startswith("| `decode_bandwidth` |") and line.endswith("| 0.46 | 0.50 | - |") for line in lines)
    assert any(line.startswith("| `grammar8` |") and "| not run |" in line for line in lines)
    assert len(lines) == 4 + len(g.FIGURES)


def test_text_table_names_each_failure():
    figures = {"spec_copy": {"value": 2.0, "identical": True, "summary": "on 20 / off 10 tok/s", "seconds": 12.3}}
    text = g.render_text(g.judge(figures, {"targets": {"spec_copy": 2.5}}, "cpu"), figures)
    assert "FAIL spec_copy: 2.00× is below the target 2.50×; no baseline for backend 'cpu'" in text.splitlines()
    assert text.splitlines()[-1] == "0 passed, 1 failed, 10 not run"
    assert "on 20 / off 10 tok/s" in text


def test_markers_replaced_exactly():
    text = "# Title\n\nbefore\n<!-- bench-guard:start -->\nold table\nold line\n<!-- bench-guard:end -->\nafter\n"
    out = g.replace_between_markers(text, "| new |\n|---|\n")
    assert out == ("# Title\n\nbefore\n<!-- bench-guard:start -->\n\n| new |\n|---|\n\n<!-- bench-guard:end -->\n"
                   "after\n")
    assert g.replace_between_markers(out, "| new |\n|---|\n") == out                  # idempotent
    empty = "<!-- bench-guard:start -->\n<!-- bench-guard:end -->"
    assert g.replace_between_markers(empty, "x") == "<!-- bench-guard:start -->\n\nx\n\n<!-- bench-guard:end -->"


@pytest.mark.parametrize("text", [
    "no markers at all\n",
    "<!-- bench-guard:start -->\nonly the start\n",
    "only the end\n<!-- bench-guard:end -->\n",
    "<!-- bench-guard:end -->\n<!-- bench-guard:start -->\n",
    "<!-- bench-guard:start -->\n<!-- bench-guard:start -->\n<!-- bench-guard:end -->\n",
])
def test_missing_or_misplaced_markers_raise(text):
    with pytest.raises(g.MarkerError):
        g.replace_between_markers(text, "table")


def test_the_docs_page_holds_one_block_the_guard_can_rewrite():
    """``bench_guard.py --docs`` writes into docs/benchmarks.md; the front page holds no block."""
    text = (REPO / g.DOCS_PAGE).read_text()
    assert text.count(g.START_MARKER) == 1 and text.count(g.END_MARKER) == 1
    block = text.split(g.START_MARKER)[1].split(g.END_MARKER)[0].strip("\n")
    assert block.startswith("**Bench guard, ") and "| Figure | What | Ratio | Baseline | Target |" in block
    assert g.replace_between_markers(text, block) == text                  # rewriting it changes nothing else
    assert g.START_MARKER not in (REPO / "README.md").read_text()


def test_the_guard_writes_the_docs_page_by_default():
    source = (REPO / "benchmarks" / "bench_guard.py").read_text()
    assert 'const=REPO / DOCS_PAGE' in source and '"--docs"' in source
