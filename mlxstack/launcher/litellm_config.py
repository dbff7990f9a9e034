"""The LiteLLM proxy config start_llm.py generates for the MLX server behind it.

Choices below are the measured LiteLLM 1.106 behaviours from issue #2:
- ``hosted_vllm/`` provider: the ``openai/`` provider routes Anthropic ``/v1/messages`` requests
  carrying ``thinking`` to ``/v1/responses``, which our chat-completions server answers 404.
- ``num_retries: 0``: a retry re-runs a long prefill from scratch.
- ``forward_client_headers_to_llm_api``: passes ``x-*`` headers (e.g. ``x-session-affinity``)
  through to the MLX server's session cache.
- the master key is referenced (``os.environ/...``), never written into the file.
- ``/v1/messages`` and ``/v1/messages/count_tokens`` are LiteLLM pass-through endpoints to the MLX
  server's native Anthropic API: LiteLLM's Anthropic->chat adapter rewrites a
  ``role: "system"`` entry inside ``messages[]`` into a user turn and drops ``metadata``.
- ``model_info`` carries the served window (``max_input_tokens``) and a default output budget, which
  LiteLLM lists in /v1/models and /model/info, so clients size their budgets.
- cooldowns off: with one deployment there is nothing to fail over to, and one client's 4xx
  (measured: a 404) otherwise answers every client 429 for the cooldown period.
- MODEL_ALIASES: each pattern is one more ``model_name`` of its target's deployments; LiteLLM
  routes a name with ``*`` by pattern (router_utils/pattern_match_deployments.py: the longest
  pattern first) and sends the deployment's own ``hosted_vllm/<served id>``, so the MLX server sees
  its own name. On the one-backend ``/v1/messages`` pass-through the client's name reaches the MLX
  server as it is: its Anthropic endpoint accepts the patterns aimed at ``main``.
- the front door (mlxstack/routing/front_door.py) is a callback in every config: a wrong
  key is 401 (not LiteLLM's 400 "No connected db."), malformed bodies 400 (not 500). With one
  backend LiteLLM runs without the repository on its path, so ``write_config`` puts a two-line
  shim module next to the config (LiteLLM imports callbacks from the config's folder first).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxstack.config.settings import Settings, SettingsError, model_aliases

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
ANY_REPO = "*/*"        # MODELS_ON_DEMAND + MODEL_FETCH: a LiteLLM wildcard for every owner/name repo id


def model_name(settings: Settings) -> str:
    """Short model name: last path component of MODEL_PATH (folder or HF repo id)."""
    path = settings.model_path.strip().rstrip("/")
    return path.rsplit("/", 1)[-1] if path else EMBEDDED_MODEL_NAME


def proxy_model_names(settings: Settings) -> list[str]:
    """Names clients may ask LiteLLM for: PROXY_MODEL_ID (default openai/<name>) and the bare name."""
    bare = model_name(settings)
    primary = settings.proxy_model_id.strip() or f"openai/{bare}"
    return [primary] if primary == bare else [primary, bare]


def connect_host(host: str) -> str:
    """Where a local client reaches a server bound to ``host`` (wildcards → loopback)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def url_host(host: str) -> str:
    host = connect_host(host)
    return f"[{host}]" if ":" in host else host


def mlx_base_url(settings: Settings) -> str:
    return f"http://{url_host(settings.mlx_host)}:{settings.mlx_port}"


def proxy_base_url(settings: Settings) -> str:
    return f"http://{url_host(settings.proxy_host)}:{settings.proxy_port}"


ANTHROPIC_PASS_THROUGH_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def served_models(settings: Settings, timeout: float = 2.0) -> list[tuple[str, int | None]]:
    """(id, context window or None) of every model the MLX port lists on /v1/models, in its order
    ([] when it does not answer)."""
    import json
    import urllib.request

    try:
        key = getattr(settings, "mlx_api_key", "")
        req = urllib.request.Request(f"{mlx_base_url(settings)}/v1/models",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.load(resp)["data"]
        out = []
        for item in data:
            value = item.get("context_length")
            out.append((str(item["id"]), value if isinstance(value, int) and value > 0 else None))
        return out
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return []


def served_context_window(settings: Settings, timeout: float = 2.0) -> int | None:
    """The MLX server's context window from its /v1/models (None when it does not answer)."""
    listed = served_models(settings, timeout)
    return listed[0][1] if listed else None


def model_info(settings: Settings, context_window: int | None) -> dict[str, Any]:
    info: dict[str, Any] = {"supports_reasoning": False}
    if context_window:
        budget = min(settings.default_max_tokens, context_window)
        info.update(max_input_tokens=context_window, max_output_tokens=budget, max_tokens=budget)
    return info


def pass_through_endpoints(settings: Settings) -> list[dict[str, Any]]:
    """auth: the master key is checked as on every route; forward_headers carries
    x-claude-code-session-id (the session) to the MLX server. With MLX_API_KEY set, the configured
    Authorization header replaces the client's (measured on 1.106.2: it wins over forwarded ones)."""
    entries = []
    for path in ANTHROPIC_PASS_THROUGH_PATHS:
        entry: dict[str, Any] = {"path": path, "target": f"{mlx_base_url(settings)}{path}", "forward_headers": True,
                                 "auth": True}
        if getattr(settings, "mlx_api_key", ""):
            entry["headers"] = {"Authorization": "Bearer os.environ/MLX_API_KEY"}
        entries.append(entry)
    return entries


FRONT_DOOR_HOOK = "mlxstack.routing.front_door.front_door"
FRONT_DOOR_SHIM = "mlxstack_front_door"        # module written next to the one-backend config
REPO = Path(__file__).resolve().parents[2]


def front_door_shim(repo: Path = REPO) -> str:
    """The shim module's text: the repository on sys.path, then the real front door."""
    return ("# Generated by start_llm.py next to litellm_config.yaml: LiteLLM imports its callbacks from\n"
            "# here first; this puts the repository on sys.path for mlxstack/routing/front_door.py.\n"
            "import sys\n\n"
            f"if {str(repo)!r} not in sys.path:\n"
            f"    sys.path.insert(0, {str(repo)!r})\n"
            "from mlxstack.routing.front_door import front_door  # noqa: E402,F401\n")


def build_config(settings: Settings, served_model_id: str, context_window: int | None = None,
                 others: tuple[tuple[str, int | None], ...] = ()) -> dict[str, Any]:
    """One MLX port. ``others``: (name, context window) of every further model it serves
    (MODELS_ON_DEMAND's router), each a model group of its own under its name."""
    timeout = float(settings.proxy_request_timeout_seconds)
    params = {
        "model": f"hosted_vllm/{served_model_id}",
        "api_base": f"{mlx_base_url(settings)}/v1",
        # The MLX server requires this key when MLX_API_KEY is set; referenced, never written here.
        "api_key": "os.environ/MLX_API_KEY" if getattr(settings, "mlx_api_key", "") else "none",
        "timeout": timeout,
        "stream_timeout": timeout,
    }
    names = proxy_model_names(settings)
    others = tuple((name, ctx) for name, ctx in others if name not in (*names, served_model_id))
    patterns = alias_patterns(settings, {"main": names[0], **{name: names[0] for name in (*names, served_model_id)},
                                         **{name: name for name, _ in others}})
    main = {"litellm_params": params, "model_info": model_info(settings, context_window)}
    by_target = {name: {"litellm_params": {**params, "model": f"hosted_vllm/{name}"},
                        "model_info": model_info(settings, ctx)} for name, ctx in others}
    listed = [(name, main) for name in names] + [(name, by_target[name]) for name, _ in others]
    listed += [(pattern, by_target.get(target, main)) for pattern, target in patterns.items()]
    if settings.models_on_demand and settings.model_fetch:     # any repo id: the router fetches it
        listed.append((ANY_REPO, {"litellm_params": {**params, "model": "hosted_vllm/*/*"},
                                  "model_info": model_info(settings, None)}))
    return {
        "model_list": [
            {"model_name": name, "litellm_params": dict(d["litellm_params"]), "model_info": dict(d["model_info"])}
            for name, d in listed
        ],
        "litellm_settings": {
            "num_retries": 0,
            "drop_params": True,
            "request_timeout": timeout,
            "callbacks": [f"{FRONT_DOOR_SHIM}.front_door"],
        },
        # A general_settings key in 1.106 (litellm_pre_call_utils reads it there; under
        # litellm_settings it is silently ignored and x-session-affinity never reaches us).
        "general_settings": {
            "master_key": "os.environ/LITELLM_MASTER_KEY",
            "forward_client_headers_to_llm_api": True,
            "pass_through_endpoints": pass_through_endpoints(settings),
        },
        "router_settings": {"disable_cooldowns": True},
    }


def alias_patterns(settings: Settings, targets: dict[str, str]) -> dict[str, str]:
    """MODEL_ALIASES as {pattern: the model name it routes to}; ``targets``: every name a target may
    give (``main`` and the names LiteLLM lists) -> its model. SettingsError for a target that names
    nothing here, listing what does; a pattern that is already a listed name is left out."""
    out: dict[str, str] = {}
    for pattern, target in model_aliases(settings.model_aliases):
        if target not in targets:
            known = ", ".join(sorted(targets))
            raise SettingsError(f"MODEL_ALIASES: {pattern}={target}: no model named {target!r} here (targets: {known}; "
                                "a second model is a backends-file entry, BACKENDS_FILE).")
        if pattern not in targets and pattern not in out:
            out[pattern] = targets[target]
    return out


def render_yaml(config: dict[str, Any]) -> str:
    import yaml  # pyyaml comes with litellm[proxy]

    header = "# Generated by start_llm.py on every start; edits are overwritten.\n"
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def write_config(settings: Settings, served_model_id: str, path: Path, context_window: int | None = None,
                 others: tuple[tuple[str, int | None], ...] = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_yaml(build_config(settings, served_model_id, context_window, others)))
    (path.parent / f"{FRONT_DOOR_SHIM}.py").write_text(front_door_shim())
    return path


# --- several backends (BACKENDS_FILE) ------------------------------------------------------------
ROUTING_HOOK = "mlxstack.routing.litellm_hook.routing_hook"
# One retry where it cannot repeat work on the same backend. Measured on 1.106.2: a refused
# connection (backend down) arrives as InternalServerError ("Cannot connect to host"), the same
# class as a 500 after a long prefill, and a timeout may also follow one. The cache_aware hook
# sends a retry to a backend the request has not tried, so there a 500 is retried; with
# LiteLLM's own placement (affinity / shuffle) a retry may land on the same backend, so only
# 503s (queue full, still loading: nothing ran) are retried.
RETRY_POLICY = {"DefaultRetries": 1, "ServiceUnavailableErrorRetries": 1, "InternalServerErrorRetries": 0,
                "TimeoutErrorRetries": 0, "BadRequestErrorRetries": 0, "AuthenticationErrorRetries": 0,
                "NotFoundErrorRetries": 0, "RateLimitErrorRetries": 0, "ContentPolicyViolationErrorRetries": 0}


def backend_key_refs(settings: Settings, backends: list) -> tuple[dict[str, str], dict[str, str]]:
    """(backend url -> api_key value for LiteLLM's config, env vars LiteLLM needs for them).

    Keys are never written into the config: the stack-wide MLX_API_KEY is referenced as
    ``os.environ/MLX_API_KEY``; a backend with its own key gets ``MLXSTACK_BACKEND_KEY_<n>``."""
    refs, env = {}, {}
    for n, backend in enumerate(backends):
        key = backend.api_key
        if not key:
            refs[backend.url] = "none"
        elif key == settings.mlx_api_key:
            refs[backend.url] = "os.environ/MLX_API_KEY"
        else:
            name = f"MLXSTACK_BACKEND_KEY_{n}"
            env[name] = key
            refs[backend.url] = f"os.environ/{name}"
    return refs, env


def build_stack_config(settings: Settings, groups: list) -> dict[str, Any]:
    """LiteLLM config for several backends: every backend a deployment of its model group, under
    every name of the group; ROUTING chooses how requests are placed among a group's backends.

    /v1/messages is not a pass-through here (a pass-through has one fixed target): LiteLLM's own
    Anthropic endpoint routes it by ``model`` like every other request."""
    timeout = float(settings.proxy_request_timeout_seconds)
    refs, _ = backend_key_refs(settings, [b for g in groups for b in g.backends])
    model_list = []
    by_name = {name: group.names[0] for group in groups for name in (*group.names, group.model_id)}
    patterns = alias_patterns(settings, {"main": groups[0].names[0], **by_name}) if groups else {}
    for group in groups:
        info = model_info(settings, group.context_window)
        for name in (*group.names, *[p for p, target in patterns.items() if target == group.names[0]]):
            for backend in group.backends:
                model_list.append({
                    "model_name": name,
                    "litellm_params": {"model": f"hosted_vllm/{group.model_id}", "api_base": f"{backend.url}/v1",
                                       "api_key": refs[backend.url], "timeout": timeout, "stream_timeout": timeout},
                    "model_info": {**info, "mlx_backend": backend.url},
                })
    litellm_settings: dict[str, Any] = {"num_retries": 0, "drop_params": True, "request_timeout": timeout,
                                        "callbacks": [FRONT_DOOR_HOOK]}
    router: dict[str, Any] = {"retry_policy": dict(RETRY_POLICY)}
    if settings.routing == "cache_aware":
        # The hook picks one backend and judges liveness itself; LiteLLM's cooldowns would move every
        # session of a backend after one client's 4xx (measured with one backend: a 404).
        litellm_settings["callbacks"].append(ROUTING_HOOK)
        router.update(routing_strategy="simple-shuffle", disable_cooldowns=True)
        router["retry_policy"]["InternalServerErrorRetries"] = 1
    elif settings.routing == "affinity":
        litellm_settings["callbacks"].append(ROUTING_HOOK)  # writes the derived session id where LiteLLM reads it
        router.update(routing_strategy="least-busy", optional_pre_call_checks=["session_affinity"],
                      deployment_affinity_ttl_seconds=int(settings.routing_affinity_ttl_seconds))
    else:
        router.update(routing_strategy="simple-shuffle")
    return {
        "model_list": model_list,
        "litellm_settings": litellm_settings,
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY", "forward_client_headers_to_llm_api": True},
        "router_settings": router,
    }


def write_stack_config(settings: Settings, groups: list, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_yaml(build_stack_config(settings, groups)))
    return path
