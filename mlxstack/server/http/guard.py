"""Who may talk to the MLX server: Host, Origin, Content-Type and API-key checks (pure functions).

A web page the user visits can reach 127.0.0.1:8080 too: a cross-site ``fetch`` POST carries an
``Origin`` header, and DNS rebinding (attacker.example resolving to 127.0.0.1) carries the
attacker's name in ``Host``. Both are refused here, before any route runs.

    guard = Guard.from_settings(settings)
    err = guard.check("POST", "/v1/chat/completions", headers, peer="127.0.0.1")   # APIError | None

Decisions (README "Security model"):
- Host: IP literals always pass (rebinding needs a DNS name the attacker controls), as do
  ``localhost``, MLX_HOST and MLX_ALLOWED_HOSTS; anything else is 403. No Host header passes
  (browsers always send one).
- Origin: absent passes (not a browser, or a same-origin GET); the server's own origin and
  MLX_ALLOWED_ORIGINS pass; anything else (``null`` included) is 403.
- MLX_API_KEY set: ``Authorization: Bearer <key>`` on every route except ``/health``; the
  read-only observability pages (``/metrics``, ``/dashboard``, ``/v1/cache/stats``: numbers,
  never prompt text) are also open to loopback peers, because a browser tab cannot attach a key.
- POST bodies must be ``application/json`` (415): an HTML form cannot send that cross-site
  without a CORS preflight, which this server never grants.
"""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit

from ...cache.summary import TENANT_HEADER, verify_tenant
from .errors import APIError, forbidden, unauthorized, unsupported_media_type

OPEN_PATHS = frozenset({"/health"})
LOOPBACK_OPEN_PREFIXES = ("/metrics", "/dashboard", "/v1/cache/stats")
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


def split_list(value: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c') (settings hold comma-separated lists)."""
    return tuple(x.strip() for x in value.split(",") if x.strip())


def host_name(host_header: str) -> str:
    """The name part of a Host header, lower-case, without port, brackets or a trailing dot."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value[:-1] if value.endswith(".") else value


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%", 1)[0])  # an IPv6 zone id is not part of the address
    except ValueError:
        return False
    return True


def is_loopback_address(host: str) -> bool:
    """True for a bind or peer address reachable only from this machine."""
    name = host_name(host) if host.startswith("[") else host.strip().lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def host_allowed(host_header: str | None, allowed: frozenset[str]) -> bool:
    if host_header is None:
        return True
    name = host_name(host_header)
    return is_ip_literal(name) or name in _LOOPBACK_NAMES or name in allowed


def normalise_origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


def origin_allowed(origin: str | None, host_header: str | None, allowed: frozenset[str]) -> bool:
    """Absent, same-origin (``http://<Host>``) or configured origins pass; ``null`` never does."""
    if origin is None:
        return True
    value = normalise_origin(origin)
    if value in allowed:
        return True
    parts = urlsplit(value)
    return (host_header is not None and parts.scheme in ("http", "https")
            and parts.netloc == host_header.strip().lower())


def is_json_content_type(value: str | None) -> bool:
    """``application/json`` with optional parameters (``; charset=utf-8``)."""
    if not value:
        return False
    return value.split(";", 1)[0].strip().lower() == "application/json"


def bearer_token(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_matches(given: str | None, key: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


@dataclass(frozen=True)
class Guard:
    api_key: str = ""
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()

    @classmethod
    def from_settings(cls, settings: Any) -> "Guard":
        hosts = {host_name(h) for h in split_list(settings.mlx_allowed_hosts)}
        bound = host_name(settings.mlx_host) if settings.mlx_host.startswith("[") else settings.mlx_host.strip().lower()
        if bound not in _WILDCARDS:
            hosts.add(bound)
        return cls(api_key=settings.mlx_api_key,
                   allowed_hosts=frozenset(hosts),
                   allowed_origins=frozenset(normalise_origin(o) for o in split_list(settings.mlx_allowed_origins)))

    def check(self, method: str, path: str, headers: Mapping[str, str], peer: str) -> APIError | None:
        """The first reason to refuse this request, or None. ``headers`` keys are lower-case."""
        host = headers.get("host")
        if not host_allowed(host, self.allowed_hosts):
            return forbidden(f"Host {host[:100]!r} is not allowed on this server; add the name to MLX_ALLOWED_HOSTS "
                             "if you reach the server through it", code="host_not_allowed")
        origin = headers.get("origin")
        if not origin_allowed(origin, host, self.allowed_origins):
            return forbidden(f"Origin {origin[:100]!r} is not allowed (cross-site request); add it to "
                             "MLX_ALLOWED_ORIGINS to let that web page call this server", code="origin_not_allowed")
        if self.api_key and not self._authorised(method, path, headers, peer):
            return unauthorized("missing or wrong API key: send 'Authorization: Bearer <MLX_API_KEY from .env>'")
        claimed = headers.get(TENANT_HEADER)
        if self.api_key and claimed is not None and verify_tenant(claimed, self.api_key) is None:
            return forbidden(f"the {TENANT_HEADER} header is set only by the front door of port 4000, signed with "
                             "MLX_API_KEY; this one is not signed by it", code="tenant_not_signed")
        if method == "POST" and not is_json_content_type(headers.get("content-type")):
            return unsupported_media_type("POST bodies must be sent with 'Content-Type: application/json'")
        return None

    def _authorised(self, method: str, path: str, headers: Mapping[str, str], peer: str) -> bool:
        if path in OPEN_PATHS:
            return True
        if method == "GET" and is_loopback_address(peer) and any(
                path == p or path.startswith(p + "/") for p in LOOPBACK_OPEN_PREFIXES):
            return True
        return key_matches(bearer_token(headers.get("authorization")), self.api_key)


def bind_refusal(host: str, api_key: str) -> str | None:
    """Why the server must not start on ``host`` (a message), or None when it may."""
    if api_key or is_loopback_address(host):
        return None
    shown = host or "(all addresses)"
    return (f"MLX_HOST={shown} exposes the MLX server beyond this machine, but MLX_API_KEY is empty: anyone on the "
            "network could use the model. Set MLX_API_KEY in .env (python3 install_and_run.py generates one), "
            "or bind MLX_HOST=127.0.0.1.")
