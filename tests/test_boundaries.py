"""The serving parts keep to their places: no import circle anywhere in mlxstack/ (imports inside
functions count), and a model's forward runs only through the runner's one door
(runner/forward.py) -- checked on real traffic, not by reading the code."""
from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mlxstack"


def _module(path: Path, pkg: Path) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of import nodes under ``if TYPE_CHECKING:`` (never executed)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            out |= {id(n) for b in node.body for n in ast.walk(b)}
    return out


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module -> the mlxstack modules it imports, at module level or inside functions."""
    paths = {_module(p, pkg): p for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + (node.module.split(".") if node.module else []))
                if target in paths:
                    edges.add(target)
                edges |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in paths}
            elif isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in paths}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_sees_a_circle_through_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / "mlxstack"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("from .y import f\n")
    (pkg / "a" / "y.py").write_text("def f():\n    from . import x\n")
    (pkg / "a" / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import f\n")
    graph = import_graph(pkg)
    assert graph["mlxstack.a.x"] == {"mlxstack.a.y"} and graph["mlxstack.a.z"] == set()
    assert cycles(graph) == [["mlxstack.a.x", "mlxstack.a.y"]]


def test_no_import_cycle_in_mlxstack():
    assert cycles(import_graph()) == []


# ---------------------------------------------------------------- the model runs only in runner/

LOWER = ("mlxstack.runner.", "mlxstack.cache.", "mlxstack.scheduler.")


def _forward_callers(run, back: dict[tuple[str, str], int] | None = None) -> dict[str, int]:
    """Run ``run()`` and count, by calling module, every call of an mlx-lm / mlx-vlm model's own
    ``__call__`` (the outer Model class: what a server forward is). With ``back``, also count there
    every call of a function of engine/ made from a frame of runner/, cache/ or scheduler/ -- a
    callback climbing up the layers (the parts hand each other data: no such call is allowed)."""
    seen: dict[str, int] = {}

    def profile(frame, event, _arg):
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "")
        if back is not None and name.startswith("mlxstack.engine.") and frame.f_back is not None:
            caller = frame.f_back.f_globals.get("__name__", "")
            if caller.startswith(LOWER):
                key = (caller, f"{name}.{frame.f_code.co_qualname}")
                back[key] = back.get(key, 0) + 1
        if frame.f_code.co_name != "__call__":
            return
        if not frame.f_code.co_qualname.startswith(("Model.", "LanguageModel.", "VisionModel.")):
            return
        if not name.startswith(("mlx_lm.models.", "mlx_vlm.models.")):
            return
        caller = frame.f_back.f_globals.get("__name__", "?") if frame.f_back else "?"
        seen[caller] = seen.get(caller, 0) + 1

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def test_the_callback_finder_sees_a_call_climbing_into_the_engine():
    """The check below can fail: a function of engine/ handed to cache/ and called there is seen."""
    from mlxstack.cache.sessions import SessionTurnStore
    from mlxstack.engine.worker import InferenceWorker

    worker = InferenceWorker(max_queued=1)
    store = SessionTurnStore(clock=worker.beat)       # an engine function as the cache's clock
    back: dict[tuple[str, str], int] = {}
    _forward_callers(store._expire, back)
    assert back == {("mlxstack.cache.sessions", "mlxstack.engine.worker.InferenceWorker.beat"): 1}, back


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "hybrid", "dense_hd64"])
def test_a_model_forward_runs_only_through_the_runner_on_mixed_agent_traffic(kind, tiny_kind_paths, tmp_path):
    """Fan-outs, retries, hang-ups, grammars, speculation, spills, restarts and preemption (the
    fuzzer's machine), and each request's cold reference served alone: every forward of the model
    came through runner/forward.py -- not the engine, the scheduler or a test helper; and nothing in
    runner/, cache/ or scheduler/ called back into engine/ (data between the parts)."""
    from tests.fuzz.harness import Config, Totals
    from tests.fuzz.machine import run_machine

    config = {"dense": Config("dense", budget_tokens=120, disk=True),
              "hybrid": Config("hybrid", disk=True),
              "dense_hd64": Config("dense_hd64", kv_bits=4, quant_start=8)}[kind]
    totals = Totals()
    back: dict[tuple[str, str], int] = {}
    callers = _forward_callers(lambda: run_machine(config, tiny_kind_paths(kind), tmp_path, seed=4242, examples=2,
                                                   steps=8, totals=totals, shrink=False), back)
    assert totals.requests >= 6, totals.line()
    assert back == {}, back
    assert set(callers) == {"mlxstack.runner.forward"}, callers
    assert callers["mlxstack.runner.forward"] >= totals.requests


@pytest.mark.slow
def test_a_vision_language_models_forwards_run_only_in_the_runner(tiny_vlm_path):
    """An image turn, then text-only turns that reuse it: the language model (prefill with the
    image's embeddings, decode steps) and the vision tower are called from runner/ alone."""
    from tests.conftest import build_engine, engine_settings
    from tests.test_vlm import SYSTEM, image_url, job, user

    engine = build_engine(engine_settings(tiny_vlm_path, healing_store=False))

    def turns() -> None:
        messages = [SYSTEM, user("Describe it.", image_url(0), style="input_image")]
        for text in ("Tell me more.", "And one more thing?"):
            out = engine.run(job(messages, 6))
            messages = messages + [{"role": "assistant", "content": out.raw_text}, {"role": "user", "content": text}]

    back: dict[tuple[str, str], int] = {}
    callers = _forward_callers(turns, back)
    assert back == {}, back                                    # runner/vlm.py, cache/: no call back into engine/
    assert callers and all(c.startswith("mlxstack.runner.") for c in callers), callers
    assert callers.get("mlxstack.runner.vlm", 0) >= 2 + 6       # two prefills, their decode steps
