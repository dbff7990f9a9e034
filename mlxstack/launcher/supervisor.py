"""Child processes for the stack: start with prefixed output, watch, stop as a group.

Policy (launcher/stack.py): a crashed MLX server (killed, OOM) is restarted with backoff under a
crash-loop limit (launcher/restarts.py), LiteLLM staying up meanwhile so clients keep their
connection to the proxy; a configuration error or a failed model load is never restarted (it
would loop on the same error and bury it). If LiteLLM dies the launcher stops everything.

Each child gets its own session (process group) so a terminal Ctrl-C reaches only the launcher,
which then stops the children in a known order and within a known time; stopping signals the
whole group so grandchildren (LiteLLM workers) go too. On Linux the children also get
PR_SET_PDEATHSIG so they die with the launcher even if it is SIGKILLed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Mapping, Sequence

_PR_SET_PDEATHSIG = 1


def _load_prctl():
    """Resolved in the parent: importing/loading in the forked child could deadlock on locks
    held by the parent's other threads (the output pumps)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def die_with_parent() -> None:
    """In a child between fork and exec: SIGTERM it when its parent dies (Linux; elsewhere a no-op)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))



@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    pump: threading.Thread | None = None
    started: float = field(default_factory=time.monotonic)
    tail: deque = field(default_factory=lambda: deque(maxlen=200))  # its last output lines

    def last_line_with(self, marker: str) -> str | None:
        """The last output line containing ``marker`` (after the pump has drained the pipe)."""
        if self.pump is not None:
            self.pump.join(timeout=2)
        for line in reversed(self.tail):
            if marker in line:
                return line
        return None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()


def _pump(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock, tail: deque) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        with lock:
            try:
                out.write(f"{prefix} {line}\n")
                out.flush()
            except (OSError, ValueError):
                pass
    stream.close()


class Supervisor:
    def __init__(self, out: IO[str] | None = None) -> None:
        self.children: list[Child] = []
        self.out = out or sys.stdout
        self._lock = threading.Lock()

    def start(self, name: str, cmd: Sequence[str], env: Mapping[str, str], cwd: str | None = None,
              pass_fds: Sequence[int] = ()) -> Child:
        proc = subprocess.Popen(
            list(cmd), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent, pass_fds=tuple(pass_fds),
        )
        child = Child(name, proc)
        child.pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{name}]", self.out, self._lock, child.tail),
                                      daemon=True)
        child.pump.start()
        self.children.append(child)
        return child

    def forget(self, child: Child) -> None:
        """Drop an exited child (before starting its replacement), reaping it and its group."""
        if child in self.children:
            self.children.remove(child)
        try:
            child.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(child, signal.SIGKILL)  # grandchildren left in its process group
        if child.pump:
            child.pump.join(timeout=1)

    def say(self, msg: str) -> None:
        with self._lock:
            self.out.write(f"[launcher] {msg}\n")
            self.out.flush()

    def first_exited(self) -> Child | None:
        for child in self.children:
            if child.poll() is not None:
                return child
        return None

    def wait_any(self, timeout: float | None = None, interval: float = 0.2) -> Child | None:
        """Block until a child exits (returned) or ``timeout`` passes (None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            child = self.first_exited()
            if child:
                return child
            time.sleep(interval)
        return self.first_exited()

    def terminate(self, child: Child, grace: float = 5.0) -> None:
        """Stop one child's process group: SIGTERM, SIGKILL if it is still there after ``grace`` s
        (it stays listed: the caller sees it exit like any other child)."""
        _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if child.poll() is None:
            self.say(f"{child.name} (pid {child.pid}) ignored SIGTERM for {grace:g}s; sending SIGKILL")
            _signal_group(child, signal.SIGKILL)
            try:
                child.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def stop_all(self, grace: float = 3.0) -> None:
        """SIGTERM every child's group at once, SIGKILL what is left after ``grace`` s."""
        running = [c for c in self.children if c.poll() is None]
        for child in running:
            _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline:
            running = [c for c in running if c.poll() is None]
            time.sleep(0.05)
        for child in running:
            self.say(f"{child.name} (pid {child.pid}) ignored SIGTERM for {grace:g}s; sending SIGKILL")
            _signal_group(child, signal.SIGKILL)
        for child in self.children:
            try:
                child.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(child, signal.SIGKILL)  # stragglers left in the group after the leader exited
            if child.pump:
                child.pump.join(timeout=1)


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)  # the child is its own group leader (start_new_session)
    except (ProcessLookupError, PermissionError):
        if child.proc.returncode is None:  # never signal a reaped pid: it may be reused
            try:
                os.kill(child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
