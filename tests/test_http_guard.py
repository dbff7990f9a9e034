"""The MLX server's HTTP front against hostile and broken clients (issue 10, items 2, 3 and 12):
Host / Origin / Content-Type / API-key guards, Content-Length parsing, header and body deadlines,
the bounded handler pool, poll()-based disconnect checks and IPv6 binding.

Pure functions are tested with plain data; the socket behaviour with a real server on a free
port. No model is needed for the front (the guards run before any route), so these servers are
started without loading one: a valid chat request gets 503 "model is still loading" from them.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from mlxstack.server.http.errors import APIError
from mlxstack.server.http.guard import (
    Guard,
    bearer_token,
    bind_refusal,
    host_allowed,
    host_name,
    is_json_content_type,
    is_loopback_address,
    origin_allowed,
)
from mlxstack.server.http.pooled_server import DeadlineReader, busy_response, peer_closed
from mlxstack.server.http.handler import content_length
from mlxstack.config.settings import SettingsError
from tests.conftest import engine_settings, http_json

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


# ---------------------------------------------------------------------------- pure guards
@pytest.mark.parametrize("header, name", [
    ("127.0.0.1:8080", "127.0.0.1"), ("LOCALHOST:8080", "localhost"), ("localhost.", "localhost"),
    ("[::1]:8080", "::1"), ("[::1]", "::1"), ("example.com", "example.com"), ("Example.COM:80", "example.com"),
])
def test_host_name(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("header, allowed", [
    (None, True), ("127.0.0.1:8080", True), ("localhost:8080", True), ("[::1]:8080", True), ("10.1.2.3", True),
    ("[fe80::1%25eth0]:80", True), ("my-mac.lan:8080", True), ("attacker.example:8080", False),
    ("127.0.0.1.attacker.example", False), ("localhost.attacker.example", False), ("", False),
])
def test_host_allow_list(header, allowed):
    assert host_allowed(header, frozenset({"my-mac.lan"})) is allowed


@pytest.mark.parametrize("origin, host, allowed", [
    (None, "127.0.0.1:8080", True),
    ("http://127.0.0.1:8080", "127.0.0.1:8080", True),            # the dashboard's own origin
    ("http://127.0.0.1:8080/", "127.0.0.1:8080", True),
    ("http://localhost:3000", "127.0.0.1:8080", True),            # configured
    ("HTTP://LOCALHOST:3000", "127.0.0.1:8080", True),
    ("http://evil.example", "127.0.0.1:8080", False),
    ("http://127.0.0.1:9999", "127.0.0.1:8080", False),           # another local port is another origin
    ("null", "127.0.0.1:8080", False),                             # sandboxed iframes, file:// pages
    ("http://127.0.0.1:8080", None, False),
])
def test_origin_check(origin, host, allowed):
    assert origin_allowed(origin, host, frozenset({"http://localhost:3000"})) is allowed


@pytest.mark.parametrize("value, ok", [("application/json", True), ("application/json; charset=utf-8", True),
                                       ("Application/JSON", True), ("text/plain", False),
                                       ("application/x-www-form-urlencoded", False), ("multipart/form-data", False),
                                       ("application/jsonx", False), (None, False), ("", False)])
def test_json_content_type(value, ok):
    assert is_json_content_type(value) is ok


def test_bearer_and_loopback_helpers():
    assert bearer_token("Bearer sk-1") == "sk-1" and bearer_token("bearer  sk-2 ") == "sk-2"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
    for addr in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1", "localhost", "[::1]"):
        assert is_loopback_address(addr), addr
    for addr in ("0.0.0.0", "::", "", "192.168.1.5", "example.com", "::ffff:10.0.0.1"):
        assert not is_loopback_address(addr), addr


def _guard(**env) -> Guard:
    return Guard.from_settings(engine_settings(None, **env))


def test_guard_decisions_in_order():
    g = _guard(mlx_api_key="sk-test", mlx_allowed_origins="http://localhost:3000")
    ok_headers = {"host": "127.0.0.1:8080", "authorization": "Bearer sk-test", "content-type": "application/json"}

    def status(method, path, peer="127.0.0.1", **changes):
        headers = {k: v for k, v in {**ok_headers, **changes}.items() if v is not None}
        err = g.check(method, path, headers, peer)
        return None if err is None else (err.status, err.code)

    assert status("POST", "/v1/chat/completions") is None
    assert status("POST", "/v1/chat/completions", host="evil.example") == (403, "host_not_allowed")
    assert status("POST", "/v1/chat/completions", origin="http://evil.example") == (403, "origin_not_allowed")
    assert status("POST", "/v1/chat/completions", origin="http://localhost:3000") is None
    assert status("POST", "/v1/chat/completions", authorization=None) == (401, "invalid_api_key")
    assert status("POST", "/v1/chat/completions", authorization="Bearer sk-wrong") == (401, "invalid_api_key")
    assert status("POST", "/v1/chat/completions", **{"content-type": "text/plain"}) == (415, "unsupported_media_type")
    # Host is checked first: a rebinding page never learns whether its key guess was right.
    assert status("POST", "/v1/chat/completions", host="evil.example", authorization=None) == (403, "host_not_allowed")
    # Open routes: /health always; read-only observability pages for loopback peers only.
    assert status("GET", "/health", authorization=None, peer="203.0.113.9") is None
    for path in ("/metrics", "/dashboard", "/dashboard/dashboard.js", "/v1/cache/stats"):
        assert status("GET", path, authorization=None) is None, path
        assert status("GET", path, authorization=None, peer="::ffff:127.0.0.1") is None, path
        assert status("GET", path, authorization=None, peer="192.168.1.20") == (401, "invalid_api_key"), path
    assert status("GET", "/v1/models", authorization=None) == (401, "invalid_api_key")
    assert status("GET", "/metricsX", authorization=None) == (401, "invalid_api_key")
    # No key configured: everything but the Host/Origin/Content-Type rules is open.
    assert _guard().check("GET", "/v1/models", {"host": "localhost:8080"}, "127.0.0.1") is None


def test_bound_and_configured_hosts_pass():
    g = _guard(mlx_host="my-box.local", mlx_allowed_hosts="llm.internal, Other.Name")
    for host in ("my-box.local:8080", "llm.internal", "other.name:1"):
        assert g.check("GET", "/health", {"host": host}, "127.0.0.1") is None, host
    assert g.check("GET", "/health", {"host": "third.name"}, "127.0.0.1").status == 403


def test_bind_refusal():
    assert bind_refusal("127.0.0.1", "") is None and bind_refusal("::1", "") is None
    assert bind_refusal("localhost", "") is None
    for host in ("0.0.0.0", "::", "192.168.1.5", ""):
        msg = bind_refusal(host, "")
        assert msg is not None and "MLX_API_KEY" in msg and "MLX_HOST=127.0.0.1" in msg
        assert bind_refusal(host, "sk-x") is None


@pytest.mark.parametrize("values, expected", [(None, None), ([], None), (["0"], 0), (["42"], 42), ([" 42 "], 42),
                                              (["42", "42"], 42)])
def test_content_length_accepted(values, expected):
    assert content_length(values) == expected


@pytest.mark.parametrize("values", [["-1"], ["+5"], ["5_0"], ["0x10"], ["1e3"], [""], ["4 2"], ["١٢"], ["42", "43"],
                                    ["9" * 19]])
def test_content_length_refused(values):
    with pytest.raises(APIError) as info:
        content_length(values)
    assert info.value.status == 400 and "decimal" in info.value.message


# ---------------------------------------------------------------------------- sockets
def test_peer_closed_with_descriptors_above_1024():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    held = [socket.socketpair() for _ in range(600)]
    try:
        a, b = socket.socketpair()
        assert a.fileno() >= 1024
        assert peer_closed(a) is False               # select() raised ValueError here -> "closed"
        b.sendall(b"x")
        assert peer_closed(a) is False               # readable with data: still open
        assert a.recv(1) == b"x"
        b.close()
        assert peer_closed(a) is True
        a.close()
    finally:
        for x, y in held:
            x.close()
            y.close()


def test_deadline_reader_bounds_total_time():
    a, b = socket.socketpair()
    reader = DeadlineReader(a, time.monotonic() + 0.6)
    stop = threading.Event()

    def trickle():  # one byte every 0.1 s: a per-recv timeout would never fire
        while not stop.is_set():
            try:
                b.sendall(b"x")
            except OSError:
                return
            time.sleep(0.1)

    threading.Thread(target=trickle, daemon=True).start()
    start = time.monotonic()
    buf = bytearray(1)
    with pytest.raises(TimeoutError):
        while True:
            reader.readinto(buf)
    stop.set()
    assert 0.5 < time.monotonic() - start < 1.5
    a.close()
    b.close()


# ---------------------------------------------------------------------------- live front (no model)
class FrontServer:
    """App + server on a free port without a model: the front's behaviour only."""

    def __init__(self, host: str = "127.0.0.1", **env):
        from mlxstack.server.app import App, make_server

        self.app = App(engine_settings(None, **env))
        self.httpd = make_server(self.app, host, 0)
        self.port = self.httpd.server_address[1]
        self.host = host
        self.base = f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def raw(self, data: bytes, timeout: float = 10.0) -> bytes:
        with socket.create_connection((self.host, self.port), timeout=timeout) as s:
            s.sendall(data)
            return recv_all(s)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def recv_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def json_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


@pytest.fixture(scope="module")
def front():
    server = FrontServer(mlx_header_timeout_seconds=1.0, mlx_body_timeout_seconds=1.0,
                         mlx_api_key="sk-front-key-123456", mlx_allowed_origins="http://localhost:3000")
    yield server
    server.close()


AUTH = {"Authorization": "Bearer sk-front-key-123456"}


def post(server, body: bytes, *headers: str) -> bytes:
    head = "".join(h + "\r\n" for h in headers)
    return server.raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + head.encode() + b"\r\n" + body)


@pytest.mark.parametrize("length", ["-1", "+2", "1_0", "0x2", "2, 3"])
def test_bad_content_length_is_400_at_once(front, length):
    start = time.monotonic()
    # The client keeps the connection open: the old server read until it closed.
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer sk-front-key-123456\r\nContent-Length: " + length.encode() + b"\r\n\r\n{}")
        reply = recv_all(s)
    assert status_of(reply) == 400 and "decimal" in json_of(reply)["error"]["message"]
    assert time.monotonic() - start < 0.9


def test_missing_length_411_and_oversize_413_unchanged(front):
    reply = post(front, b"", "Content-Type: application/json", "Authorization: Bearer sk-front-key-123456")
    assert status_of(reply) == 411 and json_of(reply)["error"]["code"] == "length_required"
    reply = post(front, b"", "Content-Type: application/json", "Authorization: Bearer sk-front-key-123456",
                 "Transfer-Encoding: chunked")
    assert status_of(reply) == 411 and "chunked" in json_of(reply)["error"]["message"]
    n = front.app.settings.max_request_bytes + 1
    reply = post(front, b"x" * n, "Content-Type: application/json", "Authorization: Bearer sk-front-key-123456",
                 f"Content-Length: {n}")
    assert status_of(reply) == 413 and "MAX_REQUEST_BYTES" in json_of(reply)["error"]["message"]


def test_slow_header_client_is_dropped(front):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        reply = b""
        for _ in range(30):  # one header byte every 0.1 s, never finishing
            try:
                s.sendall(b"X")
            except OSError:
                break
            time.sleep(0.1)
            s.setblocking(False)
            try:
                chunk = s.recv(4096)
                if chunk == b"":
                    break
                reply += chunk
            except BlockingIOError:
                pass
            except ConnectionResetError:
                break
            finally:
                s.setblocking(True)
    elapsed = time.monotonic() - start
    assert reply == b"" and 0.9 < elapsed < 2.0, (reply, elapsed)
    assert status_of(front.raw(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")) == 503  # still serving (no model)


def test_slow_body_gets_408(front):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer sk-front-key-123456\r\nContent-Length: 100\r\n\r\n{\"messages\"")
        reply = recv_all(s)
    assert status_of(reply) == 408 and json_of(reply)["error"]["code"] == "request_timeout"
    assert 0.9 < time.monotonic() - start < 2.5


def test_short_body_is_400(front):
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer sk-front-key-123456\r\nContent-Length: 100\r\n\r\n{}")
        s.shutdown(socket.SHUT_WR)
        reply = recv_all(s)
    assert status_of(reply) == 400 and "ended after 2 of the 100 bytes" in json_of(reply)["error"]["message"]


def test_guards_over_http(front):
    url = front.base + "/v1/chat/completions"
    status, err, _ = http_json(url, CHAT, headers={**AUTH, "Host": "attacker.example"})
    assert status == 403 and err["error"]["code"] == "host_not_allowed"
    status, err, _ = http_json(url, CHAT, headers={**AUTH, "Origin": "http://evil.example"})
    assert status == 403 and err["error"]["code"] == "origin_not_allowed"
    status, err, _ = http_json(url, CHAT, headers={**AUTH, "Content-Type": "text/plain"})
    assert status == 415 and err["error"]["code"] == "unsupported_media_type"
    status, err, headers = http_json(url, CHAT)
    assert status == 401 and err["error"]["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
    status, err, _ = http_json(url, CHAT, headers={"Authorization": "Bearer sk-front-key-12345X"})
    assert status == 401
    # Right key, allowed origin, localhost Host: through to the route (no model here: 503 loading).
    status, err, _ = http_json(url, CHAT, headers={**AUTH, "Origin": "http://localhost:3000",
                                                   "Host": f"localhost:{front.port}"})
    assert status == 503 and err["error"]["code"] == "model_loading"
    assert http_json(front.base + "/health")[0] == 503          # open, reports loading
    assert http_json(front.base + "/v1/models")[0] == 401
    assert http_json(front.base + "/v1/models", headers=AUTH)[0] == 200
    assert http_json(front.base + "/v1/cache/stats")[0] == 200  # read-only, loopback peer
    counts = front.app.status_counts
    assert counts[401] >= 3 and counts[403] >= 2 and counts[415] >= 1


def test_cross_site_form_post_refused(front):
    # What a web page can send without a CORS preflight: a form POST with text/plain.
    reply = post(front, b'{"messages":[{"role":"user","content":"hi"}]}', "Content-Type: text/plain",
                 "Origin: http://evil.example", "Content-Length: 46")
    assert status_of(reply) == 403 and json_of(reply)["error"]["code"] == "origin_not_allowed"


def test_thread_cap_answers_503_after_a_short_wait():
    server = FrontServer(mlx_http_threads=2, mlx_header_timeout_seconds=30)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]  # hold both handlers
    try:
        time.sleep(0.2)
        start = time.monotonic()
        status, err, headers = http_json(server.base + "/health", timeout=10)
        waited = time.monotonic() - start
        assert status == 503 and err["error"]["code"] == "server_busy" and headers["Retry-After"] == "2"
        assert 1.9 < waited < 4.0, waited
        # With both handlers busy and 2 connections already waiting, a further one is refused at once.
        waiting = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(2)]
        time.sleep(0.2)
        start = time.monotonic()
        assert http_json(server.base + "/health", timeout=10)[0] == 503
        assert time.monotonic() - start < 1.0
        for s in idle + waiting:
            s.close()
        time.sleep(0.3)
        assert http_json(server.base + "/health", timeout=10)[0] == 503  # loading, served by a handler again
        assert http_json(server.base + "/health", timeout=10)[1]["ready"] is False
        assert server.httpd.refused >= 2
    finally:
        for s in idle:
            s.close()
        server.close()


def test_busy_response_is_openai_shaped():
    raw = busy_response(7)
    assert status_of(raw) == 503 and b"Retry-After: 2\r\n" in raw
    assert json_of(raw)["error"] == {"message": "server busy: all 7 connection handlers are in use; retry shortly",
                                     "type": "server_error", "param": None, "code": "server_busy"}


@pytest.mark.parametrize("host", ["::1", "::"])
def test_ipv6_hosts_bind_and_serve(host):
    server = FrontServer(host, mlx_api_key="sk-v6" if host == "::" else "")
    try:
        status, body, _ = http_json(f"http://[::1]:{server.port}/health")
        assert status == 503 and body["ready"] is False
        if host == "::":  # dual stack: IPv4 clients reach it too
            assert http_json(f"http://127.0.0.1:{server.port}/health")[0] == 503
    finally:
        server.close()


def test_non_loopback_bind_without_key_refused():
    from mlxstack.server.app import App, make_server

    app = App(engine_settings(None))
    with pytest.raises(SettingsError, match="MLX_API_KEY is empty"):
        make_server(app, "0.0.0.0", 0)
    keyed = App(engine_settings(None, mlx_api_key="sk-k"))
    httpd = make_server(keyed, "0.0.0.0", 0)
    httpd.server_close()


def test_listen_backlog_holds_a_burst_of_connects():
    """While the accept loop is busy (here: not running yet), a burst of 60 connects completes its
    handshakes in the backlog and every one is answered once accepting resumes (the default
    backlog of 5 left the rest to SYN retries, and the soak saw a reset)."""
    from mlxstack.server.app import App, make_server

    app = App(engine_settings(None, mlx_http_threads=64))
    httpd = make_server(app, "127.0.0.1", 0)
    port = httpd.server_address[1]
    socks = []
    serving = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    try:
        for _ in range(60):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        serving.start()
        statuses = []
        for s in socks:
            s.settimeout(10)
            statuses.append(status_of(recv_all(s)))
        assert statuses.count(503) + statuses.count(200) == 60, statuses  # 503: loading (no model) or busy
    finally:
        for s in socks:
            s.close()
        if serving.is_alive():
            httpd.shutdown()
        httpd.server_close()
