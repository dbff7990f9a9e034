"""BLAS preload discovery / env logic (fake trees) and a real preload check where OpenBLAS exists."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxstack.config.settings import SettingsError, load_settings
from mlxstack.system import blas

ELF = b"\x7fELF" + b"\0" * 60


def _fake_lib(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(ELF)
    return path


def _trip() -> str:
    return blas._triplets()[0]


def test_find_prefers_debian_pthread(tmp_path: Path):
    _fake_lib(tmp_path / "usr/lib" / _trip() / "libopenblas.so.0")
    want = _fake_lib(tmp_path / "usr/lib" / _trip() / "openblas-pthread/libopenblas.so.0")
    assert blas.find_optimized_blas([tmp_path / "usr/lib"], use_ldconfig=False) == want


def test_find_fedora_layout(tmp_path: Path):
    want = _fake_lib(tmp_path / "usr/lib64/libopenblasp.so.0")
    _fake_lib(tmp_path / "usr/lib64/libopenblas.so.0")
    assert blas.find_optimized_blas([tmp_path / "usr/lib", tmp_path / "usr/lib64"], use_ldconfig=False) == want


def test_find_ignores_non_elf_and_missing(tmp_path: Path):
    (tmp_path / "libopenblas.so.0").write_text("not a library")
    assert blas.find_optimized_blas([tmp_path], use_ldconfig=False) is None
    assert blas.find_optimized_blas([tmp_path / "nope"], use_ldconfig=False) is None


def test_env_auto_found_merges_existing(tmp_path: Path):
    lib = _fake_lib(tmp_path / "libopenblas.so.0")
    s = load_settings(env={"BLAS_PRELOAD": "auto"})
    env = blas.blas_preload_env(s, environ={"LD_PRELOAD": "/x/libfoo.so"}, system="linux", roots=[tmp_path], use_ldconfig=False)
    assert env["LD_PRELOAD"] == f"{lib}:/x/libfoo.so"
    assert int(env["OPENBLAS_NUM_THREADS"]) >= 1
    env2 = blas.blas_preload_env(s, environ={"OPENBLAS_NUM_THREADS": "1", "LD_PRELOAD": str(lib)}, system="linux", roots=[tmp_path], use_ldconfig=False)
    assert env2 == {"LD_PRELOAD": str(lib)}  # no duplicate, user's thread count kept


def test_env_auto_not_found_warns(tmp_path: Path, caplog):
    s = load_settings(env={})
    with caplog.at_level("WARNING"):
        assert blas.blas_preload_env(s, environ={}, system="linux", roots=[tmp_path], use_ldconfig=False) == {}
    assert "apt-get install libopenblas0-pthread" in caplog.text


def test_env_off_and_non_linux(tmp_path: Path):
    _fake_lib(tmp_path / "libopenblas.so.0")
    assert blas.blas_preload_env(load_settings(env={"BLAS_PRELOAD": "off"}), environ={}, system="linux", roots=[tmp_path]) == {}
    assert blas.blas_preload_env(load_settings(env={}), environ={}, system="darwin", roots=[tmp_path]) == {}


def test_env_explicit_path(tmp_path: Path):
    lib = _fake_lib(tmp_path / "custom/libmyblas.so")
    env = blas.blas_preload_env(load_settings(env={"BLAS_PRELOAD": str(lib)}), environ={}, system="linux")
    assert env["LD_PRELOAD"] == str(lib)
    with pytest.raises(SettingsError, match="BLAS_PRELOAD"):
        blas.blas_preload_env(load_settings(env={"BLAS_PRELOAD": str(tmp_path / "missing.so")}), environ={}, system="linux")


def test_blas_status_is_a_line():
    line = blas.blas_status()
    assert line.startswith("BLAS:") and "\n" not in line


_REAL = blas.find_optimized_blas() if sys.platform.startswith("linux") else None


@pytest.mark.skipif(_REAL is None, reason="no OpenBLAS installed (apt-get install libopenblas0-pthread)")
def test_preload_env_activates_openblas_in_child():
    pytest.importorskip("mlx.core")
    import os

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update(blas.blas_preload_env(load_settings(env={}), environ={}))
    code = (
        "import mlx.core as mx; mx.eval(mx.ones((64,64)) @ mx.ones((64,64)));"
        "from mlxstack.system.blas import optimized_blas_active, blas_status;"
        "print(optimized_blas_active()); print(blas_status())"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "openblas" in out.stdout.splitlines()[0].lower()
    assert "optimised" in out.stdout


def test_better_coretype_only_upgrades_a_generic_pick():
    skx = {"fma", "avx", "avx2", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
    # OpenBLAS 0.3.21 on a CPU model it does not know (this machine: family 6 model 207) says Prescott
    assert blas.better_coretype("Prescott", skx) == "SkylakeX"
    assert blas.better_coretype("Prescott", {"avx", "avx2", "fma"}) == "Haswell"
    assert blas.better_coretype("Nehalem", {"avx"}) == "Sandybridge"
    assert blas.better_coretype("Haswell", skx) == "SkylakeX"
    # already as good as the CPU allows, or better than its flags say: left alone
    assert blas.better_coretype("SkylakeX", skx) is None
    assert blas.better_coretype("Cooperlake", skx) is None
    assert blas.better_coretype("Haswell", {"avx", "avx2", "fma"}) is None
    assert blas.better_coretype("Zen", {"avx", "avx2", "fma"}) is None
    assert blas.better_coretype("Prescott", {"sse3"}) is None
    # AVX-512 foundation without the rest SkylakeX's kernels use (Knights Landing): AVX2's
    assert blas.better_coretype("Prescott", {"avx", "avx2", "fma", "avx512f", "avx512cd"}) == "Haswell"
    # a name it does not know (another release's, ARM's) or no answer: its pick stands
    assert blas.better_coretype("NEOVERSEN1", skx) is None
    assert blas.better_coretype(None, skx) is None


def test_cpu_flags_reads_the_first_cpu(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel\t\t: 207\nflags\t\t: fpu sse3 avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert blas.cpu_flags(str(info)) == {"fpu", "sse3", "avx2", "fma"}
    assert blas.cpu_flags(str(tmp_path / "missing")) == set()


def test_coretype_env_keeps_a_value_already_set(tmp_path: Path):
    lib = _fake_lib(tmp_path / "libopenblas.so.0")
    assert blas.coretype_env(lib, {"OPENBLAS_CORETYPE": "Haswell"}) == {}
    # a file that is not a loadable OpenBLAS: the child cannot say what it picks, nothing is set
    assert blas.openblas_corename(lib) is None
    assert blas.coretype_env(lib, {}) == {}


@pytest.mark.skipif(_REAL is None, reason="no OpenBLAS installed (apt-get install libopenblas0-pthread)")
def test_coretype_env_on_this_machine():
    """The real library: what it picks, and what the env adds, agree with the pure rule."""
    detected = blas.openblas_corename(_REAL)
    assert detected
    want = blas.better_coretype(detected, blas.cpu_flags())
    env = blas.coretype_env(_REAL, {})
    assert env == ({"OPENBLAS_CORETYPE": want} if want else {})
    if want:
        assert blas.openblas_corename(_REAL, want).lower() == want.lower()


def test_rank_threads_share_the_cores_between_local_ranks():
    three = load_settings(env={"DISTRIBUTED": "tensor", "DISTRIBUTED_LOCAL_RANKS": "3"})
    two = load_settings(env={"DISTRIBUTED": "tensor", "DISTRIBUTED_LOCAL_RANKS": "2"})
    one = load_settings(env={})
    assert [blas.rank_threads(three, 2, cores=c) for c in (2, 3, 6, 16)] == [1, 1, 2, 2]
    assert [blas.rank_threads(three, 8, cores=c) for c in (2, 3, 6, 16)] == [1, 1, 2, 5]
    assert [blas.rank_threads(two, 8, cores=c) for c in (1, 2, 16)] == [1, 1, 8]   # never above what it had
    assert [blas.rank_threads(one, n, cores=2) for n in (1, 2, 8)] == [1, 2, 8]    # one process: untouched


def test_share_cores_sets_the_preloaded_pool(tmp_path: Path):
    """In a fresh process with the preloaded OpenBLAS of this machine (the test runner's
    environment): 3 local ranks on this machine's cores -> each pool cores // 3 threads (at least
    1), read back from OpenBLAS itself; without ranks nothing changes."""
    if not blas.optimized_blas_active():
        pytest.skip("no preloaded OpenBLAS in this process")
    code = ("import ctypes, os, json; from mlxstack.config.settings import load_settings; "
            "from mlxstack.system import blas; "
            "get = ctypes.CDLL(None).openblas_get_num_threads; before = get(); "
            "one = blas.share_cores_between_ranks(load_settings(env={})); "
            "three = blas.share_cores_between_ranks(load_settings(env={'DISTRIBUTED': 'tensor', "
            "'DISTRIBUTED_LOCAL_RANKS': '3'})); "
            "print(json.dumps([before, one, three, get(), os.environ['OPENBLAS_NUM_THREADS'], "
            "len(os.sched_getaffinity(0))]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OPENBLAS_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-1500:]
    before, one, three, now, env, cores = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == 2 and one == 2
    assert three == now == int(env) == max(1, min(2, cores // 3))


def test_preloaded_blas_reads_what_ld_preload_asked_for():
    lib = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert blas.preloaded_blas({"LD_PRELOAD": f"{lib}:/usr/lib/libjemalloc.so.2"}) == lib
    assert blas.preloaded_blas({"LD_PRELOAD": f"/usr/lib/libjemalloc.so.2 {lib}"}) == lib
    assert blas.preloaded_blas({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) is None
    assert blas.preloaded_blas({}) is None


@pytest.mark.skipif(_REAL is None, reason="no OpenBLAS installed (apt-get install libopenblas0-pthread)")
def test_host_path_tests_skip_only_without_the_preload():
    """A plain ``pytest`` has no OpenBLAS preloaded: the host path is off and its tests skip, naming
    why; with the test runner's environment (the preload) they run -- and a preload that is asked
    for but does not take still runs them, so they fail rather than skip."""
    pytest.importorskip("mlx.core")
    code = ("from tests.conftest import blas_preload_missing; from mlxstack.backends.cpu import host_forward as hf; "
            "print(repr(blas_preload_missing())); print(hf.blas() is not None)")
    root = Path(__file__).resolve().parents[1]
    plain = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MLXSTACK_BLAS_APPLIED")}
    preloaded = {**plain, **blas.blas_preload_env(load_settings(env={}), environ={})}
    untaken = {**plain, "LD_PRELOAD": "/nowhere/libopenblas.so.0"}

    def run(env):
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[-2:]

    assert run(plain) == [repr("no optimised BLAS preloaded in this process (LD_PRELOAD, read at exec), so the host "
                               "path is off: run the tests through `python -m mlxstack.launcher.test_runner`, which "
                               f"preloads {_REAL}"), "False"]
    assert run(preloaded) == ["None", "True"]
    assert run(untaken)[0] == "None"
