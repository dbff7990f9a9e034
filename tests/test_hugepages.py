"""Huge pages for the MLX server's malloc (system/hugepages.py, system/process_env.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlxstack.config.settings import load_settings
from mlxstack.system import hugepages
from mlxstack.system.hugepages import TUNABLE, glibc_version, plan, thp_mode, tunable_value


def test_plan_sets_the_tunable_where_the_kernel_grants_huge_pages():
    assert plan("auto", "madvise", (2, 36)) == {"GLIBC_TUNABLES": f"{TUNABLE}=1"}
    assert plan("auto", "always", (2, 35)) == {"GLIBC_TUNABLES": f"{TUNABLE}=1"}
    # other tunables are kept, ours appended
    assert plan("auto", "madvise", (2, 36), "glibc.malloc.arena_max=2") == \
        {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TUNABLE}=1"}


@pytest.mark.parametrize("choice,thp,glibc,existing", [
    ("off", "madvise", (2, 36), ""),                 # switched off
    ("auto", "never", (2, 36), ""),                  # the kernel never grants them
    ("auto", None, (2, 36), ""),                     # no THP at all (not Linux, old kernel)
    ("auto", "madvise", (2, 34), ""),                # glibc without the tunable
    ("auto", "madvise", None, ""),                   # not glibc (musl)
    ("auto", "madvise", (2, 36), f"{TUNABLE}=0"),    # the user's word wins
    ("auto", "madvise", (2, 36), f"glibc.malloc.arena_max=2:{TUNABLE}=2"),
])
def test_plan_leaves_the_environment_alone(choice, thp, glibc, existing):
    assert plan(choice, thp, glibc, existing) == {}


def test_tunable_value_reads_only_our_tunable():
    assert tunable_value(f"glibc.malloc.arena_max=2:{TUNABLE}=1") == "1"
    assert tunable_value(f"{TUNABLE}=0") == "0"
    assert tunable_value(f"{TUNABLE}x=1:glibc.malloc.arena_max=2") is None
    assert tunable_value("") is None


def test_glibc_version_and_thp_mode_parse(tmp_path):
    assert glibc_version("glibc 2.36") == (2, 36)
    assert glibc_version("glibc 2.35.9000") == (2, 35)
    assert glibc_version("musl 1.2") is None
    p = tmp_path / "enabled"
    p.write_text("always [madvise] never\n")
    assert thp_mode(str(p)) == "madvise"
    assert thp_mode(str(tmp_path / "missing")) is None


def test_hugepage_env_is_linux_only_and_follows_the_setting():
    assert hugepages.hugepage_env(load_settings(env={}), environ={}, system="darwin") == {}
    assert hugepages.hugepage_env(load_settings(env={"HUGE_PAGES": "off"}), environ={}, system="linux") == {}


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("madvise", "always")
                    or (glibc_version() or (0, 0)) < (2, 35), reason="needs Linux THP and glibc >= 2.35")
def test_a_process_started_with_it_gets_huge_pages():
    """The real effect: a child started with the environment maps anonymous huge pages once it
    touches a 64 MB MLX array; the same child without it maps none."""
    env_on = hugepages.hugepage_env(load_settings(env={}), environ={})
    assert env_on == {"GLIBC_TUNABLES": f"{TUNABLE}=1"}
    code = ("import mlx.core as mx\n"
            "a = mx.ones((16 * 1024 * 1024,)); mx.eval(a)\n"
            "print([l.split()[1] for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')][0])")
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    on = int(subprocess.run([sys.executable, "-c", code], env={**base, **env_on}, capture_output=True,
                            text=True, timeout=120, check=True).stdout.strip())
    off = int(subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True,
                             timeout=120, check=True).stdout.strip())
    assert off == 0
    assert on >= 32 * 1024          # kB: at least half of the array in 2 MiB pages


def test_the_start_up_line_says_which():
    assert hugepages.hugepage_status({"GLIBC_TUNABLES": f"x=1:{TUNABLE}=1"}).startswith("memory: malloc asks for")
    assert hugepages.hugepage_status({}).startswith("memory: the allocator's default pages")
    assert hugepages.hugepage_status({"GLIBC_TUNABLES": f"{TUNABLE}=0"}).startswith("memory: the allocator's default")
