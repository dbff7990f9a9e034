"""Optimised BLAS for MLX's Linux CPU wheel (LD_PRELOAD of OpenBLAS).

What the wheel links (mlx / mlx-cpu 0.32.4, manylinux x86_64):
  ``mlx/lib/libmlx.so`` has ``RPATH $ORIGIN/../../mlx_cpu.libs`` and NEEDs the bundled
  ``libblas-<hash>.so.3.10.0`` / ``liblapack-<hash>.so.3.10.0`` (reference netlib BLAS/LAPACK
  3.10, plus libgfortran). Its undefined BLAS symbols are ``cblas_sgemm``, ``cblas_dgemm`` and
  ``cblas_cgemm`` (every float matmul, including M=1 decode matmuls, goes through
  ``cblas_sgemm``) and LAPACK ``*_`` routines. The symbols are resolved with the normal ELF
  lookup order, so a library named in ``LD_PRELOAD`` that defines ``cblas_sgemm`` wins.
  Measured: 512x576 @ 576x1536 float32 matmul 0.18 s (bundled) -> 0.005 s with Debian's
  ``libopenblas0-pthread`` preloaded.

The MLX server is started with ``blas_preload_env(settings)`` merged into its environment;
LD_PRELOAD only works for a process at exec time, so it cannot be applied to the current one.

Kernels: a DYNAMIC_ARCH OpenBLAS picks its kernels from a table of the CPU models it knows; on a
newer CPU it falls back to a generic one. Debian's 0.3.21 calls this machine's Xeon (family 6,
model 207, AVX-512) ``Prescott`` -- SSE3 kernels -- and a 1024^3 sgemm runs at 35-40 GFLOPS instead
of ~200 with the SkylakeX kernels (measured). ``blas_preload_env`` asks the library what it picked
(``openblas_corename``, a short child process) and, when that is below what the CPU's flags
support, sets ``OPENBLAS_CORETYPE`` (``better_coretype``) -- only once the library has confirmed
it knows the name, and never over a value already in the environment.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "Debian/Ubuntu: sudo apt-get install libopenblas0-pthread; "
    "Fedora: sudo dnf install openblas-threads; Arch: sudo pacman -S openblas"
)

DEFAULT_ROOTS: tuple[str, ...] = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", "/opt/OpenBLAS/lib")
_OFF = {"off", "none", "false", "0", "no", "disable", "disabled"}
_OPTIMISED_MARKERS = ("openblas", "mkl", "blis", "accelerate", "armpl")


def _triplets() -> list[str]:
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return [f"{arch}-linux-gnu"]


def _relative_candidates() -> list[str]:
    """Paths below a library root, best first (pthread variant preferred)."""
    rel: list[str] = []
    for trip in _triplets():
        rel += [
            f"{trip}/openblas-pthread/libopenblas.so.0",  # Debian/Ubuntu libopenblas0-pthread
            f"{trip}/libopenblas.so.0",  # Debian alternatives symlink
            f"{trip}/openblas-openmp/libopenblas.so.0",
            f"{trip}/openblas-serial/libopenblas.so.0",
        ]
    rel += [
        "libopenblasp.so.0",  # Fedora/RHEL openblas-threads
        "libopenblas.so.0",  # Fedora serial, Arch, source installs
        "libopenblaso.so.0",  # Fedora openmp
        "libopenblas.so",
    ]
    return rel


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"\x7fELF"
    except OSError:
        return False


def _from_ldconfig() -> Optional[Path]:
    exe = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig") else None)
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        name, _, target = line.strip().partition(" => ")
        if name.startswith("libopenblas") and ".so" in name and target:
            p = Path(target.strip())
            if _is_elf(p):
                return p
    return None


def find_optimized_blas(
    roots: Optional[Sequence[os.PathLike[str] | str]] = None, use_ldconfig: bool = True
) -> Optional[Path]:
    """First OpenBLAS shared library found in the standard Debian/Ubuntu/Fedora/Arch places.

    ``roots`` replaces the library roots searched (tests pass a fake tree); ``use_ldconfig``
    falls back to ``ldconfig -p``. Returns None off Linux or when nothing is found.
    """
    if roots is None:
        if not sys.platform.startswith("linux"):
            return None
        roots = DEFAULT_ROOTS
    for root in roots:
        for rel in _relative_candidates():
            p = Path(root) / rel
            if p.exists() and _is_elf(p):
                return p
        # Other multiarch triplets (e.g. a distro naming we did not predict).
        for hit in sorted(glob.glob(os.path.join(str(root), "*-linux-*", "openblas-pthread", "libopenblas.so.0"))):
            if _is_elf(Path(hit)):
                return Path(hit)
    if use_ldconfig:
        return _from_ldconfig()
    return None


def _cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# OpenBLAS's x86 kernel families, by the instruction set their sgemm uses (its DYNAMIC_ARCH names,
# lower-cased); a name not here is left alone (another vendor's table, a newer release)
_KERNEL_LEVEL = {
    **dict.fromkeys(("katmai", "coppermine", "northwood", "prescott", "banias", "core2", "penryn", "dunnington",
                     "atom", "nano", "opteron", "opteron(sse3)"), 0),
    **dict.fromkeys(("nehalem", "barcelona", "bobcat"), 1),
    **dict.fromkeys(("sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"), 2),
    **dict.fromkeys(("haswell", "zen"), 3),
    **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), 4),
}
# what a CPU's flags allow, best first: (level, OpenBLAS name, flags it needs)
_BY_FLAGS = (
    (4, "SkylakeX", ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")),
    (3, "Haswell", ("avx2", "fma")),
    (2, "Sandybridge", ("avx",)),
)


def better_coretype(detected: Optional[str], flags: Iterable[str]) -> Optional[str]:
    """The ``OPENBLAS_CORETYPE`` to set when OpenBLAS's own pick (``detected``) uses an older
    instruction set than the CPU's ``flags`` (from /proc/cpuinfo) support; None: keep its pick
    (pure)."""
    level = _KERNEL_LEVEL.get((detected or "").strip().lower())
    if level is None:
        return None
    have = set(flags)
    for rank, name, need in _BY_FLAGS:
        if all(f in have for f in need):
            return name if rank > level else None
    return None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first CPU's feature flags (empty when unreadable)."""
    try:
        with open(cpuinfo) as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


_CORENAME_PROBE = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); f = lib.openblas_get_corename; "
                   "f.restype = ctypes.c_char_p; print(f().decode())")
_corenames: dict[tuple[str, str], Optional[str]] = {}


def openblas_corename(lib: os.PathLike[str] | str, coretype: Optional[str] = None) -> Optional[str]:
    """The kernel family ``lib`` picks in a fresh process (with ``OPENBLAS_CORETYPE=coretype``
    when given), or None when it cannot say (not OpenBLAS, no such symbol, the child failed)."""
    key = (os.path.realpath(lib), coretype or "")
    if key not in _corenames:
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "OPENBLAS_CORETYPE")}
        env["OPENBLAS_NUM_THREADS"] = "1"
        if coretype:
            env["OPENBLAS_CORETYPE"] = coretype
        try:
            out = subprocess.run([sys.executable, "-c", _CORENAME_PROBE, str(lib)], env=env, capture_output=True,
                                 text=True, timeout=30)
            _corenames[key] = (out.stdout.strip() or None) if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            _corenames[key] = None
    return _corenames[key]


def coretype_env(lib: os.PathLike[str] | str, environ: Mapping[str, str]) -> dict[str, str]:
    """``{"OPENBLAS_CORETYPE": name}`` when ``lib`` would run older kernels than this CPU supports
    and accepts ``name`` (module doc); {} otherwise, or when the environment already sets one."""
    if "OPENBLAS_CORETYPE" in environ:
        return {}
    detected = openblas_corename(lib)
    name = better_coretype(detected, cpu_flags())
    if name is None or (openblas_corename(lib, name) or "").lower() != name.lower():
        return {}
    log.info("OpenBLAS picks %s kernels for this CPU; its flags support %s: OPENBLAS_CORETYPE=%s", detected, name, name)
    return {"OPENBLAS_CORETYPE": name}


def rank_threads(settings: Any, current: int, cores: Optional[int] = None) -> int:
    """OpenBLAS threads for one MLX process (pure): ``current``, capped at its share of the usable
    cores where several local ranks of a DISTRIBUTED group run on this machine -- each rank keeps
    its own busy-waiting pool: 3 ranks x 2 threads on 2 cores prefilled at 42 tok/s, 1 thread each
    at 176 (benchmarks/bench_distributed.py --ranks 3)."""
    cores = _cpu_count() if cores is None else cores
    ranks = int(getattr(settings, "distributed_local_ranks", 0) or 0)
    if str(getattr(settings, "distributed", "off")) == "off" or ranks < 2:
        return max(1, current)
    return max(1, min(current, cores // ranks))


def share_cores_between_ranks(settings: Any) -> Optional[int]:
    """Limit this process's OpenBLAS pool to ``rank_threads`` now (``openblas_set_num_threads`` of
    the preloaded library; OPENBLAS_NUM_THREADS updated to say so, which the native attention's
    thread count reads too). The threads it uses now, or None without OpenBLAS in the process."""
    try:
        proc = ctypes.CDLL(None)
        get, put = proc.openblas_get_num_threads, proc.openblas_set_num_threads
    except (OSError, AttributeError):
        return None
    get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
    now = int(get())
    want = rank_threads(settings, now)
    if want != now:
        put(want)
        os.environ["OPENBLAS_NUM_THREADS"] = str(want)
    return want


def blas_preload_env(
    settings: Any,
    *,
    environ: Optional[Mapping[str, str]] = None,
    system: Optional[str] = None,
    roots: Optional[Sequence[os.PathLike[str] | str]] = None,
    use_ldconfig: bool = True,
) -> dict[str, str]:
    """Environment additions for the MLX server process: ``LD_PRELOAD`` (+ ``OPENBLAS_NUM_THREADS``,
    ``OPENBLAS_CORETYPE`` where OpenBLAS would pick kernels older than the CPU: module doc).

    ``settings.blas_preload``: ``auto`` (find OpenBLAS), ``off``, or an explicit library path.
    Returns {} off Linux, when off, or when auto finds nothing (with a warning). An existing
    ``LD_PRELOAD`` in ``environ`` (default os.environ) is kept, the BLAS is put first.
    ``OPENBLAS_NUM_THREADS`` is set to the usable core count unless already set.
    """
    env = os.environ if environ is None else environ
    system = sys.platform if system is None else system
    choice = str(getattr(settings, "blas_preload", "auto") or "auto").strip()
    if not system.startswith("linux") or choice.lower() in _OFF:
        return {}
    if choice.lower() == "auto":
        lib = find_optimized_blas(roots, use_ldconfig=use_ldconfig)
        if lib is None:
            log.warning(
                "No optimised BLAS (OpenBLAS) found: MLX's CPU wheel will use its bundled reference "
                "BLAS and prompt processing (prefill) will be 10-40x slower. Install one (%s) "
                "or set BLAS_PRELOAD=/path/to/libopenblas.so.0.",
                INSTALL_HINT,
            )
            return {}
    else:
        lib = Path(choice).expanduser()
        if not lib.is_file() or not _is_elf(lib):
            from mlxstack.config.settings import SettingsError

            raise SettingsError(
                f"BLAS_PRELOAD={choice!r} is not a shared library file. Use auto, off, or the path "
                f"of libopenblas.so.0 ({INSTALL_HINT})."
            )
    existing = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    lib_s = str(lib)
    real = os.path.realpath(lib_s)
    entries = [lib_s] + [p for p in existing if p != lib_s and os.path.realpath(p) != real]
    out = {"LD_PRELOAD": ":".join(entries)}  # ld.so accepts ':' or ' ' separators
    if "OPENBLAS_NUM_THREADS" not in env:
        out["OPENBLAS_NUM_THREADS"] = str(_cpu_count())
    out.update(coretype_env(lib, env))
    return out


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def global_symbol_provider(symbol: str = "cblas_sgemm") -> Optional[str]:
    """The shared object that the global symbol scope resolves ``symbol`` to, or None.

    With OpenBLAS preloaded this names libopenblas; MLX's bundled BLAS is loaded RTLD_LOCAL
    (via the Python extension) and so is not visible here.
    """
    try:
        proc = ctypes.CDLL(None)
        fn = getattr(proc, symbol)
    except (OSError, AttributeError):
        return None
    try:
        dladdr = proc.dladdr
    except AttributeError:
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode(errors="replace"))


def _mapped_libraries(maps_path: str = "/proc/self/maps") -> list[str]:
    seen: list[str] = []
    try:
        with open(maps_path) as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if path.startswith("/") and ".so" in path and path not in seen:
                        seen.append(path)
    except OSError:
        pass
    return seen


def preloaded_blas(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The optimised BLAS this process's ``LD_PRELOAD`` names (``blas_preload_env`` puts it first),
    or None: what was asked for at exec, whether or not it took (``optimized_blas_active``)."""
    env = os.environ if environ is None else environ
    for entry in env.get("LD_PRELOAD", "").replace(":", " ").split():
        if any(m in os.path.basename(entry).lower() for m in _OPTIMISED_MARKERS):
            return entry
    return None


def optimized_blas_active() -> Optional[str]:
    """Path of an optimised BLAS that provides the global ``cblas_sgemm`` in this process, or None."""
    provider = global_symbol_provider("cblas_sgemm")
    if provider and any(m in os.path.basename(provider).lower() for m in _OPTIMISED_MARKERS):
        return provider
    return None


def blas_status() -> str:
    """One line for start-up logs: which BLAS MLX's matmuls use in this process."""
    if sys.platform == "darwin":
        return "BLAS: Apple Accelerate (macOS MLX build)"
    if not sys.platform.startswith("linux"):
        return f"BLAS: unknown on {sys.platform}"
    active = optimized_blas_active()
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    if active:
        core = os.environ.get("OPENBLAS_CORETYPE")
        return (f"BLAS: optimised, cblas_sgemm from {active} (OPENBLAS_NUM_THREADS={threads}"
                + (f", OPENBLAS_CORETYPE={core})" if core else ")"))
    bundled = [p for p in _mapped_libraries() if "mlx_cpu.libs" in p and "blas" in os.path.basename(p)]
    if bundled:
        return (
            f"BLAS: MLX's bundled reference BLAS ({os.path.basename(bundled[0])}) - slow prefill; "
            f"install OpenBLAS ({INSTALL_HINT}) and leave BLAS_PRELOAD=auto"
        )
    return "BLAS: no optimised BLAS preloaded (MLX not loaded yet, or a non-CPU MLX build)"


def describe_mlx_blas_linking(lib_paths: Iterable[str] = ()) -> str:  # pragma: no cover - diagnostics
    """Human-readable ``ldd`` of libmlx.so (for troubleshooting output)."""
    paths = list(lib_paths)
    if not paths:
        try:
            import importlib.util

            spec = importlib.util.find_spec("mlx")
            if spec and spec.submodule_search_locations:
                paths = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "lib", "libmlx*.so*"))
        except Exception:
            paths = []
    lines = []
    for p in paths:
        try:
            out = subprocess.run(["ldd", p], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            out = str(exc)
        lines.append(f"{p}:\n" + "\n".join(l for l in out.splitlines() if "blas" in l or "lapack" in l))
    return "\n".join(lines)
