"""The MLX server's socket layer: a fixed pool of handler threads, deadlines, IPv4/IPv6 binding.

    server = PooledHTTPServer((host, port), HandlerClass, threads=64)
    server.serve_forever(poll_interval=0.2)

- ``threads`` handler threads serve connections FIFO. A connection that finds them all busy waits
  at most ``queue_wait`` seconds (checked every poll interval), then gets 503 + Retry-After; at
  most ``threads`` connections wait, further ones get the 503 at once. A flood of idle sockets
  therefore costs bounded threads and memory.
- ``DeadlineReader`` bounds the *total* time for the request line + headers (and, separately,
  the body): a per-recv timeout alone lets a client that sends one byte every few seconds hold a
  thread forever.
- ``peer_closed`` uses poll(), not select(): select() cannot watch descriptors >= 1024, and
  reported every live socket as closed once a server held ~1,000 connections.
- ``listen_fd``: serve on a socket the launcher bound and keeps open across restarts
  (mlxstack/system/listen_socket.py), so connections that arrive while the server is down wait
  in the backlog instead of being refused.
"""
from __future__ import annotations

import io
import logging
import select
import socket
import threading
import time
from collections import deque
from http.server import HTTPServer
from typing import Any

log = logging.getLogger("mlxstack.http")

QUEUE_WAIT_SECONDS = 2.0


def address_family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def peer_closed(sock: socket.socket) -> bool:
    """True when the client has closed its end (readable with nothing to read)."""
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            events = poller.poll(0)
            if not events:
                return False
            if any(ev & (select.POLLERR | select.POLLNVAL) for _, ev in events):
                return True
        else:  # Windows: select() has no 1024 limit there
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
        return sock.recv(1, socket.MSG_PEEK | getattr(socket, "MSG_DONTWAIT", 0)) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True


class DeadlineReader(io.RawIOBase):
    """Raw reads from a socket that raise ``TimeoutError`` once ``deadline`` (monotonic) passes."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("client did not send in time")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


def busy_response(threads: int) -> bytes:
    from .errors import unavailable

    err = unavailable(f"server busy: all {threads} connection handlers are in use; retry shortly",
                      retry_after=2, code="server_busy")
    body = err.encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: 2\r\nConnection: close\r\n\r\n").encode()
    return head + body


class PooledHTTPServer(HTTPServer):
    """HTTPServer with a bounded pool of handler threads (see the module docstring)."""

    # The listen backlog: socketserver's default of 5 overflows under a burst of connects, and
    # the kernel then drops or resets connections before we can answer them (even with a 503).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: Any, *, threads: int = 64,
                 queue_wait: float = QUEUE_WAIT_SECONDS, listen_fd: int | None = None) -> None:
        self.address_family = address_family(address[0])
        self.threads = threads
        self.queue_wait = queue_wait
        self.refused = 0
        self._pending: deque[tuple[socket.socket, Any, float]] = deque()
        self._cv = threading.Condition()
        self._closing = False
        super().__init__(address, handler, bind_and_activate=listen_fd is None)
        if listen_fd is not None:  # already bound and listening (inherited from the launcher)
            self.socket.close()
            self.socket = socket.socket(fileno=listen_fd)
            self.address_family = self.socket.family
            self.server_address = self.socket.getsockname()
            self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self._pool = [threading.Thread(target=self._work, name=f"http-{i}", daemon=True) for i in range(threads)]
        for t in self._pool:
            t.start()

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.server_address[0] in ("::", ""):
            try:  # "::" serves IPv4 clients too (dual stack), like 0.0.0.0 plus IPv6
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except (AttributeError, OSError):
                pass
        super().server_bind()

    # -------------------------------------------------------------- accept thread
    def process_request(self, request: Any, client_address: Any) -> None:
        with self._cv:
            if len(self._pending) < self.threads:
                self._pending.append((request, client_address, time.monotonic()))
                self._cv.notify()
                return
        self._refuse(request)

    def service_actions(self) -> None:
        """Runs in serve_forever's loop: connections that waited too long get their 503."""
        now = time.monotonic()
        expired = []
        with self._cv:
            while self._pending and now - self._pending[0][2] > self.queue_wait:
                expired.append(self._pending.popleft()[0])
        for request in expired:
            self._refuse(request)

    def _refuse(self, request: socket.socket) -> None:
        self.refused += 1
        app = getattr(self.RequestHandlerClass, "app", None)
        if app is not None:
            app.count_status(503)
        try:
            request.settimeout(0.5)
            request.sendall(busy_response(self.threads))
            request.shutdown(socket.SHUT_WR)
            request.setblocking(False)
            try:  # read what already arrived, so close() does not turn our answer into a reset
                while request.recv(65536):
                    pass
            except OSError:
                pass
        except OSError:
            pass
        finally:
            request.close()

    # -------------------------------------------------------------- pool threads
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                request, client_address, _ = self._pending.popleft()
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - one connection's failure never stops the pool
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def shutdown_request(self, request: Any) -> None:
        """FIN, then read what the client already sent (without waiting): closing with unread
        bytes makes the kernel send a reset, which can destroy our answer before it is read."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.setblocking(False)
            for _ in range(16):
                if not request.recv(65536):
                    break
        except OSError:
            pass
        request.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("unhandled error on a connection from %s", client_address)

    def server_close(self) -> None:
        super().server_close()
        with self._cv:
            self._closing = True
            pending = list(self._pending)
            self._pending.clear()
            self._cv.notify_all()
        for request, _, _ in pending:
            request.close()
