"""The ranks' control channel: rank 0 sends each turn's record to every other rank (stdlib +
``cryptography``).

MLX's ring backend polls while a collective waits: a follower waiting for rank 0's next turn
inside ``all_sum`` keeps a core busy for as long as the server is idle (measured: ~85 % of a core
per follower). The records therefore travel over plain TCP, where a waiting follower sleeps in
``recv``; the model's own collectives stay with MLX.

    chan = ControlChannel.lead(("127.0.0.1", port), secret, followers=2)   # rank 0: accepts them
    chan = ControlChannel.follow(("127.0.0.1", port), secret, rank=1)      # a follower: connects
    chan.send(data)      # rank 0: to every follower
    data = chan.recv()   # a follower: blocks until rank 0's next message (EOFError: rank 0 left)

Nothing else can join, listen or speak for a rank:

* the hello is a challenge-response with fresh nonces both ways: the follower sends its rank and
  a nonce, rank 0 answers with its nonce and an HMAC over both (so the follower knows it talks to
  rank 0, now), the follower proves the secret over both nonces (a recorded hello replays nothing);
* each connection gets its own keys (HKDF-SHA256 of the secret, salted with both nonces, one key a
  direction) and every frame is ChaCha20-Poly1305 with the frame's sequence number as its nonce and
  its length as associated data: encrypted, authenticated, in order, never replayed or reflected;
* rank 0 handles hellos concurrently, each under one deadline for the whole hello (``HELLO_SECONDS``):
  a stranger that connects and trickles bytes, or sends garbage, holds nothing but its own thread;
  the first rank that completes the hello takes its slot, and only a holder of the secret can.

What this does not protect: MLX's own ring / JACCL links carry the model's activations in clear
(docs/distributed.md: run the ranks on a trusted link).

Environment: ``MLXSTACK_CONTROL`` (``host:port`` rank 0 listens on) and either
``MLXSTACK_CONTROL_SECRET`` (hex: local ranks inherit it from rank 0) or
``MLXSTACK_CONTROL_SECRET_FILE`` (ranks mlx.launch starts on other hosts: the path of the group's
one secret file, ``group_secret_file``, which every host holds a copy of).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

ADDR_ENV = "MLXSTACK_CONTROL"
SECRET_ENV = "MLXSTACK_CONTROL_SECRET"
SECRET_FILE_ENV = "MLXSTACK_CONTROL_SECRET_FILE"    # mlx.launch ranks: a 0600 file's path, never the value
SECRET_FILE_NAME = "control.key"    # one per folder, made once and reused: copied to every host once
_SECRET_BYTES = 32
_HEAD = struct.Struct("!Q")
_MAC = 32
_NONCE = 32
_MAGIC = b"MXC1"
_TAG = 16
HELLO_SECONDS = 10.0          # a connection's whole hello, however it trickles
MAX_FRAME = 1 << 31           # a frame's length field above this is an attack, not a record


class ControlSecretError(RuntimeError):
    """The control channel's secret file is missing, open to other users or holds no secret: a
    configuration to fix (the message says how), not a group to restart."""


class GroupNotFormed(ConnectionError):
    """The ranks did not complete their hellos (rank 0 waited past its deadline, a follower could not
    reach rank 0 or was refused by it): the group is restarted, not reported as a model that does
    not load."""


_RESERVED: dict[tuple[str, int], socket.socket] = {}


def reserve(host: str = "127.0.0.1") -> str:
    """``host:port`` of a socket bound and listening here now, kept for ``lead`` in this process
    (the launcher's rank 0): the port is never released and re-bound, so nobody can take it in
    between."""
    sock = listener(host)
    port = sock.getsockname()[1]
    _RESERVED[(host, port)] = sock
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listener(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a port the system picks) and listening."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def new_secret() -> str:
    return os.urandom(32).hex()


def parse_address(value: str) -> tuple[str, int]:
    """``host:port`` -> (host, port) (pure; IPv6 in brackets)."""
    host, _, port = value.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ADDR_ENV}={value!r} is not host:port")
    return host.strip("[]"), int(port)


def from_env(environ: Mapping[str, str]) -> tuple[tuple[str, int], bytes] | None:
    """(address, secret) the launcher set -- the secret inherited (local ranks) or read from the
    file ``MLXSTACK_CONTROL_SECRET_FILE`` names (ranks mlx.launch starts: a command line is readable
    by every local user, a 0600 file is not; ``read_secret_file``) -- or None."""
    addr, secret = environ.get(ADDR_ENV, ""), environ.get(SECRET_ENV, "")
    path = environ.get(SECRET_FILE_ENV, "")
    if not addr or not (secret or path):
        return None
    return parse_address(addr), bytes.fromhex(secret) if secret else read_secret_file(path)


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``: a regular file of this user's that no other user may read or write,
    holding 64 hex digits; else ControlSecretError saying what to do (never what the file holds)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ControlSecretError(f"the control channel's secret file {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise ControlSecretError(f"the control channel's secret file {path} belongs to another user")
        if st.st_mode & 0o077:
            raise ControlSecretError(f"the control channel's secret file {path} is open to other users "
                                     f"(mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}")
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(4 * _SECRET_BYTES).strip()
    except FileNotFoundError:
        raise ControlSecretError(f"the control channel's secret file {path} is not on this host: copy it once "
                                 "from rank 0's host to the same path here (docs/distributed.md)") from None
    except PermissionError as exc:
        raise ControlSecretError(f"the control channel's secret file {path} cannot be read: {exc.strerror}") from None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != _SECRET_BYTES:
        raise ControlSecretError(f"{path} holds no control secret ({2 * _SECRET_BYTES} hex digits): remove it on "
                                 "rank 0's host, start again and copy the new file to every host")
    return secret


def group_secret_file(folder: Path | str) -> tuple[str, bool]:
    """(path, made now) of the group's one secret file, ``folder/control.key``: made once -- a 0600
    file of a 0700 folder of this user's, whole before it has its name, so two launches at once keep
    the same one -- and reused by every later launch, so it is copied to every host once. A file
    that fails ``read_secret_file`` is refused (ControlSecretError), never replaced: the copies on
    the other hosts would stop matching. Files an older version left, one per launch
    (``control-*.key``), are removed."""
    from .secrets import make_private_dir

    where = make_private_dir(Path(folder).expanduser())
    for old in where.glob("control-*.key"):
        try:
            old.unlink()
        except OSError:
            pass
    path = where / SECRET_FILE_NAME
    made = False
    if not os.path.lexists(path):
        fd, tmp = tempfile.mkstemp(prefix=".control.", suffix=".tmp", dir=str(where))   # mkstemp creates 0600
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(new_secret() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)      # never over a file another launch made in the meantime
                made = True
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    read_secret_file(str(path))
    return str(path), made


def _mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with ``deadline`` (monotonic) the whole read must finish by then."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the control channel's hello took too long")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the control channel was closed")
        buf += chunk
    return bytes(buf)


def session_keys(secret: bytes, rank: int, nonce_f: bytes, nonce_l: bytes) -> tuple[bytes, bytes]:
    """(rank 0 -> follower key, follower -> rank 0 key) for one connection (pure)."""
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=nonce_f + nonce_l,
               info=b"mlxstack control v1" + _HEAD.pack(rank)).derive(secret)
    return okm[:32], okm[32:]


def _proof(secret: bytes, who: bytes, rank: int, nonce_f: bytes, nonce_l: bytes) -> bytes:
    return _mac(secret, who + _HEAD.pack(rank) + nonce_f + nonce_l)


class _Link:
    """One connection's sealed frames: its key a direction and a sequence number each way."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self._seal, self._open = ChaCha20Poly1305(send_key), ChaCha20Poly1305(recv_key)
        self.sent = self.received = 0
        self.inbox = bytearray()

    def frame(self, payload: bytes) -> bytes:
        head = _HEAD.pack(len(payload) + _TAG)
        body = self._seal.encrypt(self.sent.to_bytes(12, "big"), payload, head)
        self.sent += 1
        return head + body

    def open(self, head: bytes, body: bytes) -> bytes:
        try:
            payload = self._open.decrypt(self.received.to_bytes(12, "big"), body, head)
        except InvalidTag:
            raise ConnectionError("a control message failed authentication") from None
        self.received += 1
        return payload


def _length(head: bytes) -> int:
    n = _HEAD.unpack(head)[0]
    if not _TAG <= n <= MAX_FRAME:
        raise ConnectionError(f"a control frame of {n} bytes failed authentication")
    return n


class ControlChannel:
    def __init__(self, links: list[_Link]) -> None:
        self.links = links

    @property
    def socks(self) -> list[socket.socket]:
        return [link.sock for link in self.links]

    @classmethod
    def lead(cls, address: tuple[str, int], secret: bytes, followers: int, timeout: float = 600.0,
             server: socket.socket | None = None) -> "ControlChannel":
        """Rank 0: listen on ``address`` (or on ``server``, bound and listening already) and accept
        ``followers`` ranks that complete the hello, each hello in a thread of its own under
        ``HELLO_SECONDS``; GroupNotFormed naming the missing ranks after ``timeout``."""
        server = server or _RESERVED.pop(address, None)
        if server is None:
            server = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(address)
            server.listen(followers + 16)
        by_rank: dict[int, _Link] = {}
        lock = threading.Lock()
        deadline = time.monotonic() + timeout

        def hello(conn: socket.socket) -> None:
            try:
                link = cls._greet(conn, secret, followers, min(deadline, time.monotonic() + HELLO_SECONDS))
            except (OSError, EOFError, ValueError, ConnectionError):
                conn.close()             # not one of ours, or too slow: only this connection is lost
                return
            with lock:
                rank = link[0]
                if rank in by_rank:
                    conn.close()
                    return
                by_rank[rank] = link[1]

        try:
            while True:
                with lock:
                    if len(by_rank) >= followers:
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    with lock:
                        missing = sorted(set(range(1, followers + 1)) - set(by_rank))
                    raise GroupNotFormed(f"the control channel formed {followers - len(missing)} of {followers} "
                                       f"follower ranks in {timeout:g} s (missing: {missing})")
                server.settimeout(min(0.2, left))
                try:
                    conn, _ = server.accept()
                except (socket.timeout, TimeoutError):
                    continue
                threading.Thread(target=hello, args=(conn,), daemon=True, name="control-hello").start()
        finally:
            server.close()
        return cls([by_rank[r] for r in sorted(by_rank)])

    @staticmethod
    def _greet(conn: socket.socket, secret: bytes, followers: int, deadline: float) -> tuple[int, _Link]:
        """Rank 0's side of one hello: (rank, its link), or an exception."""
        first = _read_exact(conn, len(_MAGIC) + _HEAD.size + _NONCE, deadline)
        if first[:len(_MAGIC)] != _MAGIC:
            raise ValueError("not a control hello")
        rank = _HEAD.unpack(first[len(_MAGIC):len(_MAGIC) + _HEAD.size])[0]
        nonce_f = first[-_NONCE:]
        if not 0 < rank <= followers:
            raise ValueError("no such rank")
        nonce_l = os.urandom(_NONCE)
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        conn.sendall(nonce_l + _proof(secret, b"leader", rank, nonce_f, nonce_l))
        answer = _read_exact(conn, _MAC, deadline)
        if not hmac.compare_digest(answer, _proof(secret, b"follower", rank, nonce_f, nonce_l)):
            raise ValueError("the hello failed authentication")
        down, up = session_keys(secret, rank, nonce_f, nonce_l)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return rank, _Link(conn, down, up)

    @classmethod
    def follow(cls, address: tuple[str, int], secret: bytes, rank: int, timeout: float = 600.0) -> "ControlChannel":
        """A follower: connect to rank 0 (retrying while it starts), prove the secret and check that
        rank 0 holds it too."""
        deadline = time.monotonic() + timeout
        where = f"{address[0]}:{address[1]}"
        while True:
            try:
                sock = socket.create_connection(address, timeout=10.0)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise GroupNotFormed(f"rank {rank} could not reach rank 0's control channel at {where}: "
                                         f"{exc}") from exc
                time.sleep(0.2)
        nonce_f = os.urandom(_NONCE)
        try:
            sock.sendall(_MAGIC + _HEAD.pack(rank) + nonce_f)
            reply = _read_exact(sock, _NONCE + _MAC, time.monotonic() + max(HELLO_SECONDS, 1.0))
        except (OSError, EOFError) as exc:
            sock.close()
            raise GroupNotFormed(f"rank {rank}'s hello to {where} failed: {exc}") from exc
        nonce_l, proof = reply[:_NONCE], reply[_NONCE:]
        if not hmac.compare_digest(proof, _proof(secret, b"leader", rank, nonce_f, nonce_l)):
            sock.close()
            raise GroupNotFormed(f"the control channel at {where} is not rank 0's (its hello failed authentication)")
        sock.sendall(_proof(secret, b"follower", rank, nonce_f, nonce_l))
        down, up = session_keys(secret, rank, nonce_f, nonce_l)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls([_Link(sock, up, down)])

    def send(self, payload: bytes) -> None:
        """Rank 0: ``payload`` to every follower (sealed for each)."""
        for link in self.links:
            link.sock.sendall(link.frame(payload))

    def recv(self) -> bytes:
        """A follower: rank 0's next message (blocks; EOFError when rank 0 is gone, ConnectionError
        for a frame that fails authentication)."""
        link = self.links[0]
        head = _read_exact(link.sock, _HEAD.size)
        return link.open(head, _read_exact(link.sock, _length(head)))

    def report(self, payload: bytes) -> None:
        """A follower: a small message back to rank 0 (its memory, for /metrics); never waited for."""
        self.send(payload)

    def reports(self) -> list[tuple[int, bytes]]:
        """Rank 0: (follower index, payload) for every whole report that has arrived (no waiting);
        a frame that fails authentication is dropped with the rest of that follower's buffer."""
        out = []
        for i, link in enumerate(self.links):
            buf = link.inbox
            while True:
                try:
                    chunk = link.sock.recv(65536, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    break
                if not chunk:
                    break
                buf += chunk
            while len(buf) >= _HEAD.size:
                head = bytes(buf[:_HEAD.size])
                try:
                    n = _length(head)
                except ConnectionError:
                    buf.clear()
                    break
                if len(buf) < _HEAD.size + n:
                    break
                body = bytes(buf[_HEAD.size:_HEAD.size + n])
                del buf[:_HEAD.size + n]
                try:
                    out.append((i, link.open(head, body)))
                except ConnectionError:
                    buf.clear()
                    break
        return out

    def close(self) -> None:
        for link in self.links:
            try:
                link.sock.close()
            except OSError:
                pass
