"""Ranks that agree: what shapes a forward (the CPU kernels, the native attention call) and the
settings every rank must share, decided alike on every rank over real ring collectives between 3
local ranks (models/sharding.py ``agree`` / ``differing_settings``, backends/cpu/kernels.py
``agreed_modes``; LESSONS 60), and which settings may differ per host (``shared_settings``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxstack.config.settings import load_settings
from mlxstack.launcher.ranks import free_ports, rank_env, ring_hostfile


def run_ranks(code: str, tmp_path: Path, extra_env: dict, timeout: float, ranks: int = 3) -> list[str]:
    """``code`` as ``ranks`` real ring ranks over 127.0.0.1 (a hostfile in ``tmp_path``); each rank's
    stdout, after every rank exited 0."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(ring_hostfile(free_ports(ranks))))
    env = {**os.environ, **extra_env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=rank_env(env, r, str(hostfile)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-1500:] for _, err in results]
    return [out for out, _ in results]


_AGREE_RANK = """
import json, os, sys
import mlx.core as mx
from mlxstack.backends.cpu.kernels import agreed_modes
from mlxstack.models.sharding import agree, differing_settings
group = mx.distributed.init(strict=True, backend="ring")
cases = json.loads(os.environ["AGREE_CASES"])
out = []
for case in cases:
    local = case[group.rank()]
    if isinstance(local, dict):
        out.append(differing_settings(group, local))
    else:
        out.append(list(agreed_modes(group, *local)) if isinstance(local[0], str) else list(agree(group, *local)))
print(json.dumps(out), flush=True)
"""


@pytest.mark.e2e
def test_ranks_agree_on_what_shapes_the_forward(tmp_path):
    """Real ring collectives over 3 local ranks: ``agree`` gives every rank rank 0's say and
    whether all can; ``agreed_modes`` (the loader's CPU-kernel choice with ranks) turns the
    kernels on where rank 0 wants them and the native call only where every rank has it -- each
    rank deciding alone once ran another forward than its peers and hung the group (LESSONS 60);
    ``differing_settings`` names, on every rank alike, the settings some rank holds otherwise than
    rank 0 (the loader refuses to start then), and says so when the ranks' setting names differ."""
    cases = [[[True, True], [False, True], [False, True]],         # rank 0 says yes; all can
             [[False, True], [True, True], [True, False]],         # rank 0 says no; rank 2 cannot
             [["on", "auto"], ["off", "auto"], ["off", "off"]],    # kernels as rank 0; native off on rank 2
             [["off", "auto"], ["on", "auto"], ["on", "auto"]],    # rank 0 off: all off
             [["on", "auto"], ["on", "auto"], ["on", "auto"]],
             [{"A": "1", "B": "x"}, {"A": "1", "B": "x"}, {"A": "1", "B": "x"}],          # settings alike
             [{"A": "1", "B": "x", "C": "2"}, {"A": "1", "B": "y", "C": "2"}, {"A": "3", "B": "x", "C": "2"}],
             [{"A": "1"}, {"A": "1"}, {"A": "1", "B": "x"}]]                               # another version
    outs = run_ranks(_AGREE_RANK, tmp_path, {"AGREE_CASES": json.dumps(cases)}, timeout=240)
    got = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    from mlxstack.backends.cpu.kernels import native_kernel

    native = "auto" if native_kernel() is not None else "off"     # the same build on this machine
    want = [[True, True], [False, False], ["on", "off"], ["off", "off"], ["on", native],
            [], ["A", "B"], ["(the settings themselves: the ranks run different mlxstack versions)"]]
    assert got == [want, want, want]


def test_shared_settings_leave_out_what_is_host_local():
    from mlxstack.models.sharding import HOST_LOCAL_SETTINGS, shared_settings

    base = load_settings(env={"DISTRIBUTED": "tensor", "DISTRIBUTED_LOCAL_RANKS": "3"})
    other = load_settings(env={"DISTRIBUTED": "tensor", "DISTRIBUTED_LOCAL_RANKS": "3", "MLX_PORT": "9999",
                               "LOG_ROOT": "/elsewhere", "MODEL_CACHE_DIR": "/models", "MLX_API_KEY": "k"})
    assert shared_settings(base) == shared_settings(other)       # where files are, ports, keys: per host
    one, two = (load_settings(env={"DISTRIBUTED": "tensor", "DISTRIBUTED_LOCAL_RANKS": "3", "DRAFT_MODEL": p})
                for p in ("/a/draft", "/b/draft"))
    assert shared_settings(one) == shared_settings(two) and shared_settings(one)["DRAFT_MODEL"] == "set"
    assert shared_settings(base)["DRAFT_MODEL"] == ""             # a draft model or none: the same on every rank
    assert set(base.as_env()) - set(shared_settings(base)) == HOST_LOCAL_SETTINGS
    for name, value in (("MAX_CONCURRENT_SEQUENCES", "2"), ("SPECULATIVE", "off"), ("CPU_KERNELS", "off"),
                        ("PROMPT_CACHE_MAX_BYTES", "1000000")):
        changed = load_settings(env={"DISTRIBUTED": "tensor", "DISTRIBUTED_LOCAL_RANKS": "3", name: value})
        assert {k for k, v in shared_settings(changed).items() if shared_settings(base)[k] != v} == {name}


_CONTROL_RANK = """
import json, os, socket, sys, time
import mlx.core as mx
from mlxstack.server.app import open_control
group = mx.distributed.init(strict=True, backend="ring")
if group.rank() == 0:
    # strangers at the port the group is about to learn: they must not hold the hellos up
    import mlxstack.system.control_channel as cc
    real = cc.listener
    def spied(host, port=0):
        sock = real(host, port)
        print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
        addr = ("127.0.0.1", sock.getsockname()[1])
        held = [socket.create_connection(addr) for _ in range(3)]
        held[0].sendall(os.urandom(40)); held[1].sendall(cc._MAGIC)     # garbage, half a hello, silence
        spied.held = held
        return sock
    cc.listener = spied
chan = open_control(group, ("127.0.0.1", 0), bytes.fromhex(os.environ["SECRET"]))
if group.rank() == 0:
    chan.send(b"turn 1")
    print(json.dumps({"sent": True}), flush=True)
else:
    print(json.dumps({"got": chan.recv().decode()}), flush=True)
chan.close()
"""


@pytest.mark.e2e
def test_ranks_on_hosts_learn_the_control_port_from_rank_0_after_it_listens(tmp_path):
    """DISTRIBUTED_HOSTS (mlx.launch starts rank 0 elsewhere): the launcher publishes port 0, rank 0
    binds a port when it runs and the group learns it over the ring (``from_rank0``): no port is
    picked free and bound later. 3 real ring ranks form the channel with strangers holding
    connections to it (garbage, half a hello, silence) and rank 0's record reaches both followers."""
    from mlxstack.launcher.ranks import control_for_hosts

    outs = run_ranks(_CONTROL_RANK, tmp_path, {"SECRET": os.urandom(32).hex()}, timeout=120)
    assert control_for_hosts(str(tmp_path / "hosts.json")) == "127.0.0.1:0"
    lines = [[json.loads(x) for x in out.strip().splitlines() if x.startswith("{")] for out in outs]
    assert lines[0][0]["port"] > 0 and lines[0][1] == {"sent": True}
    assert lines[1] == lines[2] == [{"got": "turn 1"}]
