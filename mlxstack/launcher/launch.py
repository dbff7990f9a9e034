"""``mlxstack launch CLIENT [--model M] [--config] [-- CLIENT ARGS...]``: one agent client on the stack.

1. The stack: the proxy (PROXY_HOST / PROXY_PORT) is asked for its /v1/models with the key; when
   nothing answers, ``start_llm.py`` is started in the background (its output in
   ``LOG_ROOT/launch-stack.log``, its pid in ``LOG_ROOT/.launch-stack.pid``) and awaited. It keeps
   running after the client exits.
2. The model: ``--model M`` (a name the proxy lists), else the main model (the first name without a
   provider prefix); its window and output budget are the proxy's ``max_input_tokens`` /
   ``max_output_tokens`` (the output capped at a quarter of the window).
3. The client's own configuration (clients.py): variables and arguments where the client reads them,
   else its documented file, merged into what is there after a byte-identical backup
   (``NAME.mlxstack-backup-YYYYmmdd-HHMMSS``); a file that cannot be read whole is refused, never
   replaced.
4. The client is exec'd with the user's arguments after ours; ``--config`` prints the configuration
   (the key masked) and writes the files instead.

The key travels only in the client's environment or in its own 0600 config file, never on a
command line or in a log.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from mlxstack.config.settings import REPO_ROOT, Settings, SettingsError, load_settings
from mlxstack.launcher import clients as cl
from mlxstack.launcher.litellm_config import proxy_base_url
from mlxstack.launcher.ports import port_is_free
from mlxstack.system.secrets import make_private_dir, mask_secret, write_private_file

STACK_LOG = "launch-stack.log"
STACK_PIDFILE = ".launch-stack.pid"
EXIT_NOT_INSTALLED = 127


class LaunchError(RuntimeError):
    """The client cannot be launched; the message says why and what to do."""


@dataclass(frozen=True)
class FileChange:
    """One of the client's files: its new text and what was there (None: no file)."""
    path: Path
    text: str
    old: bytes | None

    @property
    def changed(self) -> bool:
        return self.old != self.text.encode()


@dataclass(frozen=True)
class Plan:
    client: str
    binary: str
    args: list[str]             # after the binary: ours, then the user's
    env: dict[str, str]         # added to the environment
    files: list[FileChange]
    target: cl.Target


# ---------------------------------------------------------------------------- the model (pure)
def pick_model(models: list[dict], wanted: str | None, default_max_tokens: int) -> tuple[str, int, int]:
    """(name, window, output budget) from the proxy's /v1/models entries: ``wanted``, else the
    first name without a provider prefix (the main model), else the first name."""
    names = [str(m["id"]) for m in models if isinstance(m, dict) and m.get("id") and "*" not in str(m["id"])]
    if not names:
        raise LaunchError("the proxy lists no model")
    if wanted is not None and wanted not in names:
        raise LaunchError(f"the proxy does not serve {wanted!r}; it serves {', '.join(names)}")
    name = wanted or next((n for n in names if "/" not in n), names[0])
    entry = next(m for m in models if isinstance(m, dict) and m.get("id") == name)
    window = entry.get("max_input_tokens") or entry.get("context_length")
    if not isinstance(window, int) or window <= 0:
        raise LaunchError(f"the proxy does not say {name}'s context window (max_input_tokens in /v1/models)")
    output = entry.get("max_output_tokens")
    output = output if isinstance(output, int) and output > 0 else default_max_tokens
    return name, window, max(1, min(output, window // 4))


# ---------------------------------------------------------------------------- the stack
def proxy_models(base: str, key: str, timeout: float = 3.0) -> list[dict] | None:
    """The proxy's /v1/models entries; None when nothing answers there (no stack, or one still
    starting); LaunchError when something answers but refuses the key, or has no /v1/models."""
    req = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.loads(resp.read()).get("data")
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise LaunchError(f"the proxy on {base} refuses the key (LITELLM_MASTER_KEY in .env is not the "
                              "running stack's)") from None
        if exc.code in (404, 405):
            raise LaunchError(f"something on {base} answers /v1/models with {exc.code}: it is not the stack's proxy "
                              "(choose another PROXY_PORT in .env, or stop it)") from None
        return None
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return None
    return data if isinstance(data, list) else None


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:160] if lines else ""


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def ensure_stack(settings: Settings, env_file: Path | None, say: Callable[[str], None], *,
                 python: str = sys.executable, repo: Path = REPO_ROOT, poll: float = 0.5) -> list[dict]:
    """The proxy's /v1/models entries, starting the stack in the background first when nothing
    answers (the way ``mlxstack serve`` starts it). A stack's port already held while the proxy
    does not answer yet is a stack still starting (another launch, ``mlxstack serve``): it is
    awaited, never started twice (a second start_llm.py would stop the first as a leftover)."""
    base, key = proxy_base_url(settings), settings.litellm_master_key
    models = proxy_models(base, key)
    if models is not None:
        return models
    logs = make_private_dir(settings.log_root_path)
    log_path = logs / STACK_LOG
    held = [f"{host}:{port}" for host, port in ((settings.proxy_host, settings.proxy_port),
                                               (settings.mlx_host, settings.mlx_port))
            if port and not port_is_free(host, port)]
    if held:
        say(f"{' and '.join(held)} held but the proxy on {base} does not answer yet: waiting for the stack "
            "that is starting there")
        return _await_stack(settings, say, log_path, None, poll)
    say(f"the stack is not running on {base}: starting it (output in {log_path})")
    cmd = [python, str(repo / "start_llm.py"), *(["--env-file", str(env_file)] if env_file else [])]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=repo, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    write_private_file(logs / STACK_PIDFILE, f"{proc.pid}\n")
    return _await_stack(settings, say, log_path, proc, poll)


def _await_stack(settings: Settings, say: Callable[[str], None], log_path: Path,
                 proc: subprocess.Popen | None, poll: float) -> list[dict]:
    """Poll the proxy until it lists its models; ``proc`` (ours, else None) must not exit meanwhile."""
    base, key = proxy_base_url(settings), settings.litellm_master_key
    limit = settings.mlx_startup_timeout_seconds + settings.proxy_startup_timeout_seconds
    start, noted = time.monotonic(), 0.0
    while True:
        code = proc.poll() if proc is not None else None
        if code is not None:
            raise LaunchError(f"the stack exited with status {code} while starting ({log_path}):\n{_tail(log_path)}")
        models = proxy_models(base, key, timeout=2.0)
        elapsed = time.monotonic() - start
        if models:
            if proc is not None:
                say(f"the stack is ready after {elapsed:.0f}s (pid {proc.pid}, in {log_path.parent / STACK_PIDFILE}; "
                    "it keeps running after the client exits)")
            return models
        if elapsed > limit:
            raise LaunchError(f"the stack on {base} is not ready after {limit:g}s"
                              + (f" ({log_path}):\n{_tail(log_path)}" if proc is not None else ""))
        if elapsed - noted >= 10:
            noted = elapsed
            say(f"waiting for the stack ... {elapsed:.0f}s" + (f"  {_last_line(log_path)}" if proc is not None else ""))
        time.sleep(poll)


# ---------------------------------------------------------------------------- the client's files
def pi_dir(environ: Mapping[str, str], home: Path) -> Path:
    return Path(environ.get("PI_CODING_AGENT_DIR") or home / ".pi" / "agent").expanduser()


def openclaw_path(environ: Mapping[str, str], home: Path) -> Path:
    if environ.get("OPENCLAW_CONFIG_PATH"):
        return Path(environ["OPENCLAW_CONFIG_PATH"]).expanduser()
    return Path(environ.get("OPENCLAW_STATE_DIR") or home / ".openclaw").expanduser() / "openclaw.json"


def read_json(path: Path, client: str) -> tuple[dict | None, bytes | None]:
    """(the file's object, its bytes); (None, None) when there is none. A file that is not one
    plain JSON object is refused: merging needs all of it, and replacing it would lose it."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise LaunchError(f"{path} is not a plain JSON object (comments or JSON5?): mlxstack launch merges its "
                          f"entries only into a file it can read whole. Move it aside and run mlxstack launch {client} "
                          "again (then copy your entries back), or add the mlxstack entries by hand "
                          "(docs/operations.md#launching-a-client).")
    return data, raw


def _json_text(obj: dict) -> str:
    return json.dumps(obj, indent=2) + "\n"


def plan_launch(client: str, t: cl.Target, *, environ: Mapping[str, str], home: Path, user_args: list[str],
                thinking: bool) -> Plan:
    """What launching ``client`` on ``t`` takes: arguments, variables, files (read, not written)."""
    if client not in cl.CLIENTS:
        raise LaunchError(f"unknown client {client!r}; choose from {', '.join(cl.CLIENTS)}")
    files: list[FileChange] = []
    if client == "pi":
        folder = pi_dir(environ, home)
        existing, raw = read_json(folder / "models.json", client)
        files.append(FileChange(folder / "models.json", _json_text(cl.pi_models_json(t, existing)), raw))
        if cl.pi_needs_compaction_settings(t):
            existing, raw = read_json(folder / "settings.json", client)
            files.append(FileChange(folder / "settings.json", _json_text(cl.pi_settings_json(t, existing)), raw))
    elif client == "openclaw":
        path = openclaw_path(environ, home)
        existing, raw = read_json(path, client)
        files.append(FileChange(path, _json_text(cl.openclaw_config(t, existing)), raw))
    return Plan(client, cl.BINARIES[client], [*cl.client_args(client, t), *user_args],
                cl.client_env(client, t, thinking), files, t)


def backup_path(path: Path, stamp: str) -> Path:
    """``NAME.mlxstack-backup-STAMP``, numbered when that is taken (no backup is ever replaced)."""
    candidate, n = path.with_name(f"{path.name}.mlxstack-backup-{stamp}"), 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}.mlxstack-backup-{stamp}-{n}"), n + 1
    return candidate


def write_files(plan: Plan, stamp: str | None = None) -> list[str]:
    """Write the plan's changed files (0600), each after a byte-identical copy of what was there;
    one line per file saying what was done."""
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    notes = []
    for f in plan.files:
        if not f.changed:
            notes.append(f"{f.path} already set")
            continue
        f.path.parent.mkdir(parents=True, exist_ok=True)
        backup = None
        if f.old is not None:
            backup = backup_path(f.path, stamp)
            backup.write_bytes(f.old)
            shutil.copymode(f.path, backup)
        write_private_file(f.path, f.text)
        notes.append(f"wrote {f.path}" + (f" (backup {backup})" if backup else " (new)"))
    return notes


# ---------------------------------------------------------------------------- what --config prints
def describe(plan: Plan, notes: list[str] | None = None) -> str:
    """The configuration as text, the key masked wherever it appears."""
    t = plan.target
    lines = [f"# mlxstack launch {plan.client}: proxy {t.proxy_url}/v1, model {t.model}, "
             f"window {t.context_window}, output {t.max_output}"]
    for f in plan.files:
        lines += [f"# file {f.path}", f.text.rstrip("\n")]
    if plan.env:
        lines.append("# environment")
        lines += [f"{name}={shlex.quote(value)}" for name, value in plan.env.items()]
    lines += ["# command", shlex.join([plan.binary, *plan.args])]
    lines += [f"# {note}" for note in notes or []]
    text = "\n".join(lines)
    return text.replace(t.api_key, mask_secret(t.api_key)) if t.api_key else text


# ---------------------------------------------------------------------------- the command
def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(ours, the client's): everything after the first ``--`` goes to the client unchanged."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def not_installed_message(client: str) -> str:
    return (f"mlxstack launch: {cl.BINARIES[client]!r} ({client}) is not on PATH; install it with: "
            f"npm install -g {cl.PACKAGES[client]}")


def window_warning(client: str, t: cl.Target) -> str | None:
    need = cl.MIN_WINDOW[client]
    if t.context_window >= need:
        return None
    hint = "; or run claude --bare (mlxstack launch claude -- --bare)" if client == "claude" else ""
    return (f"WARNING: {t.model}'s window ({t.context_window} tokens) is below the ~{need} that {client}'s own "
            f"prompt and a reply need: serve a model with a larger window (MODEL_PATH) or pick one "
            f"(--model){hint}")


def main(argv: list[str], *, environ: Mapping[str, str] | None = None,
         exec_: Callable[[str, list[str], dict[str, str]], object] = os.execvpe,
         say: Callable[[str], None] | None = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    say = say or (lambda msg: print(f"mlxstack launch: {msg}", file=sys.stderr, flush=True))
    ours, user_args = split_args(argv)
    ap = argparse.ArgumentParser(prog="mlxstack launch", description="Start the stack if it is not running, "
                                 "point CLIENT at it and run CLIENT (arguments after -- go to CLIENT).")
    ap.add_argument("client", choices=cl.CLIENTS)
    ap.add_argument("--model", help="a model name the proxy lists (default: the main model)")
    ap.add_argument("--config", action="store_true", help="write the client's files and print its configuration "
                    "(the key masked) instead of running it")
    ap.add_argument("--env-file", type=Path, default=REPO_ROOT / ".env",
                    help="the stack's settings (default: .env in the checkout); the environment wins over it")
    args = ap.parse_args(ours)
    try:
        settings = load_settings(env=environ, env_file=args.env_file)
    except SettingsError as exc:
        print(f"mlxstack launch: configuration error: {exc}", file=sys.stderr)
        return 2
    exe = shutil.which(cl.BINARIES[args.client], path=environ.get("PATH"))
    if exe is None and not args.config:
        print(not_installed_message(args.client), file=sys.stderr)
        return EXIT_NOT_INSTALLED
    if not settings.litellm_master_key:
        print("mlxstack launch: LITELLM_MASTER_KEY is empty; run python3 install_and_run.py once (it writes .env "
              "with fresh keys) or set it", file=sys.stderr)
        return 2
    try:
        models = ensure_stack(settings, args.env_file if args.env_file.exists() else None, say)
        name, window, output = pick_model(models, args.model, settings.default_max_tokens)
        target = cl.Target(proxy_base_url(settings), settings.litellm_master_key, name, window, output)
        warning = window_warning(args.client, target)
        if warning:
            say(warning)
        home = Path(environ.get("HOME") or Path.home())
        plan = plan_launch(args.client, target, environ=environ, home=home, user_args=user_args,
                           thinking=settings.default_thinking)
        notes = write_files(plan)
    except LaunchError as exc:
        print(f"mlxstack launch: {exc}", file=sys.stderr)
        return 1
    if args.config:
        print(describe(plan, notes))
        return 0
    say(f"{args.client} -> {target.proxy_url}/v1, model {name} (window {window}, output {output})"
        + "".join(f"; {n}" for n in notes))
    exec_(exe, [exe, *plan.args], {**environ, **plan.env})
    return 0
