"""server/common/image_fetch.py: remote images under SSRF rules, against real local HTTP servers (issue 10, item 7).

The production policy refuses loopback, so tests that need a successful fetch pass an
``address_allowed`` that admits exactly 127.0.0.1 (the test server); the default policy is tested
as a pure function and by showing it never connects to a loopback server.
"""
from __future__ import annotations

import base64
import io
import ipaddress
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from mlxstack.server.common.image_fetch import (
    FETCH_FAILED,
    RemoteImageFetcher,
    is_public_address,
    prepare_request_images,
)
from mlxstack.prompt.images import ImageError, ImageLimits, decode_data_url
from tests.conftest import unused_port


def png(size=(12, 8), colour=(200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


PNG = png()


class ImageServer:
    """A real HTTP server recording every request it gets."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: list[tuple[str, str]] = []
        server = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):  # noqa: ANN002
                pass

            def do_GET(self):  # noqa: N802
                server.requests.append((self.path, self.headers.get("Host", "")))
                route = self.path.split("?", 1)[0]
                if route == "/img.png":
                    self._send(200, PNG)
                elif route == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", self.path.split("to=", 1)[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif route == "/slow":
                    time.sleep(3)
                    self._send(200, PNG)
                elif route == "/trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    for _ in range(100):
                        self.wfile.write(b"\x89")
                        self.wfile.flush()
                        time.sleep(0.1)
                elif route == "/huge":
                    self.send_response(200)
                    self.send_header("Content-Length", str(10**9))
                    self.end_headers()
                elif route == "/chunked-big":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for _ in range(20):
                        self.wfile.write(b"1000\r\n" + b"A" * 4096 + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                elif route == "/close":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                else:
                    self._send(404, b"no")

            def _send(self, status, body):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((host, 0), H)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *a: None  # our client hanging up mid-trickle is the point
        self.port = self.httpd.server_address[1]
        self.base = f"http://{host}:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def images():
    server = ImageServer()
    yield server
    server.close()


LOCAL = ipaddress.ip_address("127.0.0.1")


def local_only(ip) -> bool:
    return ip == LOCAL


def fetcher(timeout=5.0, max_bytes=1_000_000, **kw) -> RemoteImageFetcher:
    return RemoteImageFetcher(max_bytes, timeout, address_allowed=kw.pop("address_allowed", local_only), **kw)


# ---------------------------------------------------------------------------- policy (pure)
@pytest.mark.parametrize("addr, public", [
    ("93.184.216.34", True), ("8.8.8.8", True), ("2606:4700:4700::1111", True),
    ("127.0.0.1", False), ("127.8.8.8", False), ("10.0.0.1", False), ("172.16.5.4", False), ("192.168.1.1", False),
    ("169.254.169.254", False),  # cloud metadata
    ("100.64.0.1", False),       # carrier-grade NAT
    ("0.0.0.0", False), ("224.0.0.1", False), ("240.0.0.1", False), ("255.255.255.255", False),
    ("::1", False), ("::", False), ("fe80::1", False), ("fc00::1", False), ("ff02::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("::ffff:93.184.216.34", True),
    ("2002:7f00:1::", False),    # 6to4 wrapping 127.0.0.1
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),  # Teredo: its client address is 192.0.2.45 (reserved)
    ("2001:db8::1", False),      # documentation range
])
def test_public_address_policy(addr, public):
    assert is_public_address(ipaddress.ip_address(addr)) is public


# ---------------------------------------------------------------------------- fetching
def test_fetch_connects_to_the_vetted_ip_with_the_original_host(images):
    resolved = []

    def resolve(host, port, timeout):
        resolved.append((host, port))
        return ["127.0.0.1"]

    data = fetcher(resolve=resolve).fetch(f"http://images.test:{images.port}/img.png?x=1")
    assert data == PNG
    assert resolved == [("images.test", images.port)]
    assert images.requests[-1] == ("/img.png?x=1", f"images.test:{images.port}")


def test_default_policy_never_connects_to_loopback(images):
    before = len(images.requests)
    for url in (f"{images.base}/img.png", f"http://localhost:{images.port}/img.png",
                f"http://[::ffff:127.0.0.1]:{images.port}/img.png"):
        with pytest.raises(ImageError, match="not a public address"):
            RemoteImageFetcher(1_000_000, 5.0).fetch(url)
    assert len(images.requests) == before


def test_every_resolved_address_is_vetted(images):
    # One public and one private answer: refused without connecting (DNS could hand either out).
    before = len(images.requests)
    with pytest.raises(ImageError, match="not a public address"):
        fetcher(address_allowed=is_public_address,
                resolve=lambda h, p, t: ["93.184.216.34", "127.0.0.1"]).fetch(f"http://mixed.test:{images.port}/img.png")
    assert len(images.requests) == before


def test_redirects_are_rechecked_and_bounded(images):
    other = ImageServer("127.0.0.2")  # loopback too, but not what the policy admits
    try:
        with pytest.raises(ImageError, match="not a public address"):
            fetcher().fetch(f"{images.base}/redirect?to={other.base}/img.png")
        assert other.requests == []
        with pytest.raises(ImageError, match="must be http"):
            fetcher().fetch(f"{images.base}/redirect?to=file:///etc/passwd")
        assert fetcher().fetch(f"{images.base}/redirect?to=/img.png") == PNG    # relative, same host: fine
        loop = f"{images.base}/redirect?to={images.base}/redirect?to={images.base}/redirect?to={images.base}/redirect?to=/img.png"
        with pytest.raises(ImageError, match="redirected more than 2 times"):
            fetcher(max_redirects=2).fetch(loop)
    finally:
        other.close()


def test_failures_read_the_same_no_port_scan_oracle(images):
    closed_port = unused_port()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (backlog) and never answers
    try:
        cases = {
            "refused": f"http://127.0.0.1:{closed_port}/x.png",
            "timeout": f"http://127.0.0.1:{silent.getsockname()[1]}/x.png",
            "closed": f"{images.base}/close",
            "404": f"{images.base}/missing.png",
        }
        messages = {}
        for name, url in cases.items():
            start = time.monotonic()
            with pytest.raises(ImageError) as info:
                fetcher(timeout=1.0).fetch(url)
            messages[name] = str(info.value)
            assert time.monotonic() - start < 2.5, name
        assert set(messages.values()) == {FETCH_FAILED}
    finally:
        silent.close()


def test_one_deadline_covers_slow_and_trickling_servers(images):
    for path in ("/slow", "/trickle"):
        start = time.monotonic()
        with pytest.raises(ImageError, match="could not fetch the remote image"):
            fetcher(timeout=1.0).fetch(images.base + path)
        assert 0.9 < time.monotonic() - start < 2.0, path


def test_byte_cap(images):
    with pytest.raises(ImageError, match="1000000000 bytes exceeds MAX_IMAGE_BYTES=50000"):
        fetcher(max_bytes=50_000).fetch(images.base + "/huge")
    with pytest.raises(ImageError, match="exceeds MAX_IMAGE_BYTES=50000"):
        fetcher(max_bytes=50_000).fetch(images.base + "/chunked-big")


# ---------------------------------------------------------------------------- request preparation
def test_prepare_replaces_remote_urls_with_data_urls_and_keeps_the_input(images):
    limits = ImageLimits(allow_remote=True)
    inline = "data:image/png;base64," + base64.b64encode(png(colour=(1, 2, 3))).decode()
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": f"{images.base}/img.png", "detail": "low"}},
                                             {"type": "image_url", "image_url": {"url": inline}}]}]
    out = prepare_request_images(messages, limits, fetcher())
    part = out[1]["content"][1]
    assert part["type"] == "image_url" and decode_data_url(part["image_url"]["url"], 10**6) == PNG
    assert out[1]["content"][2] is messages[1]["content"][2] and out[0] is messages[0]
    assert messages[1]["content"][1]["image_url"]["url"] == f"{images.base}/img.png"  # input untouched


def test_prepare_checks_headers_and_names_the_part(images):
    eps = "data:image/png;base64," + base64.b64encode(b"%!PS-Adobe-3.0 EPSF-3.0\n").decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": eps}}]}]
    with pytest.raises(ImageError, match=r"messages\[0\]\.content\[1\]: image format not accepted"):
        prepare_request_images(msgs, ImageLimits())
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{images.base}/img.png"}}]}]
    with pytest.raises(ImageError, match="ALLOW_REMOTE_IMAGE_URLS"):
        prepare_request_images(remote, ImageLimits())  # not allowed: refused, never fetched
    with pytest.raises(ImageError, match=r"messages\[0\]\.content\[0\]: remote image host is not a public address"):
        prepare_request_images(remote, ImageLimits(allow_remote=True))  # default policy


# ---------------------------------------------------------------------------- over HTTP, tiny VLM
def test_remote_fetch_runs_on_the_handler_thread_not_the_worker(tiny_vlm_path, images):
    """A slow image host must not stall the inference worker: while a request's image is being
    fetched (3 s), another request is served; then the image request answers 200. Loopback URLs
    under the production policy are refused before any connection."""
    from tests.conftest import LiveServer, engine_settings, http_json

    server = LiveServer(engine_settings(tiny_vlm_path, allow_remote_image_urls="true"))
    try:
        url = server.base + "/v1/chat/completions"
        remote = {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": f"{images.base}/slow"}}]}], "max_tokens": 2}
        before = len(images.requests)
        status, err, _ = http_json(url, remote)
        assert status == 400 and err["error"]["code"] == "invalid_image"
        assert "messages[0].content[1]: remote image host is not a public address" in err["error"]["message"]
        assert len(images.requests) == before

        server.app.remote_image_policy = local_only
        done: dict = {}

        def slow_request():
            done["image"] = http_json(url, remote)
            done["image_at"] = time.monotonic()

        t = threading.Thread(target=slow_request)
        t.start()
        deadline = time.monotonic() + 10
        while len(images.requests) == before:  # the fetch has started
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status, body, _ = http_json(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        text_at = time.monotonic()
        t.join(timeout=60)
        assert status == 200 and done["image"][0] == 200, done["image"]
        assert text_at < done["image_at"]  # served while the image was still being fetched
        assert images.requests[-1][0] == "/slow"
    finally:
        server.close()
