"""LiteLLM's logging of the /v1/messages pass-through, through the real stack (launcher, MLX server on
the embedded model, LiteLLM on free ports): no ERROR or traceback in LiteLLM's output, and the usage
record every LiteLLM callback receives (its standard logging payload: what a spend log, Langfuse or
Prometheus would record) carries the reply's tokens and a cost, as a chat completion's does.

The observer is one more callback in the generated LiteLLM config, a recorder written next to it
(LiteLLM imports callbacks from the config's folder); the config is otherwise the launcher's own."""
from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from scripts.probelib.servers import launch_stack
from tests.conftest import http_json, unused_ports
from tests.test_e2e_stack import KEY, MODEL

pytestmark = pytest.mark.e2e  # the whole stack: MLX server and LiteLLM processes (docs/testing.md#tiers)

RECORDER = '''
import json
from litellm.integrations.custom_logger import CustomLogger

FIELDS = ("call_type", "model", "custom_llm_provider", "prompt_tokens", "completion_tokens", "total_tokens",
          "response_cost", "response_cost_failure_debug_info", "status", "api_base")


class Recorder(CustomLogger):
    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        payload = kwargs.get("standard_logging_object") or {{}}
        record = {{k: payload.get(k) for k in FIELDS}}
        record["stream"] = bool(kwargs.get("stream"))
        record["kwargs_response_cost"] = kwargs.get("response_cost")
        with open({path!r}, "a") as out:
            out.write(json.dumps(record, default=str) + "\\n")


recorder = Recorder()
'''

# In the launcher's process: the generated config names the recorder after the front door.
PRELUDE = '''
from mlxstack.launcher import litellm_config as _lc
_build = _lc.build_config
def _with_recorder(*args, **kwargs):
    config = _build(*args, **kwargs)
    config["litellm_settings"]["callbacks"].append("usage_recorder.recorder")
    return config
_lc.build_config = _with_recorder
'''


class RecordedStack:
    def __init__(self, tmp: Path, embedded_cache: str) -> None:
        self.mlx_port, self.proxy_port = unused_ports(2)
        logs = tmp / "logs"
        logs.mkdir(mode=0o700)
        self.records = tmp / "records.jsonl"
        (logs / "usage_recorder.py").write_text(RECORDER.format(path=str(self.records)))
        env = {"MLX_PORT": str(self.mlx_port), "PROXY_PORT": str(self.proxy_port), "LITELLM_MASTER_KEY": KEY,
               "LOG_ROOT": str(logs), "MODEL_CACHE_DIR": embedded_cache, "DEFAULT_TEMPERATURE": "0",
               "DEFAULT_MAX_TOKENS": "24", "PROXY_STARTUP_TIMEOUT_SECONDS": "180"}
        self.log_path = tmp / "stack.log"
        self.proc, self.log = launch_stack(env, self.log_path, prelude=PRELUDE)
        self.base = f"http://127.0.0.1:{self.proxy_port}"

    def litellm_lines(self) -> list[str]:
        return [line for line in self.log_path.read_text().splitlines() if line.startswith("[litellm]")]

    def recorded(self, count: int, timeout: float = 30.0) -> list[dict]:
        """The first ``count`` records (LiteLLM logs after the reply, on its logging worker)."""
        deadline = time.monotonic() + timeout
        while True:
            lines = self.records.read_text().splitlines() if self.records.exists() else []
            if len(lines) >= count or time.monotonic() > deadline:
                return [json.loads(line) for line in lines]
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=15)
        self.log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_path):
    s = RecordedStack(tmp_path_factory.mktemp("pass_through_logging"), str(embedded_model_path.parent))
    yield s
    s.stop()


ANTHROPIC = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
BODY = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]}


def stream_events(base: str, body: dict) -> list[dict]:
    req = urllib.request.Request(base + "/v1/messages", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", **ANTHROPIC})
    with urllib.request.urlopen(req, timeout=180) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    return [json.loads(line[len("data:"):]) for line in text.splitlines() if line.startswith("data:")]


def test_messages_are_logged_with_their_usage_and_no_error(stack):
    """Every non-streamed /v1/messages logged ``Error creating Anthropic response logging payload:
    LLM Provider NOT provided`` with a traceback, and its record reached the callbacks without a cost
    (``response_cost_failure_debug_info`` set, no ``response_cost`` in the callback's kwargs): the
    pass-through's logging priced the reply's model with no provider (routing/front_door.py)."""
    status, reply, _ = http_json(stack.base + "/v1/messages", BODY, headers=ANTHROPIC, timeout=180)
    assert status == 200, reply
    events = stream_events(stack.base, {**BODY, "messages": [{"role": "user", "content": "Say hello."}]})
    status, chat, _ = http_json(stack.base + "/v1/chat/completions",
                                {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
                                headers={"Authorization": f"Bearer {KEY}"}, timeout=180)
    assert status == 200, chat
    records = stack.recorded(3)
    assert len(records) == 3, records
    whole, streamed, completion = sorted(records, key=lambda r: (r["call_type"] != "pass_through_endpoint", r["stream"]))

    usage = reply["usage"]
    assert usage["output_tokens"] > 0
    assert whole == {
        "call_type": "pass_through_endpoint", "model": MODEL, "custom_llm_provider": "hosted_vllm",
        "prompt_tokens": usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"],
        "completion_tokens": usage["output_tokens"],
        "total_tokens": usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]
        + usage["output_tokens"],
        "response_cost": 0.0, "response_cost_failure_debug_info": None, "status": "success",
        "api_base": whole["api_base"], "stream": False, "kwargs_response_cost": 0.0}
    assert whole["api_base"].endswith("/v1/messages")
    # A stream's usage is in its own events; LiteLLM 1.106.2 reads a pass-through stream's usage only
    # from api.anthropic.com's, so its record of this one carries no token counts -- and no error
    delta = [e for e in events if e["type"] == "message_delta"]
    assert len(delta) == 1 and delta[0]["usage"]["output_tokens"] > 0 and events[-1] == {"type": "message_stop"}
    assert (streamed["call_type"], streamed["status"], streamed["response_cost_failure_debug_info"]) == (
        "pass_through_endpoint", "success", None)
    assert (completion["call_type"], completion["custom_llm_provider"], completion["completion_tokens"],
            completion["response_cost"], completion["kwargs_response_cost"]) == (
        "acompletion", "hosted_vllm", chat["usage"]["completion_tokens"], 0.0, 0.0)

    lines = stack.litellm_lines()
    assert any("front door: checking keys" in line for line in lines)
    assert [line for line in lines if "ERROR" in line or "Traceback" in line] == []
