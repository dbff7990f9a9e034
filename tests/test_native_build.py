"""The native kernels' build (backends/cpu/native_build.py): one library per CPU as well as per source,
flags and compiler (a build copied to a CPU with other features is rebuilt, never loaded: -march=native
code dies of SIGILL elsewhere), in a private folder (0700, this user's), and a library that is not
this user's own unwritable file -- a predictable name in a loose folder -- never loaded."""
from __future__ import annotations

import os
import shutil
import stat

import pytest

from mlxstack.backends.cpu import native_build

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")

X86 = "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu sse2 avx2 fma avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n"


def test_the_cpu_key_names_the_features_and_the_model():
    assert native_build.cpu_key(X86) == "avx2 avx512f fma fpu sse2|Some Xeon"        # the first CPU's
    assert native_build.cpu_key(X86.replace(" avx512f", "")) != native_build.cpu_key(X86)
    arm = "processor\t: 0\nFeatures\t: fp asimd crc32 atomics\nCPU part\t: 0xd0c\n"
    assert native_build.cpu_key(arm) == "asimd atomics crc32 fp|0xd0c"
    assert native_build.cpu_key("").count("|") == 2                                    # machine | processor | platform


@needs_cc
def test_a_build_for_another_cpu_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXSTACK_NATIVE_DIR", str(tmp_path / "native"))
    here = native_build.build()
    assert here is not None and stat.S_IMODE(os.stat(here.parent).st_mode) == 0o700
    monkeypatch.setattr(native_build, "cpu_key", lambda cpuinfo=None: "fpu sse2|a CPU without AVX")
    elsewhere = native_build.build()                      # the venv copied to that machine
    assert elsewhere is not None and elsewhere != here and elsewhere.exists()
    assert sorted(p.name for p in here.parent.iterdir()) == sorted([here.name, elsewhere.name])


@needs_cc
def test_a_loose_folder_is_refused_and_its_library_never_loaded(tmp_path, monkeypatch):
    loose = tmp_path / "shared"
    loose.mkdir()
    os.chmod(loose, 0o777)
    monkeypatch.setenv("MLXSTACK_NATIVE_DIR", str(loose))
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    planted = native_build.library_path(native_build.SOURCE, compiler, native_build.FLAGS + native_build.LIBS)
    planted.write_bytes(b"anyone's code")                 # the predictable name, by anyone
    assert native_build.build() is None
    assert native_build.load_checked(lambda p: pytest.fail("a library in a loose folder was loaded"),
                                     lambda fn: True, "test") is None
    assert planted.read_bytes() == b"anyone's code"       # nothing built there either


@needs_cc
def test_a_library_others_may_write_is_built_again_over(tmp_path, monkeypatch):
    folder = tmp_path / "native"
    monkeypatch.setenv("MLXSTACK_NATIVE_DIR", str(folder))
    first = native_build.build()
    assert first is not None and native_build.trusted_library(first)
    first.write_bytes(b"tampered")
    os.chmod(first, 0o666)
    again = native_build.build()
    assert again == first and native_build.trusted_library(again) and again.read_bytes() != b"tampered"
    os.chmod(folder, 0o755)                                # an older install's folder: ours, tightened
    assert native_build.build() == first and stat.S_IMODE(os.stat(folder).st_mode) == 0o700


def test_the_products_loop_only_where_the_cpu_fuses_multiply_adds():
    from mlxstack.backends.cpu.native_products import fast_here

    assert fast_here(X86, "x86_64")
    assert not fast_here(X86.replace(" fma", ""), "x86_64")       # __builtin_fmaf would be a libm call
    assert not fast_here(X86.replace(" avx2", ""), "x86_64")
    assert fast_here("", "arm64") and fast_here("", "aarch64")   # NEON has them


@needs_cc
def test_built_ahead_a_server_only_binds_it(tmp_path, monkeypatch):
    """`mlxstack build-native` (what install_and_run.py runs) builds the library where a server of the
    same environment looks; the server's load then finds it and compiles nothing."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    python = repo / ".venv" / "bin" / "python"
    env = {**os.environ, "MLXSTACK_NATIVE_DIR": str(tmp_path)}
    out = subprocess.run([str(python if python.exists() else sys.executable), "-m", "mlxstack.cli", "build-native"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    built = [p for p in tmp_path.iterdir()]
    assert len(built) == 1 and str(built[0]) in out.stdout
    monkeypatch.setenv("MLXSTACK_NATIVE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "compiled_here", False)
    monkeypatch.setattr(native_build.subprocess, "run", lambda *a, **k: pytest.fail("compiled at load"))
    assert native_build.build() == built[0] and native_build.compiled_here is False


def test_build_native_says_why_not(monkeypatch, capsys):
    from mlxstack import cli

    monkeypatch.setattr(native_build, "build_ahead", lambda: (None, "no C compiler (cc / gcc / CC)"))
    assert cli.main(["build-native"]) == 1 and "no C compiler" in capsys.readouterr().err
    assert cli.main(["build-native", "extra"]) == 2
