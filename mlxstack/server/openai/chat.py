"""OpenAI chat completions (``POST /v1/chat/completions``): the front the other two translate into.

    body --chat_request--> ChatRequest (validation, model name, images, grammar)
         --JobRun--> the ChatJob on the inference worker
         --chat_reply.py--> chat.completion JSON, or chat.completion.chunk SSE frames and [DONE]
"""
from __future__ import annotations

import uuid
from typing import Any

from ..common.job_adapter import JobRun, chat_request, require_ready
from .chat_reply import ChatStream, completion_body
from ..common.validation import parse_json


def handle_chat_completions(h: Any) -> None:
    """POST /v1/chat/completions (the handler thread; generation runs on the inference worker)."""
    app = h.app
    body = parse_json(h.read_body())
    require_ready(app)
    # validation, model name, images (fetched here, never on the inference worker) and the
    # reply's grammar (400 for a schema that cannot be enforced) -- as every other front
    req = chat_request(app, body)
    completion_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    parse_tools = req.tool_choice != "none"
    run = JobRun.submit(h, req, completion_id[-12:], stream=req.stream)
    run.answer(h, lambda: ChatStream(completion_id, app.model_id, tools=req.tools, family=app.family,
                                     include_usage=req.include_usage, parse_tools=parse_tools),
               lambda outcome: completion_body(completion_id, app.model_id, outcome, tools=req.tools,
                                               family=app.family, enable_thinking=req.enable_thinking,
                                               parse_tools=parse_tools))


__all__ = ["handle_chat_completions"]
