"""Imports point down only: every import of every module in mlxstack/ against the layer table in
docs/architecture.md#layers (which this test keeps honest)."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mlxstack"

ARCHITECTURE = PKG.parent / "docs" / "architecture.md"


def layer_table(text: str) -> dict[str, set[str]]:
    """docs/architecture.md#layers as {layer: layers it may import}: each row's first cell names the
    layer (`name/`), its last the layers, comma-separated; a parenthesis qualifies an entry ("cache
    (summary digests only)") and "—" is none."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        match = re.match(r"\| `([a-z_]+)/` \|", line)
        if not match:
            continue
        last = line.rstrip().rstrip("|").rsplit(" | ", 1)[1].strip()
        flat = re.sub(r"\([^()]*\)", "", last)             # qualifications, one level deep
        table[match.group(1)] = set() if flat.strip() in ("—", "-") else \
            {part.strip().split()[0].strip("`").rstrip("/") for part in flat.split(",") if part.strip()}
    return table


ALLOWED = layer_table(ARCHITECTURE.read_text())


def test_the_layer_table_is_the_documented_one():
    sample = ("## Layers\n\n| layer | what | may import |\n|---|---|---|\n"
              "| `top/` | x, y | mid (`a/` only), low |\n| `mid/` | z (a, b) | low (digests, ids) |\n"
              "| `low/` | pure | — |\n\n## Next\n| `other/` | no | top |\n")
    assert layer_table(sample) == {"top": {"mid", "low"}, "mid": {"low"}, "low": set()}
    assert (ALLOWED["routing"], ALLOWED["scheduler"], ALLOWED["parsing"]) == \
        ({"prompt", "cache", "parsing", "config"}, {"cache"}, set())
    assert ALLOWED["residency"] == {"launcher", "server", "models", "config", "system"}


def imported_layers(path: Path) -> set[str]:
    """Other mlxstack layers (top-level sub-packages) a module imports, absolute (``mlxstack.x``)
    or relative at any depth (``..x`` from ``cache/``, ``...x`` from ``cache/disk/``)."""
    tree = ast.parse(path.read_text())
    package = path.relative_to(PKG).parent.parts          # e.g. ("cache", "disk")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.startswith("mlxstack."):
                out.add(node.module.split(".")[1])
            elif node.level > 0:
                base = package[:len(package) - (node.level - 1)] if node.level - 1 <= len(package) else ()
                target = (*base, *(node.module.split(".") if node.module else ()))
                if target:
                    out.add(target[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mlxstack."):
                    out.add(alias.name.split(".")[1])
    out.discard(package[0] if package else "")
    return out


def test_imported_layers_resolves_relative_imports_at_any_depth(tmp_path, monkeypatch):
    mod = tmp_path / "cache" / "disk" / "m.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("from . import x\nfrom .y import z\nfrom ..kv_ops import a\nfrom ...config import faults\n"
                   "from ...system.secrets import b\nimport mlxstack.models.loader\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path)
    assert imported_layers(mod) == {"config", "system", "models"}


MODULES = sorted(p for p in PKG.glob("*/**/*.py") if p.parent != PKG)


def test_every_package_is_in_the_table():
    packages = {p.relative_to(PKG).parts[0] for p in MODULES}
    assert packages == set(ALLOWED), packages ^ set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down(path):
    layer = path.relative_to(PKG).parts[0]
    wrong = imported_layers(path) - ALLOWED[layer] - {layer}
    assert not wrong, f"{path.relative_to(PKG)} ({layer}) imports {sorted(wrong)} (see docs/architecture.md#layers)"


@pytest.mark.parametrize("name", ["prompt", "parsing"])
def test_pure_layers_import_no_mlx_and_no_network(name):
    for path in (PKG / name).glob("*.py"):
        tree = ast.parse(path.read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert not mods & {"mlx", "mlx_lm", "mlx_vlm", "urllib", "socket", "http", "requests"}, (path.name, mods)


def imported_modules(path: Path) -> set[str]:
    """Every mlxstack module a module imports, as a dotted name under ``mlxstack`` (``backends.cpu.kernels``),
    absolute or relative at any depth, anywhere in the file (inside functions too); ``from X import Y``
    also counts ``X.Y`` (Y may be a module), and a string naming an ``mlxstack.`` module (``import_module``)."""
    tree = ast.parse(path.read_text())
    package = path.relative_to(PKG).parent.parts
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module and (node.module + ".").startswith("mlxstack.")):
                    continue
                base = tuple(node.module.split(".")[1:])
            else:
                if node.level - 1 > len(package):
                    continue
                base = (*package[:len(package) - (node.level - 1)], *(node.module.split(".") if node.module else ()))
            if base:
                out.add(".".join(base))
            out |= {".".join((*base, alias.name)) for alias in node.names}
        elif isinstance(node, ast.Import):
            out |= {alias.name.split(".", 1)[1] for alias in node.names if alias.name.startswith("mlxstack.")}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("mlxstack."):
            out.add(node.value.split(".", 1)[1])
    return out


def test_imported_modules_sees_every_form(tmp_path, monkeypatch):
    mod = tmp_path / "engine" / "sub" / "m.py"
    mod.parent.mkdir(parents=True)
    mod.write_text("from ...backends import cpu\n"
                   "def f():\n    from ...backends.cpu.backend import CpuBackend\n"
                   "    import mlxstack.backends.cpu.kernels\n"
                   "    return __import__('importlib').import_module('mlxstack.backends.cpu')\n"
                   "from .. import backends\nfrom ..factory import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", tmp_path)
    assert imported_modules(mod) == {"backends", "backends.cpu", "backends.cpu.backend", "backends.cpu.backend.CpuBackend",
                                     "backends.cpu.kernels", "engine", "engine.backends", "engine.factory",
                                     "engine.factory.x"}


SCHEDULING = sorted(p for name in ("engine", "scheduler") for p in (PKG / name).glob("**/*.py"))


@pytest.mark.parametrize("path", SCHEDULING, ids=lambda p: str(p.relative_to(PKG)))
def test_the_engine_and_the_scheduler_never_import_the_cpu_backend(path):
    """The engine chooses a backend only through ``select`` (backends/__init__.py) (engine/factory.py);
    what the CPU backend is stays inside backends/cpu."""
    wrong = sorted(m for m in imported_modules(path) if m == "backends.cpu" or m.startswith("backends.cpu."))
    assert not wrong, f"{path.relative_to(PKG)} imports {wrong}: select the CPU backend through mlxstack.backends"


OUTSIDE_CACHE = sorted(p for p in PKG.glob("**/*.py") if p.relative_to(PKG).parts[0] != "cache")


@pytest.mark.parametrize("path", OUTSIDE_CACHE, ids=lambda p: str(p.relative_to(PKG)))
def test_the_cache_index_is_touched_only_inside_cache(path):
    """The KV manager (cache/manager.py) holds the index and answers lookups as data (``Lookup`` ->
    ``Found``): no module outside cache/ imports cache/prompt_cache.py, names ``PromptCache`` or
    reads an index through an attribute (``.prompt_cache``, ``kv.index``)."""
    wrong = sorted(m for m in imported_modules(path) if m == "cache.prompt_cache" or m.startswith("cache.prompt_cache."))
    assert not wrong, f"{path.relative_to(PKG)} imports {wrong}: ask cache/manager.py KVManager"
    text = path.read_text()
    named = [n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name) and n.id == "PromptCache"]
    attrs = [f"{ast.unparse(n)}" for n in ast.walk(ast.parse(text))
             if isinstance(n, ast.Attribute) and (n.attr == "prompt_cache" or (n.attr == "index" and
                                                  isinstance(n.value, ast.Attribute) and n.value.attr == "kv"))]
    assert not named and not attrs, f"{path.relative_to(PKG)} reaches the index: {named + attrs}"


def test_the_index_check_sees_an_attribute_read(tmp_path):
    """The check above can fail: an engine-side read of the index through the KV manager is caught."""
    src = "def f(state):\n    return state.kv.index.held(), state.prompt_cache\n"
    tree = ast.parse(src)
    attrs = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and
             (n.attr == "prompt_cache" or (n.attr == "index" and isinstance(n.value, ast.Attribute) and n.value.attr == "kv"))]
    assert sorted(attrs) == ["state.kv.index", "state.prompt_cache"]
