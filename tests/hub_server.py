"""A local Hugging Face hub for tests: a stdlib HTTP server serving model folders in the URL shapes
huggingface_hub's ``model_info`` / ``repo_info``, ``list_repo_tree`` and ``hf_hub_download`` use.

    hub = HubServer({"org/tiny": folder_or_mapping})   # filename -> bytes, or a folder's files
    os.environ["HF_ENDPOINT"] = hub.url
    ...
    hub.requests        # [(method, path, Range header or None)] in order
    hub.close()

Routes (what huggingface_hub 1.x reads from each):
- ``GET /api/models/{repo}[/revision/{rev}]`` -> ``{"id", "sha", "siblings": [{"rfilename", "size"}]}``
  (sizes always, as with ``?blobs=true``); an unknown repo 404 ``X-Error-Code: RepoNotFound``, an
  unknown revision 404 ``RevisionNotFound``.
- ``GET /api/models/{repo}/tree/{rev}`` -> ``[{"type": "file", "path", "size", "oid"}]`` (one page).
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}`` with ``X-Repo-Commit``, ``ETag``, ``Content-Length``;
  ``Range: bytes=N-`` answered 206 with ``Content-Range``; an unknown file 404 ``EntryNotFound``.

``drop_once[(repo, file)] = n``: the first full GET of that file sends its whole Content-Length but
only ``n`` bytes, then closes the connection (a broken download, for resume).
``hold[(repo, file)] = (n, event)``: a full GET of that file sends ``n`` bytes, then waits for
``event`` before the rest (a download caught in the middle).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class HubServer:
    def __init__(self, repos: dict[str, dict[str, bytes] | Path]) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        for repo, files in repos.items():
            if isinstance(files, Path):
                files = {p.relative_to(files).as_posix(): p.read_bytes() for p in sorted(files.rglob("*"))
                         if p.is_file()}
            self.repos[repo] = dict(files)
        self.requests: list[tuple[str, str, str | None]] = []
        self.drop_once: dict[tuple[str, str], int] = {}
        self.hold: dict[tuple[str, str], tuple[int, threading.Event]] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_a) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._serve(self, head=True)

            def do_GET(self) -> None:
                try:
                    hub._serve(self, head=False)
                except (BrokenPipeError, ConnectionResetError):   # a client that gave up on a held file
                    self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def sha(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- routes -----------------------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            return self._info(h, m.group(1), m.group(2) or "main")
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path)
        if m:
            return self._tree(h, m.group(1), m.group(2))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._file(h, m.group(1), m.group(2), m.group(3), head)
        self._error(h, 404, "", "no such route")

    def _repo(self, h: BaseHTTPRequestHandler, repo: str, rev: str) -> dict[str, bytes] | None:
        if repo not in self.repos:
            self._error(h, 404, "RepoNotFound", f"Repository Not Found for url: {h.path}")
            return None
        if rev not in ("main", self.sha(repo)):
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return self.repos[repo]

    def _info(self, h: BaseHTTPRequestHandler, repo: str, rev: str) -> None:
        files = self._repo(h, repo, rev)
        if files is not None:
            self._json(h, {"id": repo, "modelId": repo, "sha": self.sha(repo), "private": False,
                           "siblings": [{"rfilename": name, "size": len(data), "blobId": _oid(data)}
                                        for name, data in sorted(files.items())]})

    def _tree(self, h: BaseHTTPRequestHandler, repo: str, rev: str) -> None:
        files = self._repo(h, repo, rev)
        if files is not None:
            self._json(h, [{"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                           for name, data in sorted(files.items())])

    def _file(self, h: BaseHTTPRequestHandler, repo: str, rev: str, name: str, head: bool) -> None:
        files = self._repo(h, repo, rev)
        if files is None:
            return
        if name not in files:
            return self._error(h, 404, "EntryNotFound", f"Entry not found: {name}")
        data = files[name]
        start, status = 0, 200
        wanted = h.headers.get("Range")
        if wanted and not head:
            m = re.fullmatch(r"bytes=(\d+)-", wanted.strip())
            if m:
                start, status = int(m.group(1)), 206
        body = data[start:]
        h.send_response(status)
        h.send_header("X-Repo-Commit", self.sha(repo))
        h.send_header("ETag", f'"{_oid(data)}"')
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        drop = None if head or status == 206 else self.drop_once.pop((repo, name), None)
        if drop is not None:
            h.send_header("Connection", "close")
        h.end_headers()
        if head:
            return
        if drop is not None:
            h.wfile.write(body[:drop])
            h.wfile.flush()
            h.close_connection = True
            return
        held = None if status == 206 else self.hold.get((repo, name))
        if held is not None:
            h.wfile.write(body[:held[0]])
            h.wfile.flush()
            held[1].wait(60)
            body = body[held[0]:]
        h.wfile.write(body)

    def _json(self, h: BaseHTTPRequestHandler, body: object) -> None:
        raw = json.dumps(body).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        raw = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
            h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)


def _oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
