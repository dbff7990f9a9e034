"""Configuration lookup (.env / environment) and the streaming HTTP client with TTFT."""
from __future__ import annotations


import json
import os
import random
import re
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator


REPO_ROOT = Path(__file__).resolve().parents[2]   # scripts/probelib/x.py -> the repository
DEFAULT_PROXY_URL = "http://127.0.0.1:4000/v1"
DEFAULT_MLX_URL = "http://127.0.0.1:8080"
EMBEDDED_MODEL_DIR = "SmolLM2-135M-Instruct-f32"



# ----------------------------------------------------------------------------- config helpers
def read_dotenv(path: Path | None = None) -> dict[str, str]:
    """Minimal .env reader (KEY=VALUE, optional quotes, # comments); missing file -> {}."""
    path = path or REPO_ROOT / ".env"
    out: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        key = key.strip()
        if key.startswith("export "):
            key = key[7:].strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].strip()
        out[key] = value
    return out


def setting(name: str, default: str = "") -> str:
    """Environment first, then the repo's .env."""
    if os.environ.get(name):
        return os.environ[name]
    return read_dotenv().get(name, default)


def default_api_key() -> str:
    return setting("LITELLM_MASTER_KEY", "")


def default_mlx_url() -> str:
    host = setting("MLX_HOST", "127.0.0.1") or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{host}:{setting('MLX_PORT', '8080') or '8080'}"


def add_client_args(parser: Any, *, default_base: str = DEFAULT_PROXY_URL, max_tokens: int = 16) -> None:
    parser.add_argument("--base-url", default=default_base,
                        help=f"OpenAI-compatible base URL ending in /v1 (default {default_base}; the MLX "
                             "server directly is http://127.0.0.1:8080/v1)")
    parser.add_argument("--api-key", default=None,
                        help="Bearer key (default: $LITELLM_MASTER_KEY or the repo's .env)")
    parser.add_argument("--model", default=None,
                        help="model name (default: the first id from GET <base-url>/models)")
    parser.add_argument("--stats-url", default=None,
                        help="MLX server /v1/cache/stats URL for match types (default: <base-url>/cache/stats, "
                             "falling back to http://MLX_HOST:MLX_PORT/v1/cache/stats)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"max_tokens per request (default {max_tokens})")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests (TTFT then = total time)")


def client_from_args(args: Any) -> Client:
    key = args.api_key if args.api_key is not None else default_api_key()
    return Client(args.base_url, key, model=args.model, stats_url=args.stats_url, timeout=args.timeout,
                  stream=not getattr(args, "no_stream", False))


def sse_data(resp: Any) -> Iterator[str]:
    """The ``data:`` payloads of an OpenAI-style event stream, in order, up to ``[DONE]``."""
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield payload


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, first_run: int = 1) -> list[int]:
    """``n`` distinct ports nothing listens on right now, all bound at once and then released
    (separate free_port() calls may return the same port twice). The first one also has the
    ``first_run - 1`` ports after it free and unused by the others (replicas take port, port+1, ...)."""
    for _ in range(100):
        socks = [socket.socket() for _ in range(n)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        run = [ports[0] + k for k in range(1, first_run)]
        if all(p < 65536 and p not in ports and _bindable(p) for p in run):
            return ports
    raise RuntimeError(f"no {n} free ports with a run of {first_run}")


def nonce(n: int = 8) -> str:
    return "".join(random.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))


# ----------------------------------------------------------------------------- HTTP client
class ProbeError(RuntimeError):
    pass


@dataclass
class ChatResult:
    id: str = ""
    text: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    ttft_s: float = 0.0
    total_s: float = 0.0
    status: int = 200
    chunks: int = 0

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") or {}
        val = details.get("cached_tokens") if isinstance(details, dict) else None
        if val is None:
            val = self.usage.get("cached_tokens", 0)  # some proxies flatten it
        return int(val or 0)

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_id(self) -> str:
        # mlxstack ids are "chatcmpl-<20 hex>" whose last 12 hex are the server's request id.
        m = re.search(r"([0-9a-f]{12})$", self.id or "")
        return m.group(1) if m else ""


class Client:
    def __init__(self, base_url: str, api_key: str = "", *, model: str | None = None, stats_url: str | None = None,
                 timeout: float = 600.0, stream: bool = True) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key or ""
        self._model = model
        self._stats_url = stats_url
        self._stats_ok: bool | None = None if stats_url is None else True
        self.timeout = timeout
        self.stream = stream

    # -- plumbing
    def _headers(self, extra: dict | None = None) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(extra or {})
        return h

    def get_json(self, url: str, timeout: float = 10.0) -> Any:
        req = urllib.request.Request(url, headers=self._headers())
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp)

    @property
    def model(self) -> str:
        if not self._model:
            try:
                data = self.get_json(self.base_url + "/models").get("data") or []
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise ProbeError(f"GET {self.base_url}/models failed ({exc}); pass --model") from exc
            ids = [d.get("id") for d in data if isinstance(d, dict) and d.get("id")]
            self._model = ids[0] if ids else "default_model"
        return self._model

    # -- stats
    def _stats_candidates(self) -> list[str]:
        root = re.sub(r"/v1$", "", self.base_url)
        cands = [root + "/v1/cache/stats"]
        mlx = default_mlx_url() + "/v1/cache/stats"
        if mlx not in cands:
            cands.append(mlx)
        return cands

    def cache_stats(self) -> dict | None:
        """The MLX server's /v1/cache/stats JSON, or None when no stats endpoint answers."""
        if self._stats_ok is False:
            return None
        urls = [self._stats_url] if self._stats_url else self._stats_candidates()
        for url in urls:
            try:
                data = self.get_json(url, timeout=10)
            except (urllib.error.URLError, OSError, ValueError):
                continue
            if isinstance(data, dict) and ("recent" in data or "entries" in data):
                self._stats_url, self._stats_ok = url, True
                return data
        self._stats_ok = False
        return None

    def recent_ids(self) -> set[str]:
        stats = self.cache_stats() or {}
        return {str(r.get("request_id")) for r in stats.get("recent") or [] if isinstance(r, dict)}

    def stats_row(self, result: ChatResult, before: set[str] | None = None) -> dict | None:
        """This request's row in /v1/cache/stats ``recent``: by request id, else the newest new row."""
        stats = self.cache_stats()
        if not stats:
            return None
        rows = [r for r in stats.get("recent") or [] if isinstance(r, dict)]
        rid = result.request_id
        for r in reversed(rows):
            if rid and str(r.get("request_id")) == rid:
                return r
        if before is not None:
            new = [r for r in rows if str(r.get("request_id")) not in before]
            if new:
                return new[-1]
        return None

    # -- chat
    def chat(self, messages: list[dict], *, tools: list | None = None, max_tokens: int = 16,
             temperature: float = 0.0, session_id: str | None = None, headers: dict | None = None,
             extra: dict | None = None, stream: bool | None = None, model: str | None = None) -> ChatResult:
        body: dict[str, Any] = {"model": model or self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature}
        if tools:
            body["tools"] = tools
        if session_id:
            body["session_id"] = session_id
        body.update(extra or {})
        stream = self.stream if stream is None else stream
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + "/chat/completions", data=data, headers=self._headers(headers))
        out = ChatResult()
        t0 = time.perf_counter()
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", "replace")[:2000]
            raise ProbeError(f"HTTP {exc.code} from {self.base_url}/chat/completions: {detail}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ProbeError(f"request to {self.base_url}/chat/completions failed: {exc}") from exc
        with resp:
            out.status = resp.status
            if not stream:
                payload = json.load(resp)
                out.total_s = out.ttft_s = time.perf_counter() - t0
                out.id = payload.get("id", "")
                out.usage = payload.get("usage") or {}
                choice = (payload.get("choices") or [{}])[0]
                msg = choice.get("message") or {}
                out.text = msg.get("content") or ""
                out.reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
                out.tool_calls = msg.get("tool_calls") or []
                out.finish_reason = choice.get("finish_reason")
                return out
            calls: dict[int, dict] = {}
            for chunk in sse_data(resp):
                try:
                    obj = json.loads(chunk)
                except ValueError:
                    continue
                if "error" in obj and not obj.get("choices"):
                    raise ProbeError(f"stream error: {json.dumps(obj)[:1000]}")
                out.chunks += 1
                out.id = out.id or obj.get("id", "")
                if obj.get("usage"):
                    out.usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    delta = ch.get("delta") or {}
                    piece = delta.get("content") or ""
                    rpiece = delta.get("reasoning_content") or delta.get("reasoning") or ""
                    if (piece or rpiece or delta.get("tool_calls")) and not out.ttft_s:
                        out.ttft_s = time.perf_counter() - t0
                    out.text += piece
                    out.reasoning += rpiece
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(int(tc.get("index", len(calls))),
                                                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                        slot["id"] = tc.get("id") or slot["id"]
                        fn = tc.get("function") or {}
                        slot["function"]["name"] += fn.get("name") or ""
                        slot["function"]["arguments"] += fn.get("arguments") or ""
                    if ch.get("finish_reason"):
                        out.finish_reason = ch["finish_reason"]
            out.tool_calls = [calls[i] for i in sorted(calls)]
        out.total_s = time.perf_counter() - t0
        if not out.ttft_s:
            out.ttft_s = out.total_s
        return out


