"""A recording HTTP relay: put it between a client and a server to see the exact traffic.

    python -m scripts.real_clients.capture_proxy --listen 4192 --upstream http://127.0.0.1:4190 \
        --out /tmp/capture/client_to_litellm.jsonl

Every exchange becomes one JSON line: method, path, request headers and body (parsed JSON when it
is JSON), status, response headers and body (SSE streams are relayed as they arrive and recorded
whole, up to --max-body characters). Stdlib only; used for measuring the real agent clients.
"""
from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
               "content-length"}


def parse_body(raw: bytes) -> Any:
    """JSON when the bytes are JSON, else text (lossy), else None for an empty body."""
    if not raw:
        return None
    text = raw.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def make_handler(upstream: str, out: Path, max_body: int, lock: threading.Lock) -> type:
    target = urllib.parse.urlsplit(upstream)

    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # response body delimited by close: no re-chunking needed

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def _read_request_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                return b"".join(chunks)
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _relay(self) -> None:
            t0 = time.time()
            body = self._read_request_body()
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS | {"host"}}
            if body or self.command in ("POST", "PUT", "PATCH"):
                headers["Content-Length"] = str(len(body))
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=3600)
            record: dict[str, Any] = {"ts": t0, "method": self.command, "path": self.path,
                                      "request_headers": dict(self.headers.items()),
                                      "request_body": parse_body(body)}
            received = bytearray()
            try:
                conn.request(self.command, (target.path.rstrip("/") + self.path) or "/", body=body or None,
                             headers=headers)
                resp = conn.getresponse()
                record["status"] = resp.status
                record["response_headers"] = dict(resp.getheaders())
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    received += chunk
                    self.wfile.write(chunk)
                    self.wfile.flush()
            except (OSError, http.client.HTTPException) as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
                if "status" not in record:
                    try:
                        self.send_error(502, "upstream failed")
                    except OSError:
                        pass
            finally:
                conn.close()
                text = received.decode("utf-8", "replace")
                record["response_body"] = parse_body(received) if len(text) <= max_body else text[:max_body]
                record["elapsed_s"] = round(time.time() - t0, 3)
                with lock, out.open("a") as f:
                    f.write(json.dumps(record) + "\n")

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _relay

    return Relay


def serve(listen: int, upstream: str, out: Path, max_body: int = 2_000_000) -> ThreadingHTTPServer:
    """Start a relay on 127.0.0.1:``listen`` in a daemon thread; returns the server (call shutdown())."""
    out.parent.mkdir(parents=True, exist_ok=True)
    server = ThreadingHTTPServer(("127.0.0.1", listen), make_handler(upstream, out, max_body, threading.Lock()))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-body", type=int, default=2_000_000)
    args = ap.parse_args()
    server = serve(args.listen, args.upstream, args.out, args.max_body)
    print(f"relaying 127.0.0.1:{args.listen} -> {args.upstream}, recording to {args.out}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
