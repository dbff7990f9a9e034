"""The ranks' control channel: rank 0 sends each turn's record to every other rank (stdlib only).

MLX's ring backend polls while a collective waits: a follower waiting for rank 0's next turn
inside ``all_sum`` keeps a core busy for as long as the server is idle (measured: ~85 % of a core
per follower). The records therefore travel over plain TCP, where a waiting follower sleeps in
``recv``; the model's own collectives stay with MLX. Every message is authenticated (HMAC-SHA256
with a secret the launcher hands every rank), so nothing else can join or speak for rank 0.

    chan = ControlChannel.lead(("127.0.0.1", port), secret, followers=2)   # rank 0: accepts them
    chan = ControlChannel.follow(("127.0.0.1", port), secret, rank=1)      # a follower: connects
    chan.send(data)      # rank 0: to every follower
    data = chan.recv()   # a follower: blocks until rank 0's next message (EOFError: rank 0 left)

Environment: ``MLXSTACK_CONTROL`` (``host:port`` rank 0 listens on) and
``MLXSTACK_CONTROL_SECRET`` (hex), set by the launcher for every rank.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from typing import Mapping

ADDR_ENV = "MLXSTACK_CONTROL"
SECRET_ENV = "MLXSTACK_CONTROL_SECRET"
_HEAD = struct.Struct("!Q")
_MAC = 32


def new_secret() -> str:
    return os.urandom(32).hex()


def parse_address(value: str) -> tuple[str, int]:
    """``host:port`` -> (host, port) (pure; IPv6 in brackets)."""
    host, _, port = value.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ADDR_ENV}={value!r} is not host:port")
    return host.strip("[]"), int(port)


def from_env(environ: Mapping[str, str]) -> tuple[tuple[str, int], bytes] | None:
    """(address, secret) the launcher set, or None."""
    addr, secret = environ.get(ADDR_ENV, ""), environ.get(SECRET_ENV, "")
    if not addr or not secret:
        return None
    return parse_address(addr), bytes.fromhex(secret)


def _mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the control channel was closed")
        buf += chunk
    return bytes(buf)


class ControlChannel:
    def __init__(self, socks: list[socket.socket], secret: bytes) -> None:
        self.socks = socks
        self.secret = secret
        self._inbox: dict[int, bytearray] = {}

    @classmethod
    def lead(cls, address: tuple[str, int], secret: bytes, followers: int, timeout: float = 600.0) -> "ControlChannel":
        """Rank 0: listen on ``address`` and accept ``followers`` authenticated ranks (in rank order)."""
        server = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(address)
        server.listen(followers + 4)
        server.settimeout(timeout)
        by_rank: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(by_rank) < followers:
                server.settimeout(max(0.1, deadline - time.monotonic()))
                conn, _ = server.accept()
                conn.settimeout(10.0)
                try:
                    hello = _read_exact(conn, 8 + _MAC)
                except (OSError, EOFError):
                    conn.close()
                    continue
                rank, mac = struct.unpack("!Q", hello[:8])[0], hello[8:]
                if not hmac.compare_digest(mac, _mac(secret, hello[:8])) or rank in by_rank or not 0 < rank <= followers:
                    conn.close()          # not one of ours
                    continue
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                by_rank[rank] = conn
        finally:
            server.close()
        return cls([by_rank[r] for r in sorted(by_rank)], secret)

    @classmethod
    def follow(cls, address: tuple[str, int], secret: bytes, rank: int, timeout: float = 600.0) -> "ControlChannel":
        """A follower: connect to rank 0 (retrying while it starts) and say which rank this is."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection(address, timeout=10.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        head = struct.pack("!Q", rank)
        sock.sendall(head + _mac(secret, head))
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls([sock], secret)

    def send(self, payload: bytes) -> None:
        """Rank 0: ``payload`` to every follower."""
        frame = _HEAD.pack(len(payload)) + _mac(self.secret, payload) + payload
        for sock in self.socks:
            sock.sendall(frame)

    def recv(self) -> bytes:
        """A follower: rank 0's next message (blocks; EOFError when rank 0 is gone)."""
        sock = self.socks[0]
        n = _HEAD.unpack(_read_exact(sock, _HEAD.size))[0]
        mac = _read_exact(sock, _MAC)
        payload = _read_exact(sock, n)
        if not hmac.compare_digest(mac, _mac(self.secret, payload)):
            raise ConnectionError("a control message failed authentication")
        return payload

    def report(self, payload: bytes) -> None:
        """A follower: a small message back to rank 0 (its memory, for /metrics); never waited for."""
        self.send(payload)

    def reports(self) -> list[tuple[int, bytes]]:
        """Rank 0: (follower index, payload) for every whole report that has arrived (no waiting)."""
        out = []
        for i, sock in enumerate(self.socks):
            buf = self._inbox.setdefault(i, bytearray())
            while True:
                try:
                    chunk = sock.recv(65536, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                if not chunk:
                    break
                buf += chunk
            while len(buf) >= _HEAD.size + _MAC:
                n = _HEAD.unpack(bytes(buf[:_HEAD.size]))[0]
                end = _HEAD.size + _MAC + n
                if len(buf) < end:
                    break
                mac, payload = bytes(buf[_HEAD.size:_HEAD.size + _MAC]), bytes(buf[_HEAD.size + _MAC:end])
                del buf[:end]
                if hmac.compare_digest(mac, _mac(self.secret, payload)):
                    out.append((i, payload))
        return out

    def close(self) -> None:
        for sock in self.socks:
            try:
                sock.close()
            except OSError:
                pass
