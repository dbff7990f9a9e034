#!/usr/bin/env python3
"""Soak: bounded hostile + ordinary traffic against the whole stack, then checks nothing broke.

    .venv/bin/python scripts/soak.py                      # starts its own stack on free ports
    .venv/bin/python scripts/soak.py --proxy-url http://127.0.0.1:4000/v1 --mlx-url http://127.0.0.1:8080 \\
        --key "$LITELLM_MASTER_KEY" --mlx-key "$MLX_API_KEY"   # attach to a running stack (same machine)

What it does, through LiteLLM (4000) and straight at the MLX server (8080):
1. a reference conversation (greedy, two turns) and the MLX server's RSS;
2. mixed load from a few client threads: multi-turn sessions (streaming and not), clients hanging up
   mid-stream, the bad-input battery (malformed JSON and numbers, unsupported fields and parts,
   bad headers, wrong / missing keys, hostile Host / Origin), slow-header clients;
3. a burst past MAX_QUEUED_REQUESTS (503 + Retry-After expected for some);
4. kill -9 of the MLX server mid-stream: records what LiteLLM answers while the backend is down
   and how long until the launcher's restart serves again (skip with --no-kill);
5. final checks: both servers healthy, no unexpected 5xx, the reference conversation gives the
   same greedy output as before the soak, RSS before / after.

Prints requests, faults survived, bad inputs tried, the 5xx count and RSS; exits 1 when a check fails.
Expected non-2xx answers are not failures: 4xx for bad input, 503 + Retry-After for bursts, and
anything during the kill window (reported separately).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

Q = "What is the capital of France?"

# ----------------------------------------------------------------------------- bookkeeping
@dataclass
class Tally:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)        # (target, status) -> n
    unexpected: list = field(default_factory=list)            # (what, target, status, detail)
    fault_window: list = field(default_factory=list)          # (what, target, status/exception, detail)
    bad_inputs: int = 0
    faults: list = field(default_factory=list)                # (fault, outcome)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_fault: threading.Event = field(default_factory=threading.Event)

    def record(self, what: str, target: str, status: int | str, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.requests += 1
            self.statuses[(target, status)] += 1
            if not ok:
                (self.fault_window if self.in_fault.is_set() else self.unexpected).append(
                    (what, target, status, detail[:300]))

    def five_xx(self) -> int:
        return sum(n for (_, status), n in self.statuses.items() if isinstance(status, int) and status >= 500)


# ----------------------------------------------------------------------------- HTTP
@dataclass
class Target:
    name: str          # "proxy" | "mlx"
    base: str          # .../v1
    key: str
    model: str

    @property
    def hostport(self) -> tuple[str, int]:
        parts = urlsplit(self.base)
        return parts.hostname or "127.0.0.1", parts.port or 80

    @property
    def path_prefix(self) -> str:
        return urlsplit(self.base).path.rstrip("/")


def send(target: Target, path: str, body: bytes | None, headers: dict[str, str] | None = None, *,
         method: str = "POST", timeout: float = 300.0, key: str | None = "default",
         absolute: bool = False) -> tuple[int, dict, bytes]:
    """One request; ``path`` is under the target's /v1 unless ``absolute``."""
    host, port = target.hostport
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    hdrs = {"Content-Type": "application/json"}
    if key == "default":
        key = target.key
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    hdrs.update(headers or {})
    try:
        conn.request(method, path if absolute else target.path_prefix + path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def chat_body(target: Target, messages: list[dict], **kw) -> bytes:
    return json.dumps({"model": target.model, "messages": messages, **kw}).encode()


def stream_text(raw: bytes) -> tuple[str, list]:
    text, events = "", []
    for frame in raw.decode("utf-8", "replace").split("\n\n"):
        if not frame.startswith("data: "):
            continue
        data = frame[6:]
        if data == "[DONE]":
            events.append("[DONE]")
            continue
        try:
            ev = json.loads(data)
        except ValueError:
            continue
        events.append(ev)
        for choice in ev.get("choices") or []:
            text += (choice.get("delta") or {}).get("content") or ""
    return text, events


def reply_text(status: int, raw: bytes, stream: bool) -> str | None:
    if status != 200:
        return None
    if stream:
        text, events = stream_text(raw)
        return text if events and events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events) else None
    try:
        return json.loads(raw)["choices"][0]["message"]["content"] or ""
    except (ValueError, KeyError, IndexError, TypeError):
        return None


# ----------------------------------------------------------------------------- traffic
def session(t: Tally, target: Target, rng: random.Random, turns: int, max_tokens: int) -> None:
    messages = [{"role": "system", "content": f"You are a terse assistant. Session {rng.random():.6f}."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": rng.choice(["Name a colour.", "Count to three.", Q,
                                                                "Say hello.", "Give one word."])})
        stream = rng.random() < 0.5
        try:
            status, _, raw = send(target, "/chat/completions",
                                  chat_body(target, messages, max_tokens=max_tokens, temperature=0, stream=stream))
        except OSError as exc:
            t.record("session", target.name, type(exc).__name__, False, str(exc))
            return
        text = reply_text(status, raw, stream)
        t.record("session", target.name, status, text is not None, raw[:200].decode("utf-8", "replace"))
        if text is None:
            return
        messages.append({"role": "assistant", "content": text})


def hang_up(t: Tally, target: Target, after_frames: int = 2) -> None:
    """A client that reads a couple of events and closes the socket mid-stream."""
    body = chat_body(target, [{"role": "user", "content": "Write a long story about a lighthouse."}],
                     max_tokens=200, temperature=0.7, stream=True)
    host, port = target.hostport
    try:
        with socket.create_connection((host, port), timeout=120) as s:
            s.sendall(f"POST {target.path_prefix}/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                      f"Content-Type: application/json\r\nAuthorization: Bearer {target.key}\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            got = b""
            while got.count(b"data: ") < after_frames:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
        status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else "no-status"
        t.record("hang-up", target.name, status, status == 200, got[:200].decode("utf-8", "replace"))
    except OSError as exc:
        t.record("hang-up", target.name, type(exc).__name__, False, str(exc))


def battery(target: Target, vocab: int) -> list[tuple[str, bytes, dict, int | None]]:
    """(name, body, extra headers, expected status or None = any 4xx)."""
    m = target.model
    q = [{"role": "user", "content": "hi"}]

    def j(**kw) -> bytes:
        return json.dumps({"model": m, "messages": q, "max_tokens": 4, **kw}).encode()

    cases = [
        ("not json", b"{not json", {}, 400),
        ("json array", b"[1, 2]", {}, 400),
        ("NaN temperature", j()[:-1] + b', "temperature": NaN}', {}, 400),
        ("Infinity min_p", j()[:-1] + b', "min_p": Infinity}', {}, 400),
        ("1e999 top_p", j()[:-1] + b', "top_p": 1e999}', {}, 400),
        ("4400-digit seed", j()[:-1] + b', "seed": ' + b"7" * 4400 + b"}", {}, 400),
        ("seed -1", j(seed=-1), {}, 400),
        ("seed 2**64", j(seed=2**64), {}, 400),
        ("deep nesting", b'{"x": ' + b"[" * 20000 + b"]" * 20000 + b"}", {}, 400),
        ("lone surrogate", json.dumps({"model": m, "messages": [{"role": "user", "content": "\ud800"}]}).encode(), {}, 400),
        ("top_k > vocab", j(top_k=vocab + 1), {}, 400),
        ("temperature -1", j(temperature=-1), {}, 400),
        ("max_tokens 0", j(max_tokens=0), {}, 400),
        ("max_tokens 2**40", j(max_tokens=2**40), {}, 400),
        ("n=2", j(n=2), {}, 400),
        ("input_audio part", json.dumps({"model": m, "messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}).encode(), {}, 400),
        ("file part", json.dumps({"model": m, "messages": [{"role": "user", "content": [
            {"type": "file", "file": {"file_id": "x"}}]}]}).encode(), {}, 400),
        ("unknown role", json.dumps({"model": m, "messages": [{"role": "wizard", "content": "x"}]}).encode(), {}, 400),
        ("empty messages", json.dumps({"model": m, "messages": []}).encode(), {}, 400),
        ("content int", json.dumps({"model": m, "messages": [{"role": "user", "content": 5}]}).encode(), {}, 400),
        ("user message without content", json.dumps({"model": m, "messages": [{"role": "user"}]}).encode(), {}, 400),
        ("orphan tool result", json.dumps({"model": m, "messages": [
            {"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}]}).encode(), {}, 400),
        ("tool result for another call", json.dumps({"model": m, "messages": [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c9", "content": "42"}]}).encode(), {}, 400),
        ("unknown part type", json.dumps({"model": m, "messages": [{"role": "user", "content": [
            {"type": "video", "url": "x"}]}]}).encode(), {}, 400),
        ("logit_bias out of vocab", j(logit_bias={str(vocab + 5): 5}), {}, 400),
        ("top_logprobs without logprobs", j(top_logprobs=3), {}, 400),
        ("tool_choice unknown function", j(tools=[{"type": "function", "function": {"name": "a", "parameters": {}}}],
                                           tool_choice={"type": "function", "function": {"name": "b"}}), {}, 400),
        ("response_format yaml", j(response_format={"type": "yaml"}), {}, 400),
        ("image to text model", json.dumps({"model": m, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}).encode(), {}, 400),
        ("unknown model", json.dumps({"model": "no-such-model", "messages": q}).encode(), {}, None),
    ]
    if target.name == "mlx":  # header-level cases only the MLX server sees as sent
        cases += [
            ("text/plain body", j(), {"Content-Type": "text/plain"}, 415),
            ("hostile Host", j(), {"Host": "attacker.example"}, 403),
            ("cross-site Origin", j(), {"Origin": "http://evil.example"}, 403),
        ]
    return cases


def run_battery(t: Tally, target: Target, vocab: int) -> None:
    for name, body, headers, expected in battery(target, vocab):
        t.bad_inputs += 1
        try:
            status, _, raw = send(target, "/chat/completions", body, headers)
        except OSError as exc:
            t.record(f"bad: {name}", target.name, type(exc).__name__, False, str(exc))
            continue
        if target.name == "proxy":  # the front door or LiteLLM answer some of these with their own 4xx
            expected = None
        ok = status == expected if expected is not None else 400 <= status < 500
        t.record(f"bad: {name}", target.name, status, ok, raw[:200].decode("utf-8", "replace"))
    for name, key in (("wrong key", "sk-wrong-key"), ("no key", None)):
        t.bad_inputs += 1
        status, _, raw = send(target, "/chat/completions", chat_body(target, [{"role": "user", "content": "hi"}]),
                              key=key)
        t.record(f"bad: {name}", target.name, status, 400 <= status < 500, raw[:200].decode("utf-8", "replace"))


def raw_socket_cases(t: Tally, target: Target) -> None:
    """Broken framing only a raw socket can send (MLX server)."""
    host, port = target.hostport
    cases = [
        ("Content-Length -1", b"Content-Length: -1\r\n", b"{}", 400),
        ("Content-Length +5", b"Content-Length: +5\r\n", b"{}", 400),
        ("no Content-Length", b"", b"", 411),
        ("chunked body", b"Transfer-Encoding: chunked\r\n", b"0\r\n\r\n", 411),
        ("Content-Length 10**12", b"Content-Length: 1000000000000\r\n", b"", 413),
    ]
    for name, header, body, expected in cases:
        t.bad_inputs += 1
        start = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=30) as s:
                s.sendall(f"POST {target.path_prefix}/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                          f"Content-Type: application/json\r\nAuthorization: Bearer {target.key}\r\n".encode()
                          + header + b"\r\n" + body)
                got = b""
                while chunk := s.recv(65536):
                    got += chunk
            status = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else "no-status"
        except OSError as exc:
            status, got = type(exc).__name__, b""
        ok = status == expected and time.monotonic() - start < 10
        t.record(f"bad: {name}", target.name, status, ok, got[:200].decode("utf-8", "replace"))


def slow_header_client(t: Tally, target: Target, limit: float) -> None:
    host, port = target.hostport
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=60) as s:
            s.sendall(f"POST {target.path_prefix}/chat/completions HTTP/1.1\r\nHost: {host}\r\n".encode())
            while time.monotonic() - start < limit * 4:
                try:
                    s.sendall(b"X")
                    s.settimeout(0.5)
                    if s.recv(4096) == b"":
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
    except OSError:
        pass
    held = time.monotonic() - start
    dropped = held < limit + 2.5
    t.faults.append(("slow-header client", f"dropped after {held:.1f}s" if dropped else f"held {held:.1f}s"))
    t.record("slow header", target.name, "dropped" if dropped else "held", dropped)


def burst(t: Tally, target: Target, n: int) -> dict:
    results: list = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            status, headers, raw = send(target, "/chat/completions",
                                        chat_body(target, [{"role": "user", "content": f"Burst {i}: say ok."}],
                                                  max_tokens=8, temperature=0))
        except OSError as exc:
            status, headers, raw = type(exc).__name__, {}, b""
        with lock:
            results.append((status, headers, raw))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    counts = Counter(r[0] for r in results)
    for status, headers, raw in results:
        ok = status == 200 or (status == 503 and "Retry-After" in headers)
        t.record("burst", target.name, status, ok, raw[:200].decode("utf-8", "replace"))
    t.faults.append((f"burst of {n} at {target.name}", dict(counts)))
    return dict(counts)


# ----------------------------------------------------------------------------- processes
def port_pid(port: int) -> int | None:
    """The MLX server process listening on ``port`` (the launcher holds the socket too)."""
    from mlxstack.launcher.ports import port_owners

    owners = port_owners(port)
    servers = [o for o in owners if any("mlxstack.serve" in a for a in o.cmdline)]
    return (servers or owners)[0].pid if owners else None


def rss_mib(pid: int | None) -> float | None:
    from mlxstack.models.memory import process_rss_bytes

    rss = process_rss_bytes(pid) if pid is not None else 0
    return rss / 2 ** 20 if rss else None


class OwnStack:
    """start_llm's stack (run_stack) on free ports with fresh keys, in a child process."""

    def __init__(self, work: Path, max_queued: int, header_timeout: float) -> None:
        from mlxstack.launcher.ports import port_is_free  # noqa: F401 - import check before starting

        def free() -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        self.mlx_port, self.proxy_port = free(), free()
        self.key, self.mlx_key = "sk-soak-" + secrets.token_urlsafe(24), "sk-mlx-" + secrets.token_urlsafe(24)
        env = {"MLX_PORT": str(self.mlx_port), "PROXY_PORT": str(self.proxy_port), "LITELLM_MASTER_KEY": self.key,
               "MLX_API_KEY": self.mlx_key, "LOG_ROOT": str(work / "logs"), "DEFAULT_TEMPERATURE": "0",
               "DEFAULT_MAX_TOKENS": "32", "MAX_QUEUED_REQUESTS": str(max_queued),
               "MLX_HEADER_TIMEOUT_SECONDS": str(header_timeout), "PROXY_STARTUP_TIMEOUT_SECONDS": "240",
               "MLX_MAX_RESTARTS": "5"}
        if os.environ.get("MODEL_CACHE_DIR"):
            env["MODEL_CACHE_DIR"] = os.environ["MODEL_CACHE_DIR"]
        code = ("import sys; from pathlib import Path; from mlxstack.config.settings import load_settings; "
                "from mlxstack.launcher.stack import run_stack; "
                f"sys.exit(run_stack(load_settings(env={env!r}), repo=Path({str(REPO)!r})))")
        self.log_path = work / "stack.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 600
        while "READY" not in self.log_path.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("stack did not start:\n" + self.log_path.read_text()[-3000:])
            time.sleep(0.5)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self.log.close()
        return self.proc.returncode


# ----------------------------------------------------------------------------- phases
def reference_conversation(target: Target) -> list[str]:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    replies = []
    for turn in (Q, "And of Italy?"):
        messages.append({"role": "user", "content": turn})
        status, _, raw = send(target, "/chat/completions", chat_body(target, messages, max_tokens=24, temperature=0))
        if status != 200:
            raise SystemExit(f"reference conversation failed on {target.name}: {status} {raw[:300]!r}")
        replies.append(json.loads(raw)["choices"][0]["message"]["content"])
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def kill_mid_stream(t: Tally, proxy: Target, mlx: Target, mlx_port: int, recovery_timeout: float) -> dict:
    """kill -9 the MLX server while a stream through LiteLLM is running. Meanwhile a sampler thread
    sends a request through LiteLLM every 0.25 s (and polls the MLX /health), recording what
    clients get until LiteLLM serves again."""
    pid = port_pid(mlx_port)
    out: dict = {"killed_pid": pid}
    body = chat_body(proxy, [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
                     max_tokens=300, temperature=0.7, stream=True)
    host, port = proxy.hostport
    samples: list = []
    done = threading.Event()

    def sampler(killed_at: float) -> None:
        while not done.is_set() and time.monotonic() - killed_at < recovery_timeout:
            sent = time.monotonic()
            try:
                status, _, raw = send(proxy, "/chat/completions",
                                      chat_body(proxy, [{"role": "user", "content": "ping"}], max_tokens=2), timeout=60)
            except OSError as exc:
                status, raw = type(exc).__name__, str(exc).encode()
            try:
                health = send(mlx, "/health", None, method="GET", key=None, absolute=True, timeout=5)[0]
            except OSError as exc:
                health = type(exc).__name__
            samples.append((round(sent - killed_at, 2), round(time.monotonic() - sent, 2), status, health,
                            raw[:240].decode("utf-8", "replace")))
            t.record("during backend restart", "proxy", status, status == 200, raw[:200].decode("utf-8", "replace"))
            if status == 200:
                return
            time.sleep(0.25)

    t.in_fault.set()
    conn = http.client.HTTPConnection(host, port, timeout=120)
    conn.request("POST", proxy.path_prefix + "/chat/completions", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {proxy.key}"})
    resp = conn.getresponse()
    before, after, finish, error, saw_done = 0, 0, None, None, False
    killed_at = None
    thread = None
    try:
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                saw_done = True
                continue
            ev = json.loads(data)
            if "error" in ev:
                error = ev["error"]
            for choice in ev.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    if killed_at is None:
                        before += 1
                    else:
                        after += 1
                finish = choice.get("finish_reason") or finish
            if killed_at is None and before >= 3:
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
                thread = threading.Thread(target=sampler, args=(killed_at,))
                thread.start()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        error = error or f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    stream_end = time.monotonic()
    if thread is not None:
        thread.join(recovery_timeout + 60)
    done.set()
    t.in_fault.clear()
    recovered = next((s for s in samples if s[2] == 200), None)
    out.update(stream={"status": resp.status, "content_chunks_before_kill": before, "content_chunks_after_kill": after,
                       "finish_reason": finish, "error_event": error, "done": saw_done,
                       "ended_s_after_kill": None if killed_at is None else round(stream_end - killed_at, 2)},
               samples=samples,
               recovered_after_s=None if recovered is None else round(recovered[0] + recovered[1], 1),
               new_pid=port_pid(mlx_port))
    t.faults.append(("kill -9 of the MLX server mid-stream",
                     f"recovered after {out['recovered_after_s']}s" if recovered else "NOT recovered"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proxy-url", help="attach: LiteLLM base URL (…/v1); default: start an own stack")
    ap.add_argument("--mlx-url", help="attach: MLX server root URL")
    ap.add_argument("--key", default="", help="attach: LITELLM_MASTER_KEY")
    ap.add_argument("--mlx-key", default="", help="attach: MLX_API_KEY (empty if the server has none)")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--sessions", type=int, default=16, help="multi-turn sessions in the mixed phase")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--hangups", type=int, default=6)
    ap.add_argument("--slow-headers", type=int, default=3)
    ap.add_argument("--burst", type=int, default=20)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-kill", action="store_true", help="skip the kill -9 fault (an attached stack without restarts)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    started = time.monotonic()
    stack = None
    header_timeout = 3.0
    if args.proxy_url:
        proxy_base, mlx_root, key, mlx_key = args.proxy_url.rstrip("/"), (args.mlx_url or "http://127.0.0.1:8080"), args.key, args.mlx_key
        max_queued = None
    else:
        max_queued = 4
        work = Path(tempfile.mkdtemp(prefix="soak-"))
        print(f"[soak] starting an own stack (log: {work / 'stack.log'}) ...", flush=True)
        stack = OwnStack(work, max_queued=max_queued, header_timeout=header_timeout)
        proxy_base, mlx_root = f"http://127.0.0.1:{stack.proxy_port}/v1", f"http://127.0.0.1:{stack.mlx_port}"
        key, mlx_key = stack.key, stack.mlx_key
    proxy = Target("proxy", proxy_base, key, args.model)
    mlx = Target("mlx", mlx_root.rstrip("/") + "/v1", mlx_key, args.model)
    mlx_port = mlx.hostport[1]
    t = Tally()
    code = 1
    try:
        _, _, raw = send(mlx, "/models", None, method="GET")
        vocab = 49152 if "SmolLM2" in args.model else 10**6
        print(f"[soak] proxy {proxy.base}  mlx {mlx.base}  model {json.loads(raw)['data'][0]['id']}", flush=True)
        reference = reference_conversation(proxy)
        reference_direct = reference_conversation(mlx)
        rss_before = rss_mib(port_pid(mlx_port))
        print(f"[soak] reference replies: {reference}  (direct: {reference_direct == reference}); "
              f"MLX RSS {rss_before:.0f} MiB", flush=True)

        # mixed phase: a shuffled job list run by a few client threads
        jobs = ([("session", rng.choice([proxy, mlx])) for _ in range(args.sessions)]
                + [("hangup", rng.choice([proxy, mlx])) for _ in range(args.hangups)]
                + [("battery", proxy), ("battery", mlx), ("raw", mlx)]
                + [("slow", mlx) for _ in range(args.slow_headers)])
        rng.shuffle(jobs)
        lock = threading.Lock()

        def worker(wid: int) -> None:
            wrng = random.Random(args.seed * 1000 + wid)
            while True:
                with lock:
                    if not jobs:
                        return
                    kind, target = jobs.pop()
                if kind == "session":
                    session(t, target, wrng, args.turns, args.max_tokens)
                elif kind == "hangup":
                    hang_up(t, target)
                elif kind == "battery":
                    run_battery(t, target, vocab)
                elif kind == "raw":
                    raw_socket_cases(t, target)
                elif kind == "slow":
                    slow_header_client(t, target, header_timeout)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        print(f"[soak] mixed phase done: {t.requests} requests, {len(t.unexpected)} unexpected so far", flush=True)
        if max_queued is not None:
            counts = burst(t, mlx, args.burst)
            print(f"[soak] burst of {args.burst} straight at the MLX server (MAX_QUEUED_REQUESTS={max_queued}): {counts}",
                  flush=True)
        rss_loaded = rss_mib(port_pid(mlx_port))
        kill = None
        if not args.no_kill:
            kill = kill_mid_stream(t, proxy, mlx, mlx_port, recovery_timeout=240)
            print(f"[soak] kill -9 of pid {kill['killed_pid']} (new pid {kill['new_pid']}): stream {kill['stream']}",
                  flush=True)
            for sent, took, status, health, text in kill["samples"]:
                print(f"[soak]   +{sent:5.2f}s through LiteLLM -> {status} in {took:.2f}s (MLX /health: {health}): "
                      f"{text[:160]}", flush=True)

        # final checks
        health_ok = send(mlx, "/health", None, method="GET", key=None, absolute=True)[0] == 200
        after = reference_conversation(proxy)
        after_direct = reference_conversation(mlx)
        rss_after = rss_mib(port_pid(mlx_port))
        same = after == reference and after_direct == reference_direct
        recovered = kill is None or kill["recovered_after_s"] is not None
        print("\n[soak] ===== summary =====")
        print(f"  duration            {time.monotonic() - started:.0f} s")
        print(f"  requests            {t.requests}")
        print(f"  bad inputs tried    {t.bad_inputs}")
        print(f"  faults survived     {len(t.faults)}: " + "; ".join(f"{f} ({o})" for f, o in t.faults))
        print("  status counts       " + ", ".join(f"{tg} {st}: {n}" for (tg, st), n in sorted(t.statuses.items(), key=str)))
        print(f"  5xx answers         {t.five_xx()} in all; unexpected (outside the kill window): "
              f"{sum(1 for u in t.unexpected if isinstance(u[2], int) and u[2] >= 500)}")
        print(f"  unexpected answers  {len(t.unexpected)}")
        for u in t.unexpected[:20]:
            print(f"    {u}")
        print(f"  during kill window  {len(t.fault_window)} non-200 answers (expected)")
        print(f"  MLX RSS             before {rss_before:.0f} MiB, after load {rss_loaded:.0f} MiB, "
              f"end {rss_after:.0f} MiB" + (" (restarted process)" if kill else ""))
        print(f"  health ok           {health_ok}")
        print(f"  reference output    {'identical' if same else 'DIFFERENT'}: {after}")
        ok = health_ok and same and recovered and not t.unexpected
        print(f"  RESULT              {'GREEN' if ok else 'RED'}")
        code = 0 if ok else 1
    finally:
        if stack is not None:
            rc = stack.stop()
            print(f"[soak] own stack stopped (launcher exit {rc}); its log: {stack.log_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
