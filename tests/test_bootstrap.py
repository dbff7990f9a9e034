"""install_and_run.py helpers, exercised with real (fake-version) executables and temp dirs."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("install_and_run", REPO / "install_and_run.py")
boot = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(boot)


def fake_python(path: Path, version: str | None) -> str:
    """An executable that answers like `python -c ...` with ``version``; None = a failing pyenv shim."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = f"echo {version}" if version else 'echo "pyenv: python3.12: command not found" >&2; exit 127'
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_python_version_probe(tmp_path):
    assert boot.python_version(fake_python(tmp_path / "p", "3.12.4")) == (3, 12, 4)
    assert boot.python_version(fake_python(tmp_path / "shim", None)) is None
    assert boot.python_version(str(tmp_path / "absent")) is None
    assert boot.python_version(sys.executable) == tuple(sys.version_info[:3])


def test_find_skips_shim_and_other_versions(tmp_path):
    shim = fake_python(tmp_path / "shims" / "python3.12", None)
    py311 = fake_python(tmp_path / "a" / "python3.12", "3.11.7")
    good = fake_python(tmp_path / "b" / "python3.12", "3.12.1")
    found, tried = boot.find_python312([shim, py311, good])
    assert found == good
    assert tried == [(shim, None), (py311, (3, 11, 7)), (good, (3, 12, 1))]


def test_override_takes_precedence(tmp_path):
    other = fake_python(tmp_path / "b" / "python3.12", "3.12.1")
    mine = fake_python(tmp_path / "mine" / "python", "3.12.9")
    assert boot.find_python312([other], override=mine)[0] == mine


def test_bad_override_is_an_error(tmp_path):
    wrong = fake_python(tmp_path / "python", "3.13.0")
    with pytest.raises(boot.BootstrapError, match="PYTHON312=.*3.13.0"):
        boot.find_python312([fake_python(tmp_path / "ok", "3.12.1")], override=wrong)


def test_none_found_message(tmp_path):
    shim = fake_python(tmp_path / "shim", None)
    py313 = fake_python(tmp_path / "py313", "3.13.0")
    found, tried = boot.find_python312([shim, py313])
    assert found is None
    msg = boot.missing_python_message(tried)
    for needle in (shim, "does not run", py313, "3.13.0", "pyenv install 3.12", "brew install python@3.12",
                   "apt-get install python3.12", "PYTHON312="):
        assert needle in msg


def test_candidate_order(tmp_path):
    home = tmp_path / "home"
    old = fake_python(home / ".pyenv/versions/3.12.1/bin/python3.12", "3.12.1")
    new = fake_python(home / ".pyenv/versions/3.12.10/bin/python3.12", "3.12.10")
    fake_python(home / ".pyenv/versions/3.13.0/bin/python3.13", "3.13.0")
    on_path = fake_python(tmp_path / "bin" / "python3.12", None)
    cands = boot.candidate_pythons(env={"PATH": str(tmp_path / "bin")}, home=home, current="", mac_paths=())
    assert cands == [on_path, new, old]
    assert boot.find_python312(cands)[0] == new


def test_real_machine_discovery():
    found, tried = boot.find_python312(boot.candidate_pythons())
    if found is None:
        pytest.skip("no Python 3.12 on this machine")
    assert boot.python_version(found)[:2] == (3, 12)


def make_venv(root: Path, cfg_version: str, bins=("python", "python3", "python3.12", "pip", "pip3", "pip3.12")) -> Path:
    venv = root / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {cfg_version}\n")
    for name in bins:
        (venv / "bin" / name).write_text("#!/bin/sh\n")
    return venv


def test_clean_venv_passes(tmp_path):
    assert boot.inspect_venv_contamination(make_venv(tmp_path, "3.12.1")) == []
    assert boot.inspect_venv_contamination(tmp_path / "missing") == []


def test_wrong_cfg_version(tmp_path):
    bad = boot.inspect_venv_contamination(make_venv(tmp_path, "3.13.0"))
    assert len(bad) == 1 and "pyvenv.cfg" in bad[0] and "3.13" in bad[0]


def test_foreign_entry_points(tmp_path):
    venv = make_venv(tmp_path, "3.12.1", bins=("python", "python3.12", "python3.14", "pip3.13", "pip3.12", "python3.14t"))
    bad = boot.inspect_venv_contamination(venv)
    assert [Path(b.split(" ")[0]).name for b in bad] == ["pip3.13", "python3.14", "python3.14t"]


def test_uv_style_cfg_and_missing_cfg(tmp_path):
    venv = make_venv(tmp_path / "a", "x")
    (venv / "pyvenv.cfg").write_text("home = /x\nversion_info = 3.12.3\n")
    assert boot.inspect_venv_contamination(venv) == []
    (venv / "pyvenv.cfg").unlink()
    assert "missing" in boot.inspect_venv_contamination(venv)[0]


def test_requirements_stamp(tmp_path):
    req = tmp_path / "requirements.txt"
    req.write_text("mlx-lm==0.32.2\n")
    first = boot.requirements_stamp(req)
    assert first == boot.requirements_stamp(req) and len(first) == 64
    req.write_text("mlx-lm==0.32.3\n")
    assert boot.requirements_stamp(req) != first
    assert boot.requirements_stamp(req, extra=["--no-deps", "other==1"]) != boot.requirements_stamp(req)


def test_env_file_created_once_with_keys(tmp_path, monkeypatch):
    (tmp_path / ".env.example").write_text("# doc\nMLX_PORT=8080\nLITELLM_MASTER_KEY=\nMLX_API_KEY=\nPROXY_PORT=4000\n")
    chmods = []
    monkeypatch.setattr(boot.os, "chmod", lambda *a: chmods.append(a))  # spy: creation must not need one
    old = os.umask(0)  # even a permissive umask: the file is 0600 from its creation
    try:
        path, keys, generated = boot.ensure_env_file(tmp_path, environ={})
    finally:
        os.umask(old)
    text = path.read_text()
    assert generated == ["LITELLM_MASTER_KEY", "MLX_API_KEY"] and chmods == []
    master, mlx = keys["LITELLM_MASTER_KEY"], keys["MLX_API_KEY"]
    assert master.startswith("sk-") and len(master) > 30 and mlx.startswith("sk-") and mlx != master
    assert f"\nLITELLM_MASTER_KEY={master}\nMLX_API_KEY={mlx}\n" in text and "PROXY_PORT=4000" in text
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".env.")] == [".env.example"]  # no temp left
    path2, keys2, generated2 = boot.ensure_env_file(tmp_path, environ={})
    assert (keys2, generated2) == (keys, []) and path2.read_text() == text


def test_older_env_gets_an_mlx_key_and_tightened_mode(tmp_path):
    env = tmp_path / ".env"
    env.write_text("LITELLM_MASTER_KEY=sk-existing-master-key-0123456789\n")
    os.chmod(env, 0o644)  # as an older bootstrap left it
    _, keys, generated = boot.ensure_env_file(tmp_path, environ={})
    assert generated == ["MLX_API_KEY"] and keys["LITELLM_MASTER_KEY"] == "sk-existing-master-key-0123456789"
    assert env.read_text() == f"LITELLM_MASTER_KEY=sk-existing-master-key-0123456789\nMLX_API_KEY={keys['MLX_API_KEY']}\n"
    assert oct(env.stat().st_mode & 0o777) == "0o600"
    os.chmod(env, 0o644)
    assert boot.ensure_env_file(tmp_path, environ={})[2] == []
    assert oct(env.stat().st_mode & 0o777) == "0o600"


def test_env_file_respects_keys_from_environment(tmp_path):
    (tmp_path / ".env.example").write_text("LITELLM_MASTER_KEY=\n")
    _, keys, generated = boot.ensure_env_file(tmp_path, environ={"LITELLM_MASTER_KEY": "sk-env", "MLX_API_KEY": "sk-m"})
    assert keys == {"LITELLM_MASTER_KEY": "sk-env", "MLX_API_KEY": "sk-m"} and generated == []
    assert (tmp_path / ".env").read_text() == "LITELLM_MASTER_KEY=\n"


def test_committed_env_example_gets_keys(tmp_path):
    (tmp_path / ".env.example").write_text((REPO / ".env.example").read_text())
    _, keys, _ = boot.ensure_env_file(tmp_path, environ={})
    text = (tmp_path / ".env").read_text()
    for name in ("LITELLM_MASTER_KEY", "MLX_API_KEY"):
        assert text.count(f"\n{name}=") == 1 and f"\n{name}={keys[name]}\n" in text


def test_mask_secret_matches_the_package():
    from mlxstack.system.secrets import mask_secret

    for value in ("", "abc", "sk-123456789", "sk-1234567890", "sk-" + "x" * 40 + "END"):
        assert boot.mask_secret(value) == mask_secret(value)
    assert boot.mask_secret("sk-abcdefghijklmnopqrstuvwxyz") == "sk-abc\u2026xyz"


def test_split_args():
    assert boot.split_args([]) == (False, None, [])
    assert boot.split_args(["--env-file", "x"]) == (False, None, ["--env-file", "x"])
    assert boot.split_args(["--test"]) == (False, ["tests", "-q"], [])
    assert boot.split_args(["--recreate-venv", "--test", "-k", "foo"]) == (True, ["-k", "foo"], [])


def test_find_openblas(tmp_path):
    lib = tmp_path / "openblas-pthread" / "libopenblas.so.0"
    lib.parent.mkdir()
    lib.write_text("")
    assert boot.find_openblas([str(tmp_path / "nope*.so"), str(tmp_path / "*/libopenblas*.so*")]) == str(lib)
    assert boot.find_openblas([str(tmp_path / "nope*.so")]) is None


def _other_python(version: str):
    exe = Path.home() / f".pyenv/versions/{version}/bin/python{version.rsplit('.', 1)[0]}"
    return str(exe) if boot.python_version(exe) else None


@pytest.mark.parametrize("version", ["3.8.18", "3.11.7"])
def test_runs_under_older_launchers(version):
    """The bootstrap must at least parse and start under any python3 >= 3.8."""
    exe = _other_python(version)
    if not exe:
        pytest.skip(f"python {version} not installed here")
    r = subprocess.run([exe, str(REPO / "install_and_run.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--test" in r.stdout


def test_bad_python312_env_exits_cleanly(tmp_path):
    wrong = fake_python(tmp_path / "python", "3.11.0")
    r = subprocess.run([sys.executable, str(REPO / "install_and_run.py"), "--test"], capture_output=True, text=True,
                       env={**os.environ, "PYTHON312": wrong}, timeout=60)
    assert r.returncode == 1 and "PYTHON312=" in r.stderr and "Traceback" not in r.stderr


def test_contaminated_venv_refused_end_to_end(tmp_path):
    """The real script, in a scratch copy of the repo, refuses a venv holding python3.14 / pip3.13."""
    (tmp_path / "install_and_run.py").write_text((REPO / "install_and_run.py").read_text())
    (tmp_path / "requirements.txt").write_text("")
    venv = make_venv(tmp_path, "3.12.1", bins=("python", "python3.12", "python3.14", "pip3.13"))
    r = subprocess.run([sys.executable, str(tmp_path / "install_and_run.py")], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    if "Python 3.12 is required" in r.stderr:
        pytest.skip("no Python 3.12 on this machine")
    assert r.returncode == 1, r.stderr
    assert str(venv / "bin" / "python3.14") in r.stderr and str(venv / "bin" / "pip3.13") in r.stderr
    assert "--recreate-venv" in r.stderr and "rm -rf .venv" in r.stderr
    assert (venv / "bin" / "python3.14").exists()  # refused, not touched
