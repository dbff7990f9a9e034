"""The embedded SmolLM2 over 3 ranks, tensor parallel (9 heads / 3 KV heads per rank: 3 / 1),
through the whole stack: start_llm's run_stack with DISTRIBUTED=tensor DISTRIBUTED_LOCAL_RANKS=3,
the real LiteLLM proxy on its port, driven like a client and compared with one process serving
the same model (the session's embedded server).

Checks: greedy replies identical to the single-process server's; a session's warm turn reuses the
same tokens; 4 concurrent sessions answer what they answer alone; kill -9 of a rank ends the
group, the launcher restarts every rank (its banner says so) and the next request answers the
same; a stop leaves no rank running."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time
from pathlib import Path

import pytest

from scripts.probelib.servers import launch_stack
from tests.conftest import http_json, unused_ports
from tests.test_distributed import _alive, _children, _gone

pytestmark = pytest.mark.e2e  # the embedded model over 3 rank processes behind LiteLLM (docs/testing.md#tiers)

KEY = "sk-e2e-distributed"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"


class RankStack:
    def __init__(self, tmp: Path, embedded_cache: str) -> None:
        self.mlx_port, self.proxy_port = unused_ports(2)
        self.logs = tmp / "logs"
        env = {"MLX_PORT": str(self.mlx_port), "PROXY_PORT": str(self.proxy_port), "LITELLM_MASTER_KEY": KEY,
               "MLX_API_KEY": "", "LOG_ROOT": str(self.logs), "MODEL_CACHE_DIR": embedded_cache,
               "DEFAULT_TEMPERATURE": "0", "DEFAULT_REPETITION_PENALTY": "1.0", "DEFAULT_THINKING": "false",
               "DISK_CACHE_DIR": "off", "PROXY_STARTUP_TIMEOUT_SECONDS": "180",
               "DISTRIBUTED": "tensor", "DISTRIBUTED_LOCAL_RANKS": "3", "MLX_UNHEALTHY_RESTART_SECONDS": "0"}
        self.log_path = tmp / "stack.log"
        self.proc, self.log = launch_stack(env, self.log_path)
        self.base = f"http://127.0.0.1:{self.proxy_port}"

    def rank0(self) -> int:
        return int((self.logs / ".mlx.pid").read_text().strip())

    def ranks(self) -> list[int]:
        pid = self.rank0()
        return [pid] + _children(pid)

    def chat(self, messages, max_tokens=8):
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
        try:
            status, reply, _ = http_json(self.base + "/v1/chat/completions", body, headers=AUTH, timeout=600)
        except OSError as exc:     # a hung group: say where the ranks were, not only "timed out"
            pytest.fail(f"{type(exc).__name__}: {exc}; stack log:\n{self.log_path.read_text()[-6000:]}")
        assert status == 200, (reply, self.log_path.read_text()[-3000:])
        return reply["choices"][0]["message"]["content"], reply["usage"]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    s = RankStack(tmp_path_factory.mktemp("ranks"), str(embedded_model_path.parent))
    yield s
    if s.proc.poll() is None:
        s.stop()


def _alone(server, messages, max_tokens=8):
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    status, reply, _ = http_json(server.base + "/v1/chat/completions", body, timeout=600)
    assert status == 200, reply
    return reply["choices"][0]["message"]["content"], reply["usage"]


SYSTEM = "You are a terse coding agent working in a Python repository. Answer in one short sentence. "


def test_ready_line_names_the_ranks(stack):
    text = stack.log_path.read_text()
    assert f"one model over 3 local ranks (tensor parallel): rank 0 answers on http://127.0.0.1:{stack.mlx_port}" in text
    assert len(stack.ranks()) == 3


def test_replies_and_warm_turn_match_one_process(stack, embedded_server):
    turn1 = [{"role": "system", "content": SYSTEM + "(ranks e2e)"},
             {"role": "user", "content": "What does a unit test check?"}]
    ranks, alone = stack.chat(turn1), _alone(embedded_server, turn1)
    assert ranks[0] == alone[0] and ranks[0].strip()
    turn2 = turn1 + [{"role": "assistant", "content": ranks[0]}, {"role": "user", "content": "And an integration test?"}]
    ranks2, alone2 = stack.chat(turn2), _alone(embedded_server, turn2)
    assert ranks2[0] == alone2[0]
    cached = ranks2[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached == alone2[1]["prompt_tokens_details"]["cached_tokens"] and cached > ranks[1]["prompt_tokens"] - 8


def test_four_concurrent_sessions(stack, embedded_server):
    sessions = [[{"role": "system", "content": SYSTEM + "(concurrent)"},
                 {"role": "user", "content": f"Name risk number {i} of editing code without tests."}] for i in range(4)]
    with cf.ThreadPoolExecutor(4) as pool:
        ranks = list(pool.map(lambda m: stack.chat(m, max_tokens=6)[0], sessions))
    assert ranks == [_alone(embedded_server, m, max_tokens=6)[0] for m in sessions]


def test_killed_rank_restarts_the_group_then_a_clean_stop(stack, embedded_server):
    before = stack.ranks()
    os.kill(before[2], signal.SIGKILL)
    deadline = time.monotonic() + 300
    while "restarted (pid" not in stack.log_path.read_text():
        assert time.monotonic() < deadline, stack.log_path.read_text()[-3000:]
        time.sleep(1)
    text = stack.log_path.read_text()
    assert "rank 2 exited with status -9; this rank exits so the launcher restarts every rank" in text
    assert "It serves over 3 local ranks (tensor parallel): every rank restarts with it." in text
    assert _gone(before, 30)
    after = stack.ranks()
    assert len(after) == 3 and not set(after) & set(before)
    msgs = [{"role": "user", "content": "After the restart: what is a regression?"}]
    assert stack.chat(msgs)[0] == _alone(embedded_server, msgs)[0]
    assert stack.stop() == 0
    assert _gone(after, 30) and not any(_alive(p) for p in after)
