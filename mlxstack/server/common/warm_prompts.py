"""WARM_PROMPTS: requests prefilled once the model is loaded, so the first request of the day
is warm (the disk tier keeps them warm across restarts too).

    jobs = load_warm_jobs(Path("warm.jsonl"), settings, vocab_size)     # validated ChatJobs

The file is JSON (a list of requests) or JSON lines (one request per line); a request is a
chat-completions body (``messages``, optional ``tools``, thinking fields...) or a bare list of
messages. Each one is validated exactly like /v1/chat/completions; a bad one is skipped with a
log line naming it, never a start-up failure.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ...config.settings import REPO_ROOT
from ...engine.chat import ChatJob
from ..http.errors import APIError
from .job_adapter import chat_job
from .validation import parse_chat_request

log = logging.getLogger("mlxstack.warm")


def parse_warm_file(text: str) -> list[Any]:
    """The requests in a WARM_PROMPTS file (JSON list, one JSON object, or JSON lines)."""
    text = text.strip()
    if not text:
        return []
    try:
        data = json.loads(text)
        return data if isinstance(data, list) and (not data or not isinstance(data[0], dict)
                                                   or "role" not in data[0]) else [data]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_warm_jobs(path_value: str, settings: Any, vocab_size: int | None = None) -> list[ChatJob]:
    path = Path(path_value).expanduser()
    path = path if path.is_absolute() else REPO_ROOT / path
    try:
        requests = parse_warm_file(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("WARM_PROMPTS=%s could not be read (%s); no warm-up", path_value, exc)
        return []
    jobs = []
    for i, req in enumerate(requests):
        body = {"messages": req} if isinstance(req, list) else dict(req) if isinstance(req, dict) else None
        try:
            if body is None:
                raise APIError(400, "a request must be an object with 'messages' or a list of messages")
            body["max_tokens"] = 1
            parsed = parse_chat_request(body, settings, vocab_size=vocab_size)
        except APIError as exc:
            log.warning("WARM_PROMPTS entry %d skipped: %s", i, exc.message)
            continue
        job = chat_job(parsed, f"warm-{i}", {}, emit=lambda _t: None, on_prompt=lambda _p: None,
                       is_cancelled=lambda: False)
        job.prefill_only = True
        jobs.append(job)
    return jobs
