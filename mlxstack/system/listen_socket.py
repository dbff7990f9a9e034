"""The MLX server's listening socket, owned by the launcher across server restarts (stdlib only).

    sock = listen_socket("127.0.0.1", 8080)          # launcher: bind once
    env["MLX_LISTEN_FD"] = str(sock.fileno())         # child: Popen(pass_fds=(sock.fileno(),))
    fd = inherited_listen_fd(os.environ)              # mlxstack.serve: serve on it instead of binding

Why: when a crashed server is restarted, a closed port makes LiteLLM answer 500 "Cannot connect
to host" for every request until the new process binds. With the socket held by the launcher,
those connections wait in the kernel's backlog and are answered by the new server (503 "model is
still loading" with Retry-After, then normal answers).
"""
from __future__ import annotations

import socket
from typing import Mapping

LISTEN_FD_ENV = "MLX_LISTEN_FD"
BACKLOG = 128


def listen_socket(host: str, port: int, backlog: int = BACKLOG) -> socket.socket:
    """A bound, listening, inheritable TCP socket on ``host:port`` (IPv6 ``::`` is dual stack)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sock.family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def inherited_listen_fd(environ: Mapping[str, str]) -> int | None:
    """The listening descriptor a launcher passed down, or None (then the server binds itself)."""
    value = environ.get(LISTEN_FD_ENV, "").strip()
    return int(value) if value.isdigit() else None
