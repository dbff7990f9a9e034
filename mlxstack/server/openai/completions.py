"""OpenAI legacy text completions (``POST /v1/completions``), as mlx_lm.server and vLLM serve them.

    body --completion_request--> (ChatRequest of the same sampling fields, CompletionPrompt)
         --JobRun (raw_prompt)--> the same engine path as chat: KV reuse, continuous batching
         --completion_body / CompletionStream--> text_completion JSON, or SSE chunks and [DONE]

No chat template: the prompt is tokenised as it stands (a text prompt gets the tokenizer's own
leading tokens, e.g. a BOS; a list of token ids is fed as given) and the reply continues it. The
sampling fields are validated by the chat parser, so every range and error is the chat front's.

- ``prompt``: a string, a list of token ids, or a list holding one of those; several prompts are a
  400 (send one request each: their shared prefix is reused from the cache).
- ``max_tokens`` defaults to 16 (OpenAI's default for this API); ``stop``, ``seed``,
  ``temperature`` / ``top_p`` and the chat front's other sampling fields as there.
- ``logprobs`` N (0-20): the legacy shape ``{tokens, token_logprobs, top_logprobs, text_offset}``
  (``top_logprobs``: the N likeliest tokens at each position, by their text).
- ``echo``: the prompt's text before the reply (``text_offset`` counts from the start of it);
  with ``logprobs`` a 400, since the prompt's own logprobs are not computed here.
- ``suffix``: fill-in-the-middle, where the tokenizer has FIM tokens (prefix / suffix / middle,
  in the prefix-suffix-middle order); else a 400 naming ``suffix``.
- ``n`` / ``best_of`` above 1: 400.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..common.finish import chat_finish_reason
from ..common.job_adapter import JobRun, chat_request, require_ready
from ..common.usage import chat_usage, outcome_usage
from ..common.validation import MAX_TOP_LOGPROBS, parse_json
from ..http.errors import APIError, bad_request
from ..http.sse import DONE, encode_frame

DEFAULT_MAX_TOKENS = 16        # OpenAI's default for text completions
# the chat fields a completion shares (validated by the chat parser, errors naming the same param)
SHARED_FIELDS = ("model", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "repetition_context_size", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "n",
                 "cache_salt", "extra_body")
# fill-in-the-middle tokens (prefix, suffix, middle) by tokenizer family
FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),            # StarCoder, SantaCoder
              ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),      # Qwen2.5-Coder, DeepSeek-style
              ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),           # DeepSeek-Coder
              ("<PRE>", "<SUF>", "<MID>"))                                  # Code Llama
PLACEHOLDER = [{"role": "user", "content": "."}]    # the chat parser wants messages; the engine never sees them


@dataclass(frozen=True)
class CompletionPrompt:
    """What the completion front keeps beside the chat request: the prompt as the engine's parts
    (engine/request.py ``ChatJob.raw_prompt``), the text ``echo`` prepends, and ``logprobs`` N
    (None: not asked)."""
    parts: list
    echo_text: str
    echo: bool
    logprobs: int | None


def _prompt_parts(body: dict, vocab_size: int | None) -> tuple[list, bool]:
    """(the prompt as parts -- one text, or token ids --, whether it is text)."""
    prompt = body.get("prompt")
    carried = body.get("mlxstack_prompt")     # token ids the front door carried past LiteLLM (routing/front_door.py)
    if carried is not None:
        if not (isinstance(carried, list) and carried):
            raise bad_request("'mlxstack_prompt' must be a non-empty list of token ids", param="prompt")
        prompt = carried
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or isinstance(prompt[0], list)):
        prompt = prompt[0]         # a list holding one prompt is that prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
        return [prompt], True
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if t < 0 or vocab_size is not None and t >= vocab_size]
        if bad:
            top = f"0..{vocab_size - 1}" if vocab_size is not None else "0 or more"
            raise bad_request(f"'prompt' token id {bad[0]} is outside the model's vocabulary ({top})", param="prompt")
        return list(prompt), False
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"'prompt' holds {len(prompt)} prompts: this server completes one prompt per request. Send "
                          "one request each (their shared prefix is reused from the cache).", param="prompt",
                          code="unsupported_parameter")
    raise bad_request("'prompt' must be a non-empty string, a non-empty list of token ids, or a list holding one "
                      "of those", param="prompt")


def fim_ids(vocab: dict) -> tuple[int, int, int] | None:
    """The tokenizer's fill-in-the-middle ids (prefix, suffix, middle), or None when it has none."""
    for names in FIM_TOKENS:
        ids = [vocab.get(name) for name in names]
        if all(isinstance(i, int) for i in ids):
            return ids[0], ids[1], ids[2]
    return None


def fim_parts(parts: list, suffix: str, fim: tuple[int, int, int]) -> list:
    """The prompt in the prefix-suffix-middle order: <prefix> prompt <suffix> suffix <middle>."""
    pre, suf, mid = fim
    return [pre, *parts, suf, suffix, mid]


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", param=name)
    return value


def completion_request(app: Any, body: dict) -> tuple[Any, CompletionPrompt]:
    """Validate a text-completion body: (the chat request of its sampling fields, its prompt);
    APIError(400) naming the field to fix."""
    parts, is_text = _prompt_parts(body, getattr(app, "vocab_size", None))
    echo = _bool(body, "echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise bad_request(f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS} (the likeliest tokens "
                          "reported at each position)", param="logprobs")
    if echo and logprobs is not None:
        raise bad_request("'echo' with 'logprobs' is not supported: the prompt's own logprobs are not computed "
                          "here. Send 'logprobs' without 'echo' (the reply's tokens get theirs).", param="echo",
                          code="unsupported_parameter")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request("'best_of' other than 1 is not supported: this server returns one choice per request",
                          param="best_of", code="unsupported_parameter")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad_request("'suffix' must be a string", param="suffix")
    echo_text = parts[0] if is_text else (app.loaded.tokenizer.decode(parts) if echo else "")
    if suffix:
        tok = app.loaded.tokenizer
        fim = fim_ids(tok.get_vocab() if hasattr(tok, "get_vocab") else {})
        if fim is None:
            raise bad_request(f"'suffix' is not supported for model {app.model_id}: its tokenizer has no "
                              "fill-in-the-middle tokens", param="suffix", code="unsupported_parameter")
        parts = fim_parts(parts, suffix, fim)
    chat_body = {k: body[k] for k in SHARED_FIELDS if k in body}
    chat_body["messages"] = PLACEHOLDER
    chat_body["max_tokens"] = body.get("max_tokens") if body.get("max_tokens") is not None else DEFAULT_MAX_TOKENS
    if logprobs is not None:
        chat_body["logprobs"], chat_body["top_logprobs"] = True, logprobs
    req = chat_request(app, chat_body, fields=None)
    req.messages, req.body, req.tools = [], body, None
    return req, CompletionPrompt(parts, echo_text, echo, logprobs)


def legacy_logprobs(outcome: Any, text: str, offset: int) -> dict | None:
    """The legacy ``logprobs`` object from the engine's per-token entries: the tokens the reply's
    text shows (one a stop string cut into is kept, those after it are not), their logprobs, the
    likeliest tokens at each position by text, and each token's offset in the answered text
    (``offset``: where the reply starts in it, after an echoed prompt)."""
    entries = getattr(outcome, "logprobs", None)
    if entries is None:
        return None
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict] = []
    offsets: list[int] = []
    at = 0
    for entry in entries:
        if at >= len(text) and tokens or not text:
            break
        tokens.append(entry["token"])
        values.append(entry["logprob"])
        tops.append({t["token"]: t["logprob"] for t in entry["top_logprobs"]})
        offsets.append(offset + at)
        at += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def completion_body(completion_id: str, model: str, outcome: Any, prompt: CompletionPrompt) -> dict:
    echo = prompt.echo_text if prompt.echo else ""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": echo + outcome.text,
                     "logprobs": legacy_logprobs(outcome, outcome.text, len(echo)),
                     "finish_reason": chat_finish_reason(outcome, False)}],
        "usage": chat_usage(outcome_usage(outcome)),
    }


class CompletionStream:
    """FrameEncoder (job_adapter) for one streamed completion: ``text_completion`` chunks with
    ``choices[0].text`` (the echoed prompt first), the logprobs in one chunk before the finish
    chunk, usage as the chat stream sends it (``stream_options.include_usage``: a last chunk with
    ``choices: []``), then ``data: [DONE]``; an error after the 200 is one ``data: {"error": ...}``."""

    def __init__(self, completion_id: str, model: str, prompt: CompletionPrompt, include_usage: bool) -> None:
        self.id, self.model, self.prompt, self.include_usage = completion_id, model, prompt, include_usage
        self.created = int(time.time())

    def _chunk(self, text: str, logprobs: dict | None = None, finish: str | None = None, usage: dict | None = None,
               choices: bool = True) -> bytes:
        chunk: dict = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                       "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]
                       if choices else []}
        if usage is not None:
            chunk["usage"] = usage
        return encode_frame(chunk)

    def start(self, ready: Any) -> list[bytes]:
        return [self._chunk(self.prompt.echo_text)] if self.prompt.echo and self.prompt.echo_text else []

    def feed(self, text: str) -> list[bytes]:
        return [self._chunk(text)] if text else []

    def finish(self, outcome: Any) -> list[bytes]:
        frames = []
        usage = chat_usage(outcome_usage(outcome))
        offset = len(self.prompt.echo_text) if self.prompt.echo else 0
        lp = legacy_logprobs(outcome, outcome.text, offset)
        if lp is not None:
            frames.append(self._chunk("", lp))
        frames.append(self._chunk("", None, chat_finish_reason(outcome, False), None if self.include_usage else usage))
        if self.include_usage:
            frames.append(self._chunk("", usage=usage, choices=False))
        return [*frames, DONE]

    def error(self, err: APIError) -> list[bytes]:
        return [err.sse_frame() + DONE]


def _prompt_errors(err: APIError) -> APIError:
    """An error the engine words for messages, reworded for a prompt (the window, its param)."""
    if err.code == "context_length_exceeded":
        err.message = err.message.replace("your messages", "your prompt").replace("of the messages", "of the prompt")
        err.param = "prompt"
    return err


def handle_completions(h: Any) -> None:
    """POST /v1/completions (the handler thread; generation runs on the inference worker)."""
    app = h.app
    body = parse_json(h.read_body())
    require_ready(app)
    req, prompt = completion_request(app, body)
    completion_id = "cmpl-" + uuid.uuid4().hex[:24]
    try:
        run = JobRun.submit(h, req, completion_id[-12:], stream=req.stream, raw_prompt=prompt.parts)
        run.answer(h, lambda: CompletionStream(completion_id, app.model_id, prompt, req.include_usage),
                   lambda outcome: completion_body(completion_id, app.model_id, outcome, prompt))
    except APIError as err:
        raise _prompt_errors(err) from None


__all__ = ["CompletionPrompt", "completion_body", "completion_request", "fim_ids", "fim_parts", "handle_completions",
           "legacy_logprobs"]
