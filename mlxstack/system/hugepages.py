"""Transparent huge pages for the MLX server's malloc (Linux, glibc >= 2.35).

MLX's CPU backend allocates every array with ``malloc``; big ones come from fresh ``mmap``
regions in 4 KiB pages. Two costs follow on a CPU-only machine: every first touch of fresh memory
is a page fault (loading a 185 MB prompt-cache entry, the copy a hit's first append makes, a
prefill's buffers: ~0.7 GB/s measured here), and a decode step that streams ~540 MB of float32
weights misses the TLB on every 4 KiB page. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` glibc
aligns its mmap'd chunks and asks for transparent huge pages (``madvise``), which the kernel
grants in ``madvise`` and ``always`` modes: 2 MiB pages, 512x fewer faults and TLB entries
(measured: an 8-row decode step ~124 vs ~137 ms median over 4 alternating runs each; 200 MB of
fresh zeros 0.17-0.21 vs 0.14-0.31 s). The tunable is read at process start, so like
``LD_PRELOAD`` (system/blas.py) it is set for the server process by the launcher.

    hugepage_env(settings, environ)   -> {"GLIBC_TUNABLES": "...:glibc.malloc.hugetlb=1"} or {}
    plan(choice, thp, glibc, existing) -> the same, from its inputs (pure)
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Mapping, Optional

TUNABLE = "glibc.malloc.hugetlb"
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)      # the first glibc with glibc.malloc.hugetlb


def thp_mode(path: str = THP_ENABLED) -> Optional[str]:
    """The kernel's transparent-huge-page mode (``always`` / ``madvise`` / ``never``: the bracketed
    word of ``path``), or None where there is no such file."""
    try:
        with open(path, encoding="ascii") as fh:
            m = re.search(r"\[(\w+)\]", fh.read())
    except OSError:
        return None
    return m.group(1) if m else None


def glibc_version(confstr: Optional[str] = None) -> Optional[tuple[int, int]]:
    """(major, minor) of the C library when it is glibc, else None (musl, macOS)."""
    if confstr is None:
        try:
            confstr = os.confstr("CS_GNU_LIBC_VERSION") or ""
        except (ValueError, OSError, AttributeError):
            return None
    m = re.fullmatch(r"glibc (\d+)\.(\d+)\S*", confstr.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def tunable_value(tunables: str) -> Optional[str]:
    """The value ``GLIBC_TUNABLES`` (``name=value`` pairs joined by ``:``) gives ``TUNABLE``, or None
    where it does not name it (pure)."""
    for pair in tunables.split(":"):
        name, sep, value = pair.partition("=")
        if sep and name == TUNABLE:
            return value
    return None


def plan(choice: str, thp: Optional[str], glibc: Optional[tuple[int, int]], existing: str = "") -> dict[str, str]:
    """The environment that asks glibc for huge pages (pure): ``choice`` ``auto`` (HUGE_PAGES) sets
    the tunable where the kernel grants them (``thp`` madvise / always) and glibc knows it; ``off``,
    a kernel mode ``never``, an older glibc or a ``GLIBC_TUNABLES`` that already names the tunable
    (the user's word wins) give {}. Other tunables in ``existing`` are kept."""
    if choice.strip().lower() == "off" or thp not in ("madvise", "always") or glibc is None or glibc < MIN_GLIBC:
        return {}
    if tunable_value(existing) is not None:
        return {}
    return {"GLIBC_TUNABLES": f"{existing}:{TUNABLE}=1" if existing else f"{TUNABLE}=1"}


def hugepage_env(settings: Any, environ: Optional[Mapping[str, str]] = None, system: Optional[str] = None) -> dict[str, str]:
    """``plan`` for this machine and ``settings.huge_pages`` (Linux only)."""
    env = os.environ if environ is None else environ
    if not (sys.platform if system is None else system).startswith("linux"):
        return {}
    return plan(str(getattr(settings, "huge_pages", "auto") or "auto"), thp_mode(), glibc_version(),
                env.get("GLIBC_TUNABLES", ""))


def hugepage_status(environ: Optional[Mapping[str, str]] = None) -> str:
    """One line for the start-up log: whether this process asked for huge pages."""
    env = os.environ if environ is None else environ
    on = tunable_value(env.get("GLIBC_TUNABLES", "")) == "1"
    mode = thp_mode()
    kernel = f"kernel THP {mode}" if mode else "no transparent huge pages here"
    return (f"memory: malloc asks for transparent huge pages ({TUNABLE}=1, {kernel})" if on
            else f"memory: the allocator's default pages (HUGE_PAGES off or not available; {kernel})")
