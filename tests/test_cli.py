"""The ``mlxstack`` command (mlxstack/cli.py) and pyproject.toml: the help of the command and of a
subcommand, the dispatch to the existing entry points, the test runner's fast tier, and the
project's dependencies equal to requirements.txt. Subprocesses of a few seconds; no model."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mlxstack import cli
from mlxstack.launcher import test_runner

REPO = Path(__file__).resolve().parents[1]
PYTHON = REPO / ".venv" / "bin" / "python"


def run(*args: str) -> subprocess.CompletedProcess:
    python = str(PYTHON if PYTHON.exists() else sys.executable)
    return subprocess.run([python, "-m", "mlxstack.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_help_lists_every_subcommand():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for name in ("serve", "test", "bench", "env-example", "mlx-server", "build-native", "launch"):
        assert re.search(rf"^  {re.escape(name)}\s", out.stdout, re.M), name


def test_a_subcommands_help_is_its_entry_points_help():
    out = run("bench", "--help")
    assert out.returncode == 0, out.stderr
    assert "Benchmark guard" in out.stdout and "--docs" in out.stdout and "--only" in out.stdout
    out = run("env-example", "--help")
    assert out.returncode == 0 and "docs/configuration.md" in out.stdout


def test_launch_names_its_clients_and_refuses_another():
    out = run("launch", "--help")
    assert out.returncode == 0, out.stderr
    assert "{claude,codex,opencode,openclaw,pi}" in out.stdout and "--config" in out.stdout and "--model" in out.stdout
    out = run("launch", "cursor")
    assert out.returncode == 2 and "invalid choice: 'cursor'" in out.stderr


def test_an_unknown_command_is_refused_with_the_usage():
    out = run("frobnicate")
    assert out.returncode == 2 and "unknown command 'frobnicate'" in out.stderr and "commands:" in out.stderr


def test_every_command_dispatches_to_an_existing_entry_point(monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "_exec_python", calls.append)
    monkeypatch.setattr(test_runner, "main", lambda args: calls.append(["test_runner", *args]))
    monkeypatch.chdir(REPO)
    for argv in (["serve", "--env-file", "x"], ["mlx-server"], ["bench", "--only", "spec"], ["env-example"],
                 ["test", "--fast", "tests/test_docs.py"]):
        assert cli.main(argv) == 0
    assert calls == [[str(REPO / "start_llm.py"), "--env-file", "x"], ["-m", "mlxstack.serve"],
                     [str(REPO / "benchmarks" / "bench_guard.py"), "--only", "spec"],
                     [str(REPO / "scripts" / "gen_env_example.py")],
                     ["test_runner", "--fast", "tests/test_docs.py"]]
    for target in calls[:4]:
        assert target[0] == "-m" or Path(target[0]).is_file()


def test_the_fast_flag_is_the_marker_expression_and_nothing_else_changes():
    assert test_runner.pytest_args([]) == ["tests", "-q"]                      # the whole suite, as before
    assert test_runner.pytest_args(["tests/test_x.py", "-q"]) == ["tests/test_x.py", "-q"]
    assert test_runner.pytest_args(["--fast", "-q"]) == ["-q", "-m", "not e2e and not slow"]


def test_the_markers_are_declared():
    ini = (REPO / "pytest.ini").read_text()
    for marker in ("e2e:", "slow:", "real_clients:"):
        assert re.search(rf"^\s+{marker}", ini, re.M), marker


def _names(reqs: list[str]) -> list[str]:
    """Requirement strings without comments, normalised for comparison (spaces dropped)."""
    return sorted(r.split("#")[0].replace(" ", "").strip() for r in reqs if r.split("#")[0].strip())


def test_pyproject_dependencies_are_requirements_txt():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    assert _names(declared) == _names((REPO / "requirements.txt").read_text().splitlines())
    assert project["scripts"] == {"mlxstack": "mlxstack.cli:main"}
    assert project["requires-python"].startswith(">=3.12")


@pytest.mark.parametrize("pattern", tomllib.loads((REPO / "pyproject.toml").read_text())
                         ["tool"]["setuptools"]["package-data"]["mlxstack"])
def test_package_data_patterns_match_files(pattern):
    assert list((REPO / "mlxstack").glob(pattern)), pattern


def test_tenant_add_writes_a_private_key_and_list_names_the_tenants(tmp_path, capsys):
    import stat

    from mlxstack.config.tenants import read_tenants

    path = tmp_path / "tenants.json"
    assert cli.main(["tenant", "add", "alice", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    (key,) = read_tenants(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key not in out and key[:6] in out and str(path) in out        # shown masked, never whole
    assert cli.main(["tenant", "add", "bob", "--file", str(path)]) == 0
    capsys.readouterr()
    assert cli.main(["tenant", "list", "--file", str(path)]) == 0
    assert capsys.readouterr().out.split() == ["alice", "bob"]
    assert cli.main(["tenant", "add", "no spaces", "--file", str(path)]) == 1
    assert "tenant name" in capsys.readouterr().err
