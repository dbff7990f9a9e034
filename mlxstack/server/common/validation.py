"""Request validation: JSON body -> ChatRequest, or an APIError(400) that says what to fix.

Every field is checked against its real domain before anything reaches the inference worker:
numbers finite and in range (``top_k`` within the model's vocabulary, seeds in [0, 2**64)),
JSON nesting bounded, no NaN / Infinity, no lone surrogates, content parts of known types.
Fields this server cannot honour are refused (``n > 1``), never silently dropped.

    body = parse_json(raw_bytes)                                  # 400 on anything but a sane object
    req = parse_chat_request(body, settings, vocab_size=49152)    # 400 naming the field
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ...config.settings import Settings
from ...prompt.images import image_parts, is_image_part
from ...prompt.content_parts import TEXT_PART_TYPES, unsupported_part
from ...prompt.thinking import resolve_enable_thinking
from ...prompt.tool_results import orphan_tool_result
from ...runner.sampling_defaults import SamplingDefaults
from ..http.errors import APIError, bad_request

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
MAX_JSON_DEPTH = 64
MAX_INT = 2**31 - 1            # token counts and window sizes: anything larger is a typo
SEED_LIMIT = 2**64             # mx.random.seed takes an unsigned 64-bit integer
MAX_TOP_LOGPROBS = 20
TOOL_CHOICES = ("none", "auto", "required")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_SURROGATE = re.compile("[\ud800-\udfff]")
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    repetition_context_size: int
    max_tokens: int
    stop: list[str]
    seed: int | None
    tools: list | None
    enable_thinking: bool
    body: dict
    # Validated here, carried for the engine (refused or honoured, never silently dropped).
    n: int = 1
    logprobs: bool = False
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None
    parallel_tool_calls: bool = True
    grammar: Any = None        # constraints.CompiledGrammar (server/common/structured.py), set on the handler thread
    # where each sampling value came from (runner/sampling_defaults.py): request log, stats
    sampling_origin: dict[str, str] = field(default_factory=dict)
    repetition_scope: str = "reply"
    cache_salt: str = ""       # vLLM's field: requests reuse each other's cache only with the same salt


# ---------------------------------------------------------------------------- JSON
class _BadJSONNumber(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _BadJSONNumber(f"{name} is not a JSON number; send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to inf
        raise _BadJSONNumber(f"number {text[:40]} is out of range for a 64-bit float")
    return value


def json_depth_exceeds(obj: Any, limit: int) -> bool:
    """True when ``obj`` nests lists/objects deeper than ``limit`` (iterative: no recursion)."""
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth + 1 > limit:
                return True
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def find_lone_surrogate(obj: Any) -> str | None:
    """A JSON path to the first string (or key) holding an unpaired UTF-16 surrogate, else None.

    ``json.loads`` accepts ``"\\ud800"``; such a string cannot be encoded as UTF-8, so the
    tokenizer (or a log line) would fail later with a 500.
    """
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return path or "(body)"
        elif isinstance(node, dict):
            for k, v in node.items():
                if _SURROGATE.search(k):
                    return f"{path}.{k!a}" if path else f"{k!a}"
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """Decode a request body: a JSON object with finite numbers, bounded nesting, valid text."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float)
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except _BadJSONNumber as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request(f"request body nests JSON deeper than {max_depth} levels") from None
    except ValueError as exc:  # int() refuses integers over sys.get_int_max_str_digits() digits
        raise bad_request(f"request body holds a number that cannot be parsed ({str(exc)[:80]}); "
                          "send numbers of normal size") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if json_depth_exceeds(body, max_depth):
        raise bad_request(f"request body nests JSON deeper than {max_depth} levels")
    where = find_lone_surrogate(body)
    if where is not None:
        raise bad_request(f"{where} holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff); "
                          "send valid Unicode text", param=where)
    return body


# ---------------------------------------------------------------------------- fields
def _show(value: Any) -> str:
    try:
        return json.dumps(value)[:40]
    except (TypeError, ValueError):
        return repr(value)[:40]


def _number(body: dict, name: str, default: Any, *, lo: float | None = None, hi: float | None = None,
            integer: bool = False, positive: bool = False) -> Any:
    """``body[name]`` as a finite number in [lo, hi] (default when absent or null)."""
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be {kind}, got {_show(value)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number, got {value}", param=name)
    if integer and isinstance(value, float):
        if not value.is_integer():
            raise bad_request(f"'{name}' must be {kind}, got {_show(value)}", param=name)
        value = int(value)
    if positive and value <= 0:
        raise bad_request(f"'{name}' must be a positive integer, got {_show(value)}", param=name)
    if positive and lo is None:
        lo = 1
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"'{name}' must be {_range_text(lo, hi)}, got {_show(value)}", param=name)
    return int(value) if integer else float(value)


def _range_text(lo: float | None, hi: float | None) -> str:
    show = lambda x: str(int(x)) if float(x).is_integer() else f"{x:g}"  # noqa: E731
    if lo is not None and hi is not None:
        return f"between {show(lo)} and {show(hi)}"
    return f"at least {show(lo)}" if lo is not None else f"at most {show(hi)}"


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean (true or false), got {_show(value)}", param=name)
    return value


def _validate_part(where: str, j: int, part: Any) -> None:
    at = f"{where}.content[{j}]"
    if isinstance(part, str):
        return
    if not isinstance(part, dict):
        raise bad_request(f"{at} must be a content part object", param=at)
    kind = part.get("type")
    if kind in TEXT_PART_TYPES:
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{at}.text must be a string", param=f"{at}.text")
        return
    if is_image_part(part):
        return
    shown = _show(kind) if kind is not None else "missing"
    raise bad_request(unsupported_part(at, shown),
                      param=f"{at}.type", code="unsupported_content_part")


def _validate_message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object with 'role' and 'content'", param=where)
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role {_show(role)} is not one of {', '.join(sorted(ROLES))}", param=f"{where}.role")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise bad_request(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            _validate_part(where, j, part)
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise bad_request(f"{where}.tool_calls must be a list of {{'id','type','function':{{'name','arguments'}}}}",
                              param=f"{where}.tool_calls")
    if content is None and role != "assistant":
        raise bad_request(f"{where}.content is required for role {role!r}", param=f"{where}.content")
    return m


ORIGINAL_TOOLS_FIELD = "mlxstack_tools"   # the client's tools as sent, added by the front door on port 4000


def _original_tools(body: dict, tools: Any) -> Any:
    """The client's own ``tools`` when the front door of port 4000 carried them past LiteLLM
    (routing/front_door.py): LiteLLM 1.106.2 strips ``strict`` and ``additionalProperties: false``
    from every tool schema -- a property named "strict" too -- before they reach this server.
    Used only when it names the same functions, in the same order."""
    original = body.get(ORIGINAL_TOOLS_FIELD)
    if not isinstance(original, list) or not isinstance(tools, list) or len(original) != len(tools):
        return tools

    def name(t: Any) -> Any:
        fn = t.get("function") if isinstance(t, dict) else None
        return fn.get("name") if isinstance(fn, dict) else None
    return original if [name(t) for t in original] == [name(t) for t in tools] else tools


def _tools(body: dict) -> list | None:
    tools = _original_tools(body, body.get("tools"))
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of tool objects", param="tools")
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"parameters\": {...}}}", param=f"tools[{k}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{k}].function.parameters must be a JSON schema object",
                              param=f"tools[{k}].function.parameters")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad_request(f"tools[{k}].function.strict must be true or false", param=f"tools[{k}].function.strict")
    return tools or None


def tool_names(tools: list | None) -> list[str]:
    return [t["function"]["name"] for t in tools or []]


def _tool_choice(body: dict, tools: list | None) -> str | dict | None:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad_request(f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}, got " + _show(choice),
                              param="tool_choice")
        if choice == "required" and not tools:
            raise bad_request("'tool_choice' is 'required' but the request has no 'tools'", param="tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
    names = tool_names(tools)
    if fn["name"] not in names:
        raise bad_request(f"'tool_choice' names function {fn['name']!r}, which is not in 'tools' "
                          f"({', '.join(names) or 'none sent'})", param="tool_choice.function.name")
    return {"type": "function", "function": {"name": fn["name"]}}


def _response_format(body: dict) -> dict | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise bad_request(f"'response_format' must be {{\"type\": one of {', '.join(RESPONSE_FORMATS)}}}",
                          param="response_format.type")
    if kind != "json_schema":
        return {"type": kind}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object {\"name\": ..., \"schema\": {...}}",
                          param="response_format.json_schema")
    for key, types, what in (("name", str, "a string"), ("schema", dict, "an object"), ("strict", bool, "true or false")):
        if key in spec and spec[key] is not None and not isinstance(spec[key], types):
            raise bad_request(f"'response_format.json_schema.{key}' must be {what}",
                              param=f"response_format.json_schema.{key}")
    return {"type": kind, "json_schema": spec}


def _logit_bias(body: dict, vocab_size: int | None) -> dict[int, float] | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad_request("'logit_bias' must be an object {\"<token id>\": bias from -100 to 100}", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        where = f"logit_bias.{key[:20]}"
        if not _TOKEN_ID.match(key):
            raise bad_request(f"'logit_bias' keys must be token ids (decimal integers), got {key[:20]!r}", param="logit_bias")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise bad_request(f"'logit_bias' token id {token} is outside the model's vocabulary (0..{vocab_size - 1})",
                              param=where)
        out[token] = _number({where: value}, where, 0.0, lo=-100, hi=100)
    return out or None


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    return stop


MAX_CACHE_SALT = 1024


def cache_salt(body: dict) -> str:
    """The request's ``cache_salt`` (vLLM's field; at the top level or under ``extra_body``): a
    non-empty string, "" when absent. Requests share cached prompts only within one salt."""
    where, value = "cache_salt", body.get("cache_salt")
    extra = body.get("extra_body")
    if value is None and isinstance(extra, dict):
        where, value = "extra_body.cache_salt", extra.get("cache_salt")
    if value is None:
        return ""
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_CACHE_SALT:
        raise bad_request(f"'{where}' must be a non-empty string of at most {MAX_CACHE_SALT} characters",
                          param=where)
    return value


def parse_chat_request(body: dict, settings: Settings, vocab_size: int | None = None,
                       defaults: SamplingDefaults | None = None) -> ChatRequest:
    """Validate a chat-completions body. ``vocab_size`` (the logits width) bounds top_k and logit_bias."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    messages = [_validate_message(i, m) for i, m in enumerate(messages)]
    for i in range(len(messages)):
        orphan = orphan_tool_result(messages, i)
        if orphan is not None:
            raise bad_request(orphan[1], param=orphan[0], code="orphan_tool_result")
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    include_usage = _bool(opts, "include_usage", False)
    n = _number(body, "n", 1, integer=True, positive=True)
    if n != 1:
        raise bad_request(f"'n' = {n} is not supported: this server returns one choice per request. Send {n} "
                          "separate requests instead (the prompt is reused from the cache).", param="n",
                          code="unsupported_parameter")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", settings.default_max_tokens, integer=True,
                         positive=True, hi=MAX_INT)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT):
        raise bad_request(f"'seed' must be an integer from 0 to 2**64-1, got {_show(seed)}", param="seed")
    defaults = defaults or SamplingDefaults.resolve(settings)
    top_k = _number(body, "top_k", None, lo=0, integer=True)
    if vocab_size is not None and top_k is not None and top_k > vocab_size:
        raise bad_request(f"'top_k' must be from 0 (off) to the model's vocabulary size {vocab_size}, got {top_k}",
                          param="top_k")
    sampling, origin = defaults.for_request({
        "temperature": _number(body, "temperature", None, lo=0, hi=5),
        "top_p": _number(body, "top_p", None, lo=0, hi=1),
        "top_k": top_k,
        "min_p": _number(body, "min_p", None, lo=0, hi=1),
        "repetition_penalty": _number(body, "repetition_penalty", None, lo=0, hi=10)})
    top_k = sampling["top_k"]
    if vocab_size is not None and top_k >= vocab_size:
        top_k = 0  # keeping every token is no top-k at all (and mlx-lm's sampler refuses k == vocab)
    logprobs = _bool(body, "logprobs", False)
    top_logprobs = _number(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS, integer=True)
    if top_logprobs is not None and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    tools = _tools(body)
    try:
        thinking = resolve_enable_thinking(body, settings.default_thinking)
    except ValueError as exc:
        raise bad_request(str(exc), param="thinking") from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=top_k,
        min_p=sampling["min_p"],
        repetition_penalty=sampling["repetition_penalty"],
        repetition_context_size=_number(body, "repetition_context_size", defaults.repetition_context_size,
                                        integer=True, positive=True, hi=MAX_INT),
        max_tokens=max_tokens,
        stop=_stop(body),
        seed=seed,
        tools=tools,
        enable_thinking=thinking,
        body=body,
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=_number(body, "presence_penalty", 0.0, lo=-2, hi=2),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, lo=-2, hi=2),
        logit_bias=_logit_bias(body, vocab_size),
        tool_choice=_tool_choice(body, tools),
        response_format=_response_format(body),
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        sampling_origin=origin,
        repetition_scope=defaults.penalty_scope,
        cache_salt=cache_salt(body),
    )


def reject_images(messages: list[dict], model_id: str) -> None:
    """A text-only model cannot see images: say so instead of silently dropping them."""
    for i, j, part in image_parts(messages):
        raise bad_request(f"model {model_id} does not accept images (messages[{i}].content[{j}] is "
                          f"{part.get('type', 'image_url')!r}); send text only or serve a vision-language model",
                          param=f"messages[{i}].content", code="images_not_supported")


def model_matches(requested: str | None, served: str, aliases: set[str]) -> bool:
    if not requested:
        return True
    names = {served, *aliases}
    bare = requested.split("/", 1)[1] if "/" in requested else requested
    return requested in names or bare in names or requested.rsplit("/", 1)[-1] in names


__all__ = ["APIError", "ChatRequest", "parse_chat_request", "parse_json", "model_matches", "reject_images"]
