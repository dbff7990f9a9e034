"""DISTRIBUTED_HOSTS across a real network boundary: two "hosts" made here of Linux network
namespaces (10.77.0.1 and 10.77.0.2 on a veth pair), started the way DISTRIBUTED_HOSTS starts
them: ``mlxstack.serve`` becomes the real ``mlx.launch`` over a hostfile naming both, and
mlx.launch reaches each host with ``ssh HOST COMMAND``. There is no sshd here, so the ``ssh``
mlx.launch finds first on its PATH is a stand-in that does what sshd would do with the command:
run it on that host -- in its network namespace, in a fresh environment holding only that host's
own settings (nothing inherited from the launch), and on host B with its own MODEL_CACHE_DIR (a
mount namespace binds B's own folder over the path, so a file rank 0 writes is not on B).

What it proves: the control channel's secret file is made once on rank 0's host and is the one
every later launch uses, so the operator copies it to the other host once (the way
docs/distributed.md says: through ssh's stdin, never a command line); a host without its copy is
refused in one line before it loads; with the copy, rank 1 reads the path the launch forwarded on
its own disk, the control channel connects from 10.77.0.2 to 10.77.0.1 and the group serves; the
secret is on no command line, in no log, in no rank's environment; several launches leave one file.

Skips where network namespaces cannot be made (not root, no ``ip`` from Debian's iproute2, no
``unshare``, ``ip netns add`` refused)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mlxstack.config.settings import REPO_ROOT
from tests.test_distributed import tiny_qwen2_path  # noqa: F401  (the fixture: a 4-layer qwen2 both splits fit)

pytestmark = pytest.mark.e2e     # 2 launches of 2 rank processes each (docs/testing.md#tiers)

IP_A, IP_B = "10.77.0.1", "10.77.0.2"
PORT = 8080                      # rank 0's HTTP port inside host A's own namespace: nothing else there
RING_PORT = 32323                # mlx.launch's first ring port (one per rank from here)


def _cannot_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "ss", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` here (ip, ss: Debian's iproute2; unshare, mount: util-linux)"
    return None


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


@pytest.fixture
def two_hosts():
    """(namespace of host A, of host B), joined by a veth pair; removed with whatever runs there."""
    why = _cannot_make_namespaces()
    if why:
        pytest.skip(why)
    a, b = f"mlxh{os.getpid()}a", f"mlxh{os.getpid()}b"
    try:
        _ip("netns", "add", a)
    except RuntimeError as exc:
        pytest.skip(f"network namespaces cannot be made here: {exc}")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", "veth-a", "netns", a, "type", "veth", "peer", "name", "veth-b", "netns", b)
        for ns, dev, ip in ((a, "veth-a", IP_A), (b, "veth-b", IP_B)):
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            for pid in _pids_in(ns):             # what this test started there (the namespaces are its own)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _pids_in(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _host_env(settings: dict[str, str]) -> dict[str, str]:
    """What a command gets from sshd: a login's basics and the host's own settings."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8", **settings}


def _fake_ssh(folder: Path, hosts: dict[str, dict]) -> Path:
    """``ssh [-tt] [-o OPT] HOST COMMAND`` that runs COMMAND on HOST: in its network namespace, in
    the host's environment only, and (``own``) with the host's own folder bound over ``at``."""
    script = folder / "ssh"
    script.write_text(f"""#!{sys.executable}
import json, os, sys
HOSTS = json.loads({json.dumps(hosts)!r})
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] == "-o" else args[1:]
if not args or args[0] not in HOSTS:
    sys.exit("ssh: Could not resolve hostname " + (args[0] if args else "(none)"))
host, command = HOSTS[args[0]], " ".join(args[1:])
run = ["/bin/bash", "-c", command]
if host.get("own"):
    run = ["unshare", "--mount", "/bin/bash", "-c", 'mount --bind "$0" "$1" && exec /bin/bash -c "$2"',
           host["own"], host["at"], command]
os.execvpe("ip", ["ip", "netns", "exec", host["ns"], *run], host["env"])
""")
    script.chmod(0o755)
    return script


class InNamespace:
    """HTTP from a thread that entered ``ns``'s network (the test's own threads stay where they are)."""

    def __init__(self, ns: str) -> None:
        self.pool = cf.ThreadPoolExecutor(1, initializer=self._enter, initargs=(ns,))

    @staticmethod
    def _enter(ns: str) -> None:
        with open(f"/run/netns/{ns}") as f:
            os.setns(f.fileno(), os.CLONE_NEWNET)

    def get(self, path: str, timeout: float = 5.0) -> dict:
        return self.pool.submit(self._call, path, None, timeout).result()

    def post(self, path: str, body: dict, timeout: float = 300.0) -> dict:
        return self.pool.submit(self._call, path, body, timeout).result()

    @staticmethod
    def _call(path: str, body: dict | None, timeout: float) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp)

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def _stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)     # its own session: mlx.launch and the ranks it started
        except OSError:
            pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_two_hosts_form_one_group_with_the_secret_file_copied_once(two_hosts, tiny_qwen2_path, tmp_path):  # noqa: F811
    ns_a, ns_b = two_hosts
    cache_a, cache_b = tmp_path / "a" / "cache", tmp_path / "b" / "cache"
    cache_a.mkdir(parents=True)
    cache_b.mkdir(parents=True)
    key = cache_a / "control" / "control.key"          # the path docs/distributed.md names
    settings = {"MODEL_PATH": str(tiny_qwen2_path), "MODEL_CACHE_DIR": str(cache_a), "MLX_HOST": "127.0.0.1",
                "MLX_PORT": str(PORT), "MLX_API_KEY": "", "DISK_CACHE_DIR": "off", "DEFAULT_TEMPERATURE": "0",
                "DEFAULT_THINKING": "false", "ENABLE_REQUEST_LOGGING": "false", "MLX_UNHEALTHY_RESTART_SECONDS": "0",
                "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    hosts = {"host-a": {"ns": ns_a, "env": _host_env({**settings, "LOG_ROOT": str(tmp_path / "a" / "logs")})},
             "host-b": {"ns": ns_b, "own": str(cache_b), "at": str(cache_a),
                        "env": _host_env({**settings, "LOG_ROOT": str(tmp_path / "b" / "logs")})}}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = _fake_ssh(bin_dir, hosts)
    hostfile = tmp_path / "ranks.json"
    hostfile.write_text(json.dumps([{"ssh": "host-a", "ips": [IP_A]}, {"ssh": "host-b", "ips": [IP_B]}]))
    launch_env = {**hosts["host-a"]["env"], "PATH": f"{bin_dir}:{hosts['host-a']['env']['PATH']}",
                  "DISTRIBUTED": "pipeline", "DISTRIBUTED_HOSTS": str(hostfile), "DISTRIBUTED_BACKEND": "ring"}

    def launch(name: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:       # stdin a pipe nobody writes: mlx.launch forwards its stdin to the ranks
            proc = subprocess.Popen(["ip", "netns", "exec", ns_a, sys.executable, "-m", "mlxstack.serve"],
                                    cwd=str(REPO_ROOT), env=launch_env, stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return proc, log

    # 1. A fresh pair: the launch makes the secret file on host A; host B has no copy, so rank 1
    #    is refused in one line before it loads, and the group ends.
    first, first_log = launch("first")
    try:
        first.wait(240)
    except subprocess.TimeoutExpired:
        pytest.fail("the first launch did not end without host B's copy of the secret:\n"
                    + first_log.read_text()[-4000:])
    finally:
        _stop(first)
    text = first_log.read_text()
    assert f"configuration error: DISTRIBUTED: rank 1: the control channel's secret file {key} is not on this " \
           "host" in text, text[-4000:]
    assert sorted(os.listdir(key.parent)) == ["control.key"] and not (cache_b / "control").exists()
    secret = key.read_text().strip()

    # 2. The operator copies it once, as docs/distributed.md says: over ssh's stdin, into a 0700
    #    folder under umask 077 -- onto host B's own disk.
    folder = shlex.quote(str(key.parent))
    subprocess.run([str(ssh), "host-b", f"umask 077 && mkdir -p {folder} && cat > {shlex.quote(str(key))}"],
                   stdin=open(key, "rb"), check=True, timeout=30)
    assert (cache_b / "control" / "control.key").read_text().strip() == secret
    assert (cache_b / "control" / "control.key").stat().st_mode & 0o077 == 0

    # 3. The next launch reuses the same file: rank 1 reads its copy, the control channel connects
    #    across the namespaces, the group serves.
    second, second_log = launch("second")
    client = InNamespace(ns_a)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert second.poll() is None, "the group ended:\n" + second_log.read_text()[-6000:]
            assert time.monotonic() < deadline, "not ready in 300 s:\n" + second_log.read_text()[-6000:]
            try:
                if client.get("/health").get("ready"):
                    break
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(1.0)
        reply = client.post("/v1/chat/completions", {"model": tiny_qwen2_path.name, "max_tokens": 6,
                                                     "messages": [{"role": "user", "content": "Hello there"}]})
        assert reply["usage"]["completion_tokens"] > 0
        stats = client.get("/v1/cache/stats")["distributed"]
        assert stats["ranks"] == 2 and stats["mode"] == "pipeline" and stats["turns"] > 0
        links = subprocess.run(["ip", "netns", "exec", ns_b, "ss", "-Htn", "state", "established"],
                               capture_output=True, text=True, check=True).stdout.split("\n")
        peers = {line.split()[-1] for line in links if line.split() and line.split()[-2].startswith(f"{IP_B}:")}
        control = {p for p in peers if p.startswith(f"{IP_A}:") and int(p.rsplit(":", 1)[1]) not in
                   (RING_PORT, RING_PORT + 1)}
        assert control, f"no control connection from host B to {IP_A} besides the ring's: {sorted(peers)}"
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert secret not in ps
        for pid in _pids_in(ns_b):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            assert secret.encode() not in environ
    finally:
        client.close()
        _stop(second)
    assert secret not in first_log.read_text() + second_log.read_text()
    assert "made the control channel's secret file" not in second_log.read_text()
    assert sorted(os.listdir(key.parent)) == ["control.key"] and key.read_text().strip() == secret
