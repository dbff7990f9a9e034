"""Remote image fetches (ALLOW_REMOTE_IMAGE_URLS=true), done on the HTTP handler thread.

    messages = prepare_request_images(messages, limits)   # http(s) parts -> data: URLs, headers checked

Why here and not in prompt/images.py: a fetch is network I/O with timeouts; done by the
inference worker, a slow host stalled every other request. The handler thread fetches, replaces
each remote URL with a ``data:`` URL of the fetched bytes, checks every image's header (format,
pixel budget) and only then queues the job.

SSRF rules (the server must not become a way into the user's network):
- http and https only; at most MAX_REDIRECTS redirects, each re-checked like the first URL;
- the host name is resolved here and *every* address must be public: private, loopback,
  link-local, multicast, reserved, unspecified and shared (CGNAT) ranges are refused, including
  IPv4 inside IPv6 (mapped, 6to4, Teredo);
- the connection goes to the vetted IP itself (TLS still verifies the name), so a DNS answer
  that changes between the check and the connect (rebinding) cannot redirect it;
- one deadline (REMOTE_IMAGE_TIMEOUT_SECONDS) covers resolving, connecting, redirects and
  reading, for all of a request's images together;
- connection failures, timeouts, early closes and HTTP errors all read the same, so error text
  cannot be used to scan ports.
"""
from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable, Sequence
from urllib.parse import urljoin, urlsplit

from ...prompt.images import (ImageError, ImageLimits, check_images, data_url_for, image_part_url, image_parts,
                              is_remote_url)

log = logging.getLogger("mlxstack.images")

MAX_REDIRECTS = 3
REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
FETCH_FAILED = ("could not fetch the remote image (connection failed, timed out, was closed, or the server "
                "answered with an error); send the image inline as a data:image/...;base64,... URL")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if ip.teredo is not None:
            return ip.teredo[1]
    return None


def is_public_address(ip: IPAddress) -> bool:
    """True only for a globally routable unicast address (the default fetch policy). An IPv6
    address carrying an IPv4 one (mapped, 6to4, Teredo) is judged by the IPv4 address it reaches."""
    addr = _embedded_ipv4(ip) or ip
    return not (not addr.is_global or addr.is_private or addr.is_loopback or addr.is_link_local
                or addr.is_multicast or addr.is_reserved or addr.is_unspecified)


def resolve_host(host: str, port: int, timeout: float) -> list[str]:
    """Every address ``host`` resolves to, within ``timeout`` (getaddrinfo has no timeout of its own)."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            result.append(exc)

    t = threading.Thread(target=run, name="image-dns", daemon=True)
    t.start()
    t.join(timeout)
    if not result or isinstance(result[0], Exception):
        raise OSError("name resolution failed or timed out")
    return list(dict.fromkeys(info[4][0] for info in result[0]))


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a fixed IP while verifying the certificate against the URL's host name."""

    def __init__(self, ip: str, port: int, server_name: str, timeout: float) -> None:
        super().__init__(ip, port, timeout=timeout, context=ssl.create_default_context())
        self._server_name = server_name

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self._server_name)


class RemoteImageFetcher:
    """GETs images under the SSRF rules above. ``address_allowed`` and ``resolve`` are parameters
    so tests can aim it at a local server; production uses the defaults."""

    def __init__(self, max_bytes: int, timeout: float, *, max_redirects: int = MAX_REDIRECTS,
                 address_allowed: Callable[[IPAddress], bool] = is_public_address,
                 resolve: Callable[[str, int, float], list[str]] = resolve_host) -> None:
        self.max_bytes = max_bytes
        self.deadline = time.monotonic() + timeout
        self.max_redirects = max_redirects
        self.address_allowed = address_allowed
        self.resolve = resolve

    def _remaining(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("remote image deadline passed")
        return remaining

    def fetch(self, url: str) -> bytes:
        for _ in range(self.max_redirects + 1):
            parts = self._check_url(url)
            ips = self._vetted_addresses(parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
            status, location, data = self._get(parts, ips)
            if status in REDIRECT_CODES:
                if not location:
                    raise ImageError(FETCH_FAILED)
                url = urljoin(url, location)
                continue
            return data
        raise ImageError(f"remote image URL redirected more than {self.max_redirects} times")

    @staticmethod
    def _check_url(url: str) -> Any:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError for a malformed port
        except ValueError:
            raise ImageError("remote image URL is malformed") from None
        if parts.scheme not in ("http", "https"):
            raise ImageError(f"remote image URLs must be http(s), not {parts.scheme or 'a bare path'}: "
                             "(redirects included)")
        if not parts.hostname:
            raise ImageError("remote image URL has no host")
        return parts

    def _vetted_addresses(self, host: str, port: int) -> list[tuple[str, int]]:
        try:
            literal = ipaddress.ip_address(host)
            addresses = [str(literal)]
        except ValueError:
            try:
                addresses = self.resolve(host, port, self._remaining())
            except (OSError, TimeoutError):
                raise ImageError(FETCH_FAILED) from None
        ips = [ipaddress.ip_address(a.split("%", 1)[0]) for a in addresses]
        if not ips:
            raise ImageError(FETCH_FAILED)
        if not all(self.address_allowed(ip) for ip in ips):
            raise ImageError("remote image host is not a public address (private, loopback, link-local and "
                             "reserved addresses are refused); send the image inline as a data: URL")
        return [(str(ip), port) for ip in ips]

    def _get(self, parts: Any, ips: Sequence[tuple[str, int]]) -> tuple[int, str | None, bytes]:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        netloc = parts.netloc.rsplit("@", 1)[-1]  # never forward URL credentials
        try:
            conn = self._connect(parts, ips)
            try:
                conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
                for name, value in (("Host", netloc), ("User-Agent", "mlxstack"), ("Accept", "image/*"),
                                    ("Connection", "close")):
                    conn.putheader(name, value)
                conn.endheaders()
                sock = conn.sock  # getresponse() hands the socket to the response and clears conn.sock
                sock.settimeout(self._remaining())
                resp = conn.getresponse()
                if resp.status in REDIRECT_CODES:
                    return resp.status, resp.getheader("Location"), b""
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
                return resp.status, None, self._read(sock, resp)
            finally:
                conn.close()
        except ImageError:
            raise
        except (OSError, TimeoutError, http.client.HTTPException, ssl.SSLError) as exc:
            log.info("remote image fetch failed: %s: %s", type(exc).__name__, exc)
            raise ImageError(FETCH_FAILED) from None

    def _connect(self, parts: Any, ips: Sequence[tuple[str, int]]) -> http.client.HTTPConnection:
        last: Exception = OSError("no address")
        for ip, port in ips:
            timeout = self._remaining()
            conn = (_PinnedHTTPS(ip, port, parts.hostname, timeout) if parts.scheme == "https"
                    else http.client.HTTPConnection(ip, port, timeout=timeout))
            try:
                conn.connect()
                return conn
            except OSError as exc:
                conn.close()
                last = exc
        raise last

    def _read(self, sock: socket.socket, resp: http.client.HTTPResponse) -> bytes:
        length = resp.getheader("Content-Length")
        if length and length.strip().isdigit() and int(length) > self.max_bytes:
            raise ImageError(f"remote image of {int(length)} bytes exceeds MAX_IMAGE_BYTES={self.max_bytes}")
        chunks: list[bytes] = []
        size = 0
        while True:
            sock.settimeout(self._remaining())
            chunk = resp.read1(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > self.max_bytes:
                raise ImageError(f"remote image exceeds MAX_IMAGE_BYTES={self.max_bytes}")
            chunks.append(chunk)
        if not size:
            raise OSError("empty body")
        return b"".join(chunks)


def prepare_request_images(messages: list[dict], limits: ImageLimits,
                           fetcher: RemoteImageFetcher | None = None) -> list[dict]:
    """Messages with every remote image replaced by a ``data:`` URL of its bytes, after checking
    every image's header (format and pixel budgets). Input messages are not modified."""
    found = image_parts(messages)
    if not found:
        return messages
    out = list(messages)
    for i, j, part in found:
        where = f"messages[{i}].content[{j}]"
        try:
            url = image_part_url(part)
        except ImageError as exc:
            raise ImageError(f"{where}: {exc}") from None
        if not (limits.allow_remote and is_remote_url(url)):
            continue  # data: URLs as they are; other schemes are refused by check_images below
        if fetcher is None:
            fetcher = RemoteImageFetcher(limits.max_bytes, limits.remote_timeout)
        try:
            data = fetcher.fetch(url)
        except ImageError as exc:
            raise ImageError(f"{where}: {exc}") from None
        new_part = {k: v for k, v in part.items() if k != "image"}
        new_part["image_url"] = {"url": data_url_for(data)}
        if out[i] is messages[i]:
            out[i] = {**messages[i], "content": list(messages[i]["content"])}
        out[i]["content"][j] = new_part
    check_images(out, limits)
    return out
