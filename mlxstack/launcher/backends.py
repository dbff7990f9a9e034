"""Which MLX backends the stack runs behind LiteLLM (pure: parsing, ports, names; no processes).

    backends = load_backends(settings, repo)        # [Backend, ...] in configuration order
    groups = model_groups(backends, discovered)     # one LiteLLM model group per served model

Sources, the first that applies:

1. ``BACKENDS_FILE`` (default ``backends.yaml`` in the repository, ignored by git) when it exists::

       backends:
         - model_path: ""                  # local: start_llm.py starts and supervises it ("" = embedded)
           port: 8080                      # default: MLX_PORT, then the next port after the previous entry
           replicas: 2                     # ports 8080 and 8081, one MLX server process each
           env: {PROMPT_CACHE_MAX_BYTES: 8000000000}   # any .env variable, for this entry only
         - model_path: /models/Qwen3-0.6B-4bit
           aliases: [small-fast]           # more model names clients may ask LiteLLM for
         - url: http://studio.local:8080   # remote: started there with this project (python3 install_and_run.py)
           api_key: os.environ/STUDIO_MLX_API_KEY   # default: this machine's MLX_API_KEY

2. ``.env`` alone: ``MLX_REPLICAS=N`` local replicas of ``MODEL_PATH`` on ``MLX_PORT``, ``MLX_PORT+1``, …

Model names are not configured: each backend's own ``/v1/models`` says what it serves, and backends
serving the same model id become deployments of one model group (replicas, local or remote).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from mlxstack.config.settings import REPO_ROOT, SPEC_BY_NAME, Settings, SettingsError, load_settings

ENTRY_KEYS = frozenset({"model_path", "port", "replicas", "env", "aliases", "url", "api_key", "model"})
# Settings a backend entry sets through its own keys (or the launcher assigns), never through ``env``.
RESERVED_ENV = frozenset({"MLX_PORT", "MODEL_PATH", "BACKENDS_FILE", "MLX_REPLICAS", "PROXY_PORT", "PROXY_HOST",
                          "LITELLM_MASTER_KEY"})
DISK_OFF = frozenset({"", "off", "none", "false", "no", "0"})


class BackendsError(SettingsError):
    """The backends configuration is wrong; the message names the entry and how to fix it."""


@dataclass(frozen=True)
class Backend:
    """One MLX server LiteLLM routes to.

    ``name`` labels its output and pid file (``mlx`` for a single local backend, ``mlx:<port>``
    otherwise); ``url`` is its base URL without ``/v1``; ``env`` holds the settings a local backend
    runs with (a full Settings environment); ``api_key`` is the key LiteLLM sends it ("" = none).
    """

    name: str
    url: str
    local: bool
    entry: int                                   # index of its entry in the file (replicas share it)
    port: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    api_key: str = ""
    aliases: tuple[str, ...] = ()
    model: str = ""                              # remote: the model id when it cannot be asked at start-up

    def settings(self) -> Settings:
        """The Settings a local backend's MLX server runs with."""
        return load_settings(env=dict(self.env))


@dataclass(frozen=True)
class ModelGroup:
    """One LiteLLM model group: every name clients may use, and the backends serving it."""

    model_id: str
    names: tuple[str, ...]
    backends: tuple[Backend, ...]
    context_window: int | None = None


# --- parsing ---------------------------------------------------------------------------------------
def backends_file_path(settings: Settings, repo: Path = REPO_ROOT) -> Path:
    path = Path(settings.backends_file).expanduser()
    return path if path.is_absolute() else repo / path


def _url_host(host: str) -> str:
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _resolve_key(value: Any, where: str, environ: Mapping[str, str]) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BackendsError(f"{where}: api_key must be a string (the key, or os.environ/NAME).")
    if value.startswith("os.environ/"):
        name = value.split("/", 1)[1]
        if not environ.get(name):
            raise BackendsError(f"{where}: api_key refers to the environment variable {name}, which is not set. "
                                f"export {name}=<the remote server's MLX_API_KEY> before starting, or write the key itself.")
        return environ[name]
    return value


def _env_overrides(raw: Any, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise BackendsError(f"{where}: env must be a mapping of .env variables, e.g. env: {{PROMPT_CACHE_MAX_BYTES: 8000000000}}.")
    out = {}
    for key, value in raw.items():
        name = str(key).upper()
        if name not in SPEC_BY_NAME:
            close = difflib.get_close_matches(name, SPEC_BY_NAME, n=1)
            raise BackendsError(f"{where}: env sets unknown variable {key!r}"
                                + (f" (did you mean {close[0]}?)" if close else "") + "; .env.example lists them all.")
        if name in RESERVED_ENV:
            raise BackendsError(f"{where}: set {name} with the entry's own key "
                                f"({'port' if name == 'MLX_PORT' else 'model_path' if name == 'MODEL_PATH' else 'nothing: it is stack-wide'}), not in env.")
        out[name] = "true" if value is True else "false" if value is False else str(value)
    return out


def _aliases(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(a, str) and a.strip() for a in items):
        raise BackendsError(f"{where}: aliases must be a list of model names, e.g. aliases: [small-fast].")
    return tuple(a.strip() for a in items)


def _int(raw: Any, where: str, key: str, minimum: int) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < minimum:
        raise BackendsError(f"{where}: {key} must be an integer >= {minimum}, got {raw!r}.")
    return raw


def disk_dir_for_replica(env: Mapping[str, str], port: int) -> str:
    """A replica's own disk-tier folder: two processes cannot share one tier (it is locked per model)."""
    value = env.get("DISK_CACHE_DIR", "auto").strip()
    if value.lower() == "auto":
        base = Path(env["MODEL_CACHE_DIR"]).expanduser() if env.get("MODEL_CACHE_DIR") else Path.home() / ".cache" / "mlxstack"
        path = base / "kv"
    else:
        path = Path(value).expanduser()
        path = path if path.is_absolute() else REPO_ROOT / path
    return str(path / f"replica-{port}")


def parse_backends(data: Any, settings: Settings, environ: Mapping[str, str] | None = None,
                   source: str = "backends.yaml") -> list[Backend]:
    """Backends from the parsed backends file (see the module docstring for its shape)."""
    environ = os.environ if environ is None else environ
    entries = data.get("backends") if isinstance(data, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise BackendsError(f"{source}: expected a top-level 'backends:' list with at least one entry "
                            "(see backends.example.yaml).")
    base_env = settings.as_env()
    backends: list[Backend] = []
    next_port = settings.mlx_port
    seen_disk: set[tuple[str, str]] = set()
    for i, item in enumerate(entries):
        where = f"{source}, backend #{i + 1}"
        if not isinstance(item, Mapping):
            raise BackendsError(f"{where}: each entry must be a mapping (model_path: … or url: …).")
        unknown = sorted(set(map(str, item)) - ENTRY_KEYS)
        if unknown:
            raise BackendsError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(ENTRY_KEYS))}.")
        aliases = _aliases(item.get("aliases"), where)
        if "url" in item:
            backends.append(_remote(item, i, where, aliases, settings, environ))
            continue
        if "model" in item:
            raise BackendsError(f"{where}: 'model' is for remote backends; a local one says what it serves itself.")
        model_path = item.get("model_path", settings.model_path)
        if not isinstance(model_path, str):
            raise BackendsError(f"{where}: model_path must be a string (a folder, a Hugging Face repo id, or \"\").")
        replicas = _int(item.get("replicas", 1), where, "replicas", 1)
        port = _int(item.get("port", next_port), where, "port", 0)
        if port == 0 and replicas > 1:
            raise BackendsError(f"{where}: replicas need a fixed port (they use port, port+1, …), not 0.")
        overrides = _env_overrides(item.get("env"), where)
        key = overrides.get("MLX_API_KEY", settings.mlx_api_key)
        for r in range(replicas):
            env = {**base_env, **overrides, "MODEL_PATH": model_path, "MLX_PORT": str(port + r)}
            disk = env.get("DISK_CACHE_DIR", "auto").strip().lower()
            ident = (model_path, disk)
            if disk not in DISK_OFF:
                if ident in seen_disk:
                    env["DISK_CACHE_DIR"] = disk_dir_for_replica(env, port + r)
                seen_disk.add(ident)
            url = f"http://{_url_host(env.get('MLX_HOST', settings.mlx_host))}:{port + r}"
            backends.append(Backend(f"mlx:{port + r}", url, True, i, port + r, env, key, aliases))
        next_port = port + replicas
    return _checked(backends, settings, source)


def _remote(item: Mapping[str, Any], i: int, where: str, aliases: tuple[str, ...], settings: Settings,
            environ: Mapping[str, str]) -> Backend:
    extra = sorted({"model_path", "port", "replicas", "env"} & set(map(str, item)))
    if extra:
        raise BackendsError(f"{where}: {', '.join(extra)} only apply to local backends; a remote one is "
                            "configured on its own machine (its .env).")
    url = item["url"]
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or url.rstrip("/").count("/") != 2:
        raise BackendsError(f"{where}: url must look like http://host:port (no path), got {url!r}.")
    model = item.get("model", "")
    if not isinstance(model, str):
        raise BackendsError(f"{where}: model must be the model id the remote server lists in /v1/models.")
    key = _resolve_key(item.get("api_key", None), where, environ) if "api_key" in item else settings.mlx_api_key
    return Backend(f"remote:{url.split('://', 1)[1].rstrip('/')}", url.rstrip("/"), False, i, None, {}, key,
                   aliases, model)


def _checked(backends: list[Backend], settings: Settings, source: str) -> list[Backend]:
    ports = [b.port for b in backends if b.local]
    dup = sorted({p for p in ports if ports.count(p) > 1})
    if dup:
        raise BackendsError(f"{source}: port(s) {', '.join(map(str, dup))} are given to more than one local backend; "
                            "give each entry its own port range (port + replicas).")
    if settings.proxy_port in ports:
        raise BackendsError(f"{source}: port {settings.proxy_port} is PROXY_PORT (LiteLLM); move the backend or PROXY_PORT.")
    urls = [b.url for b in backends]
    same = sorted({u for u in urls if urls.count(u) > 1})
    if same:
        raise BackendsError(f"{source}: {', '.join(same)} is listed twice.")
    if len(backends) == 1 and backends[0].local:  # the single-backend stack keeps its old names
        return [dataclasses.replace(backends[0], name="mlx")]
    return backends


def replica_backends(settings: Settings) -> list[Backend]:
    """``MLX_REPLICAS`` local replicas of MODEL_PATH on MLX_PORT, MLX_PORT+1, … (no backends file)."""
    return parse_backends({"backends": [{"model_path": settings.model_path, "replicas": settings.mlx_replicas}]}, settings,
                          source=".env (MLX_REPLICAS)")


def load_backends(settings: Settings, repo: Path = REPO_ROOT, environ: Mapping[str, str] | None = None) -> list[Backend]:
    """The stack's backends: the backends file when it exists, else MLX_REPLICAS × MODEL_PATH."""
    path = backends_file_path(settings, repo)
    if not path.is_file():
        return replica_backends(settings)
    import yaml  # pyyaml comes with litellm[proxy]

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise BackendsError(f"{path}: cannot read it as YAML ({exc}).") from None
    if settings.mlx_replicas != 1:
        raise BackendsError(f"MLX_REPLICAS={settings.mlx_replicas} and {path} both say how many backends to run; "
                            "use 'replicas:' in the file (or remove the file).")
    return parse_backends(data, settings, environ, source=str(path))


# --- names -------------------------------------------------------------------------------------------
def model_groups(backends: list[Backend], discovered: Mapping[str, tuple[str, int | None] | None],
                 proxy_model_id: str = "") -> list[ModelGroup]:
    """One group per served model id, in the order their first backend is configured.

    Args:
        discovered: backend url -> (model id from its /v1/models, context window), None when it did
            not answer (a remote backend with ``model:`` set is listed under that id anyway).
        proxy_model_id: PROXY_MODEL_ID; renames the first group's prefixed name.

    Names: ``openai/<id>`` and ``<id>`` (as with one backend), then the aliases of every backend in
    the group. A name may belong to one group only.
    """
    order: list[str] = []
    members: dict[str, list[Backend]] = {}
    windows: dict[str, list[int]] = {}
    for b in backends:
        found = discovered.get(b.url)
        model_id = found[0] if found else b.model
        if not model_id:
            continue
        if model_id not in members:
            order.append(model_id)
            members[model_id], windows[model_id] = [], []
        members[model_id].append(b)
        if found and found[1]:
            windows[model_id].append(found[1])
    groups, owner = [], {}
    for n, model_id in enumerate(order):
        primary = (proxy_model_id.strip() if n == 0 and proxy_model_id.strip() else f"openai/{model_id}")
        names = list(dict.fromkeys([primary, model_id] + [a for b in members[model_id] for a in b.aliases]))
        for name in names:
            if name in owner and owner[name] != model_id:
                raise BackendsError(f"model name {name!r} is claimed by both {owner[name]} and {model_id}; "
                                    "rename an alias in the backends file.")
            owner[name] = model_id
        groups.append(ModelGroup(model_id, tuple(names), tuple(members[model_id]),
                                 min(windows[model_id]) if windows[model_id] else None))
    return groups
