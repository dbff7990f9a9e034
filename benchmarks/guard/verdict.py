"""The benchmark guard's pure logic: which figures there are, the committed baseline's format,
the pass / fail rule, the median of per-round ratios, the text and markdown tables and the
block between its markers in docs/benchmarks.md. No MLX import, no timing (tests/test_bench_guard.py).

A run's figure (what benchmarks/bench_guard.py measures) is a dict::

    {"value": 1.52,                       # the ratio (a fraction for decode_bandwidth)
     "parts": {"ours_tok_s": 96.5, ...},  # what it came from
     "summary": "ours 96.5 / mlx_lm 54.8 turn tok/s",
     "seconds": 123.4,                    # what measuring it took
     "identical": True,                   # where replies are compared (speculation, warm turns)
     "error": "...",                      # when its stage failed: the figure fails
     "what": "..."}                       # optional: overrides the figure's description

The baseline file (benchmarks/baseline.json)::

    {"tolerance": 0.15,                   # default relative tolerance
     "tolerances": {"agents8_long": 0.25},# per-figure overrides
     "targets": {"spec_copy": 2.5},       # absolute floors (null: none)
     "backends": {"cpu": {"date": ..., "commit": ..., "machine": {...},
                          "figures": {"agents8_short": 1.52, ...},
                          "tolerances": {...}, "targets": {...}}}}   # optional per-backend overrides

A figure fails when it was run and: its stage failed, its replies were not identical, it is below
its target, or it is below baseline * (1 - tolerance). A figure not run never fails.
"""
from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

STAGES = ("agents", "warm", "spec", "grammar", "bandwidth", "priority")
DOCS_PAGE = "docs/benchmarks.md"      # the page whose marked block --docs rewrites (relative to the repo)
START_MARKER = "<!-- bench-guard:start -->"
END_MARKER = "<!-- bench-guard:end -->"


@dataclass(frozen=True)
class Figure:
    name: str
    stage: str
    what: str
    unit: str = "x"     # "x": a ratio of two speeds / times; "": a fraction


FIGURES: tuple[Figure, ...] = (
    Figure("agents8_short", "agents", "8 agent sessions, ~340-token system prompt: turn tok/s, ours / mlx_lm.server"),
    Figure("agents8_long", "agents", "8 agent sessions, ~2k-token shared prompt: turn tok/s, ours / mlx_lm.server"),
    Figure("restart_warm_4k", "warm", "TTFT of a continuing turn at ~4k tokens: cold / after a restart (disk tier)"),
    Figure("ram_warm_4k", "warm", "TTFT of a continuing turn at ~4k tokens: cold / warm in RAM"),
    Figure("spec_copy", "spec", "decode tok/s, speculation on / off: a 12-line checklist written again"),
    Figure("spec_loop", "spec", "decode tok/s, speculation on / off: 'hello' 50 times"),
    Figure("spec_free", "spec", "decode tok/s, speculation on / off: a short story"),
    Figure("spec_mixed8", "spec", "decode tok/s, speculation on / off: 8 sessions, 4 copy + 4 free"),
    Figure("grammar8", "grammar", "decode tok/s of 8 rows, JSON schema / no grammar"),
    Figure("decode_bandwidth", "bandwidth",
           "single-stream decode tok/s x weight bytes per token / measured memory read bandwidth", ""),
    Figure("priority8", "priority", "TTFT of the user's question, alone / behind 8 decoding sub-agents"),
)
BY_NAME: dict[str, Figure] = {f.name: f for f in FIGURES}

DEFAULT_TOLERANCE = 0.15
# Figures that move more than the default from run to run on 2 shared cores.
DEFAULT_TOLERANCES: dict[str, float] = {"agents8_short": 0.25, "agents8_long": 0.25,
                                        "restart_warm_4k": 0.35, "ram_warm_4k": 0.35, "priority8": 0.35}
DEFAULT_TARGETS: dict[str, float] = {"spec_copy": 2.5, "spec_loop": 3.0, "spec_free": 0.95, "spec_mixed8": 1.3,
                                     "agents8_short": 1.0, "agents8_long": 1.0,
                                     "priority8": 0.67}   # TTFT behind 8 sub-agents <= 1.5x alone


# ----------------------------------------------------------------------------- small helpers
def median_of_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median of the per-round ratios a / b (rounds where b is not a positive finite number
    are left out). ValueError when the lists differ in length or no round is left."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators vs {len(denominators)} denominators")
    ratios = [a / b for a, b in zip(numerators, denominators)
              if isinstance(b, (int, float)) and math.isfinite(b) and b > 0 and math.isfinite(a)]
    if not ratios:
        raise ValueError("no round with a usable ratio")
    return statistics.median(ratios)


def parse_sets(items: Iterable[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` items -> {KEY: VALUE} (keys upper-cased; the last one wins)."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().upper()
        if not sep or not key:
            raise ValueError(f"--set wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def stages_for(names: Iterable[str] | None) -> tuple[str, ...]:
    """The stages ``--only`` names (stage names, or figure names standing for their stage), in
    running order; all of them for None or nothing."""
    names = list(names or [])
    if not names:
        return STAGES
    wanted = set()
    for n in names:
        if n in STAGES:
            wanted.add(n)
        elif n in BY_NAME:
            wanted.add(BY_NAME[n].stage)
        else:
            raise ValueError(f"unknown stage or figure {n!r} (stages: {', '.join(STAGES)})")
    return tuple(s for s in STAGES if s in wanted)


def fmt_value(name: str, value: float | None) -> str:
    if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    unit = "×" if BY_NAME.get(name, Figure(name, "", "")).unit == "x" else ""
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.{digits}f}{unit}"


# ----------------------------------------------------------------------------- the baseline
def skeleton_baseline() -> dict[str, Any]:
    return {"about": "bench_guard.py's baseline: per backend the figures of one full run (ratios measured "
                     "within that run); a figure fails below value * (1 - tolerance) or below its target",
            "tolerance": DEFAULT_TOLERANCE, "tolerances": dict(DEFAULT_TOLERANCES), "targets": dict(DEFAULT_TARGETS),
            "backends": {}}


def _backend(baseline: Mapping[str, Any], backend: str) -> Mapping[str, Any]:
    return (baseline.get("backends") or {}).get(backend) or {}


def tolerance_for(baseline: Mapping[str, Any], backend: str, name: str) -> float:
    for table in ((_backend(baseline, backend).get("tolerances") or {}), (baseline.get("tolerances") or {})):
        if name in table and table[name] is not None:
            return float(table[name])
    return float(baseline.get("tolerance", DEFAULT_TOLERANCE))


def target_for(baseline: Mapping[str, Any], backend: str, name: str) -> float | None:
    """The figure's floor: the backend's own ``targets`` first, then the top-level ones; an explicit
    null means none."""
    for table in ((_backend(baseline, backend).get("targets") or {}), (baseline.get("targets") or {})):
        if name in table:
            return None if table[name] is None else float(table[name])
    return None


def baseline_value(baseline: Mapping[str, Any], backend: str, name: str) -> float | None:
    v = (_backend(baseline, backend).get("figures") or {}).get(name)
    return float(v) if isinstance(v, (int, float)) else None


def usable(fig: Mapping[str, Any]) -> bool:
    v = fig.get("value")
    return not fig.get("error") and isinstance(v, (int, float)) and math.isfinite(v)


def updated_baseline(baseline: Mapping[str, Any] | None, backend: str, figures: Mapping[str, Mapping[str, Any]],
                     meta: Mapping[str, Any]) -> dict[str, Any]:
    """``baseline`` with this run's figures as ``backend``'s values (figures this run did not
    measure keep their old value); tolerances, targets and other backends kept. ``meta``: date,
    commit, machine."""
    out = copy.deepcopy(dict(baseline)) if baseline else skeleton_baseline()
    backends = out.setdefault("backends", {})
    old = dict(backends.get(backend) or {})
    values = dict(old.get("figures") or {})
    for name in BY_NAME:
        fig = figures.get(name)
        if fig is not None and usable(fig):
            values[name] = round(float(fig["value"]), 4)
    entry = {**old, "date": meta.get("date"), "commit": meta.get("commit"), "machine": meta.get("machine"),
             "figures": {n: values[n] for n in BY_NAME if n in values}}
    backends[backend] = entry
    return out


# ----------------------------------------------------------------------------- the verdict
@dataclass
class Verdict:
    name: str
    status: str                          # "pass" | "fail" | "not run"
    value: float | None = None
    baseline: float | None = None
    tolerance: float | None = None
    target: float | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status == "fail"


def judge_one(name: str, fig: Mapping[str, Any] | None, baseline: Mapping[str, Any], backend: str) -> Verdict:
    base = baseline_value(baseline, backend, name)
    tol = tolerance_for(baseline, backend, name)
    target = target_for(baseline, backend, name)
    v = Verdict(name, "not run", None, base, tol, target)
    if fig is None:
        return v
    v.status = "pass"
    if fig.get("error"):
        v.status = "fail"
        v.reasons.append(f"error: {fig['error']}")
        return v
    if not usable(fig):
        v.status = "fail"
        v.reasons.append("no value measured")
        return v
    v.value = float(fig["value"])
    if fig.get("identical") is False:
        v.status = "fail"
        v.reasons.append("replies not identical between the two sides")
    if target is not None and v.value < target:
        v.status = "fail"
        v.reasons.append(f"{fmt_value(name, v.value)} is below the target {fmt_value(name, target)}")
    if base is not None:
        floor = base * (1 - tol)
        if v.value < floor:
            v.status = "fail"
            v.reasons.append(f"{fmt_value(name, v.value)} is {1 - v.value / base:.0%} below the baseline "
                             f"{fmt_value(name, base)} (tolerance {tol:.0%}: floor {fmt_value(name, floor)})")
    else:
        v.reasons.append(f"no baseline for backend {backend!r}")
    return v


def judge(figures: Mapping[str, Mapping[str, Any]], baseline: Mapping[str, Any], backend: str) -> list[Verdict]:
    """One verdict per known figure, in the table's order."""
    return [judge_one(f.name, figures.get(f.name), baseline or {}, backend) for f in FIGURES]


def exit_code(verdicts: Sequence[Verdict]) -> int:
    return 1 if any(v.failed for v in verdicts) else 0


def summary_line(verdicts: Sequence[Verdict]) -> str:
    n = {s: sum(v.status == s for v in verdicts) for s in ("pass", "fail", "not run")}
    text = f"{n['pass']} passed, {n['fail']} failed"
    return text + (f", {n['not run']} not run" if n["not run"] else "")


# ----------------------------------------------------------------------------- tables
def render_text(verdicts: Sequence[Verdict], figures: Mapping[str, Mapping[str, Any]]) -> str:
    rows = [("figure", "value", "baseline", "target", "tol", "verdict", "s", "from")]
    for v in verdicts:
        fig = figures.get(v.name) or {}
        secs = fig.get("seconds")
        rows.append((v.name, fmt_value(v.name, v.value) if v.status != "not run" else "-",
                     fmt_value(v.name, v.baseline), fmt_value(v.name, v.target),
                     f"{v.tolerance:.0%}" if v.tolerance is not None else "-",
                     v.status.upper() if v.failed else v.status,
                     f"{secs:.0f}" if isinstance(secs, (int, float)) else "-", str(fig.get("summary", ""))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    for v in verdicts:
        if v.failed:
            lines.append(f"FAIL {v.name}: " + "; ".join(v.reasons))
    lines.append(summary_line(verdicts))
    return "\n".join(line.rstrip() for line in lines)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(verdicts: Sequence[Verdict], figures: Mapping[str, Mapping[str, Any]],
                    meta: Mapping[str, Any]) -> str:
    """One dated table: date, commit, machine and backend above it; Figure / What / Ratio /
    Baseline / Target. ``meta``: date, commit, machine {cpu, cores, ram_gib}, backend,
    total_seconds (optional)."""
    m = meta.get("machine") or {}
    took = meta.get("total_seconds")
    head = (f"**Bench guard, {meta.get('date', '?')}**: commit `{meta.get('commit', '?')}`, "
            f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores, {m.get('ram_gib', '?')} GiB RAM, "
            f"backend {meta.get('backend', '?')}"
            + (f"; {took / 60:.1f} min" if isinstance(took, (int, float)) else "")
            + f"; {summary_line(verdicts)}.")
    lines = [head, "", "| Figure | What | Ratio | Baseline | Target |", "|---|---|---|---|---|"]
    for v in verdicts:
        fig = figures.get(v.name) or {}
        what = fig.get("what") or BY_NAME[v.name].what
        if v.status == "not run":
            ratio = "not run"
        else:
            ratio = fmt_value(v.name, v.value) + (" ✗" if v.failed else "")
        target = f"≥ {fmt_value(v.name, v.target)}" if v.target is not None else "-"
        lines.append(f"| `{v.name}` | {_cell(what)} | {_cell(ratio)} | {fmt_value(v.name, v.baseline)} | {target} |")
    return "\n".join(lines)


class MarkerError(ValueError):
    pass


def replace_between_markers(text: str, block: str, start: str = START_MARKER, end: str = END_MARKER) -> str:
    """``text`` with the lines between the line ``start`` and the line ``end`` replaced by
    ``block`` (a blank line either side of it); the marker lines stay. MarkerError when either is
    missing, appears twice, or they are in the wrong order."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == start]
    ends = [i for i, line in enumerate(lines) if line.strip() == end]
    if len(starts) != 1 or len(ends) != 1:
        raise MarkerError(f"want exactly one {start!r} line and one {end!r} line; found {len(starts)} and {len(ends)}")
    s, e = starts[0], ends[0]
    if e < s:
        raise MarkerError(f"{end!r} comes before {start!r}")
    head = "".join(lines[: s + 1])
    if not head.endswith("\n"):
        head += "\n"
    return head + "\n" + block.strip("\n") + "\n\n" + "".join(lines[e:])
