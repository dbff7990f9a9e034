"""The ranks of one distributed MLX server (DISTRIBUTED=tensor | pipeline), started as one unit.

The launcher starts one MLX server process, as always (its own process group, restarted with the
usual backoff and banner). With DISTRIBUTED on, that process is rank 0 and starts the others:

- ``DISTRIBUTED_LOCAL_RANKS=N``: ranks 1..N-1 on this machine, in rank 0's process group (the
  launcher's stop signals the whole group), each told to die with rank 0 (PR_SET_PDEATHSIG), over
  the ring backend on free 127.0.0.1 ports (a hostfile in mlx.launch's format; MLX_RANK /
  MLX_HOSTFILE set here, as mlx.launch would). Rank 0 watches them: one that exits ends rank 0
  too, so the launcher restarts every rank together.
- ``DISTRIBUTED_HOSTS=<hostfile>``: rank 0 becomes ``mlx.launch --hostfile ...`` (ssh to each
  host, MLX_RANK set per rank); mlx.launch's rank 0 runs here and answers HTTP.

    ranks = LocalRanks(settings.distributed_local_ranks, cmd)   # rank 0, before it loads
    ranks.claim()            # this process is rank 0: MLX_RANK / MLX_HOSTFILE in os.environ
    ranks.start(on_exit)     # once the model's files exist; on_exit(rank, code) if one ends
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..system.control_channel import ADDR_ENV, SECRET_ENV, new_secret, reserve
from .supervisor import die_with_parent

RANK_ENV = "MLX_RANK"
HOSTFILE_ENV = "MLX_HOSTFILE"
NOT_INHERITED = ("MLX_LISTEN_FD",)
STOP_GRACE = 2.0      # a rank that was stopped: how long rank 0 waits for its own stop before crying crash


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` now (all held open until every one is chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ring_hostfile(ports: Sequence[int], host: str = "127.0.0.1") -> list[list[str]]:
    """mlx's ring hostfile: one list of ``ip:port`` per rank (pure)."""
    return [[f"{host}:{p}"] for p in ports]


def rank_env(base: dict[str, str], rank: int, hostfile: str) -> dict[str, str]:
    """A rank's environment: ``base`` with its rank and the hostfile, minus rank 0's sockets (pure)."""
    env = {k: v for k, v in base.items() if k not in NOT_INHERITED}
    env[RANK_ENV] = str(rank)
    env[HOSTFILE_ENV] = hostfile
    return env


def launch_command(python: str, hostfile: str, backend: str, module_args: Sequence[str],
                   env: Mapping[str, str] = {}) -> list[str]:
    """``mlx.launch`` for ranks on other machines (DISTRIBUTED_HOSTS), with the interpreter named
    (without it the ranks exit 126 and mlx.launch still exits 0) and ``env`` passed to every rank
    (pure). mlx.launch puts ``--python`` in front of the command itself: the command after ``--``
    is the interpreter's arguments only (``python python -m ...`` runs the interpreter's binary
    as a script)."""
    launcher = str(Path(python).with_name("mlx.launch"))
    cmd = [launcher, "--hostfile", hostfile, "--python", python]
    if backend != "any":
        cmd += ["--backend", backend]
    for key, value in env.items():
        cmd += ["--env", f"{key}={value}"]
    return cmd + ["--", *module_args]


def control_for_hosts(hostfile: str) -> str:
    """``ip:0`` for the control channel of an mlx.launch group: rank 0's first IP in the hostfile
    and port 0 -- rank 0 binds a port there once it runs and tells the other ranks over the MLX
    group (server/app.py), so no port is picked here and bound later by another process."""
    with open(hostfile) as f:
        hosts = json.load(f)
    first = hosts[0]
    ips = (first.get("ips") or []) if isinstance(first, dict) else []
    ip = ips[0] if ips else "127.0.0.1"
    return f"[{ip}]:0" if ":" in ip else f"{ip}:0"


class LocalRanks:
    def __init__(self, count: int, cmd: Sequence[str]) -> None:
        self.count = count
        self.cmd = list(cmd)
        self.procs: dict[int, subprocess.Popen] = {}
        self.stopping = False
        fd, self.hostfile = tempfile.mkstemp(prefix="mlxstack-ranks-", suffix=".json")
        ring = free_ports(count)
        with os.fdopen(fd, "w") as f:
            json.dump(ring_hostfile(ring), f)
        # rank 0 (this process) sends each turn's record here (lockstep): bound now, never released
        self.control = reserve()
        self.secret = new_secret()

    def claim(self) -> None:
        """This process is rank 0 of the group (the others inherit the channel's address and secret)."""
        os.environ[RANK_ENV] = "0"
        os.environ[HOSTFILE_ENV] = self.hostfile
        os.environ[ADDR_ENV] = self.control
        os.environ[SECRET_ENV] = self.secret

    def start(self, on_exit: Callable[[int, int], None]) -> None:
        """Start ranks 1..N-1 and watch them."""
        base = dict(os.environ)
        for rank in range(1, self.count):
            self.procs[rank] = subprocess.Popen(self.cmd, env=rank_env(base, rank, self.hostfile),
                                                preexec_fn=die_with_parent, stdin=subprocess.DEVNULL)
        for rank, proc in self.procs.items():
            threading.Thread(target=self._watch, args=(rank, proc, on_exit), name=f"rank-{rank}-watch",
                             daemon=True).start()

    def _watch(self, rank: int, proc: subprocess.Popen, on_exit: Callable[[int, int], None]) -> None:
        code = proc.wait()
        if code in (0, -signal.SIGTERM):   # stopped: the same signal may be on its way to rank 0
            time.sleep(STOP_GRACE)
        if not self.stopping:
            on_exit(rank, code)

    def stop(self, grace: float = 3.0) -> None:
        """Signal every rank still running, wait a little, then kill what is left."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
        try:
            os.unlink(self.hostfile)
        except OSError:
            pass


def serve_command() -> list[str]:
    return [sys.executable, "-m", "mlxstack.serve"]
