"""Shared code for the probes in ``scripts/`` and the benchmarks in ``benchmarks/`` (stdlib only; no MLX
import needed).

    from _probe_common import Client, add_client_args, client_from_args, print_table
    client = client_from_args(args)                # --base-url / --api-key / --model / --stats-url
    r = client.chat(messages, tools=PI_TOOLS, max_tokens=16, session_id="s1")
    r.prompt_tokens, r.cached_tokens, r.ttft_s, r.text, client.stats_row(r)

What lives here:
- ``Client``: OpenAI chat completions over urllib, streaming by default (client-side TTFT = time
  to the first content / reasoning / tool-call delta), usage incl. ``prompt_tokens_details.cached_tokens``;
  ``cache_stats()`` reads the MLX server's ``GET /v1/cache/stats`` and ``stats_row()`` finds the
  request's row (by request id = tail of the response id, else by order).
- Request builders shaped like PI (developer prompt + read_file/bash/edit tools + tool loop),
  OpenClaw (cache boundary, inbound context, untrusted-metadata prefixes, sub-agent stats) and
  Claude Code (billing header, system reminders).
- ``ServerProcess``: start ``python -m mlxstack.serve`` or ``python -m mlx_lm.server`` on a free
  port (with the OpenBLAS preload the launcher would use), wait until ready, stop by pid.
- ``print_table`` (plain or markdown).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probelib.client import (  # noqa: E402,F401
    REPO_ROOT,
    DEFAULT_PROXY_URL,
    DEFAULT_MLX_URL,
    EMBEDDED_MODEL_DIR,
    read_dotenv,
    setting,
    default_api_key,
    default_mlx_url,
    add_client_args,
    client_from_args,
    free_port,
    nonce,
    ProbeError,
    ChatResult,
    Client,
)
from probelib.shapes import (  # noqa: E402,F401
    THINK_BLOCK,
    strip_reasoning,
    assistant_echo,
    tool_call,
    tool_result,
    _fn,
    PI_TOOLS,
    _GUIDELINES,
    filler_paragraphs,
    pi_system_prompt,
    fake_file,
    fake_test_output,
    OPENCLAW_BOUNDARY,
    openclaw_inbound_context,
    openclaw_system_prompt,
    openclaw_user,
    openclaw_subagent_report,
    claude_code_system,
    claude_code_user,
)
from probelib.report import (  # noqa: E402,F401
    fmt,
    print_table,
)
from probelib.servers import (  # noqa: E402,F401
    blas_env,
    embedded_model_path,
    ServerProcess,
)
from probelib.replays import (  # noqa: E402,F401
    Turn,
    Recorder,
    replay_pi,
    replay_openclaw,
    replay_many_sessions,
    simulate_stripped,
    replay_stripped_reasoning,
    TURN_HEADERS,
    turn_rows,
)
