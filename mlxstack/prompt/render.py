"""Chat-template rendering with identical kwargs for the cache key and the model input.

    renderer = ChatRenderer(tokenizer, preserve_thinking=True)
    text = renderer.render(messages, tools=tools, enable_thinking=True)

Messages arrive validated (server/common/validation.py). Before the template sees them:
- ``developer`` becomes ``system`` (PI sends its system prompt as developer);
- list content is joined to text for text models (an image part is a TemplateError: 400);
  the VLM renderer (engine/vlm_chat.py) overrides ``render_content`` to keep image parts;
- an assistant ``reasoning_content`` is re-inserted as a ``<think>`` block when the template does
  not render that field itself, so a turn whose reasoning the client kept is a cache hit;
- mid-conversation system messages stay where they occur. If the template refuses a non-leading
  system message, it is rendered in place as a user turn whose text starts with ``[system]``.
When the template has no notion of tools, a tool prompt is injected into the system message
(parsing/tool_calls.py) and the template is called without ``tools``.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

from ..parsing.tool_calls import inject_tool_prompt
from .tokenize import encoder_for
from .images import IMAGE_PART_TYPES


class TemplateError(ValueError):
    """The chat template could not render the request (a client error: 400)."""


def _template_source(tokenizer: Any) -> str:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    tpl = getattr(inner, "chat_template", None) or ""
    if isinstance(tpl, dict):
        tpl = " ".join(str(v) for v in tpl.values())
    return str(tpl)


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
            parts.append(str(part.get("text", "")))
        elif isinstance(part, str):
            parts.append(part)
    return "".join(parts)


class ChatRenderer:
    def __init__(self, tokenizer: Any, preserve_thinking: bool = True) -> None:
        self.tokenizer = tokenizer
        source = _template_source(tokenizer)
        self.supports_tools = "tools" in source
        self.renders_reasoning_content = "reasoning_content" in source
        # GPT-OSS-style templates read an assistant's reasoning from ``thinking`` instead.
        self.renders_thinking_field = not self.renders_reasoning_content and bool(
            re.search(r"message\.thinking|message\[['\"]thinking['\"]\]|['\"]thinking['\"] in message", source))
        self.supports_thinking = "enable_thinking" in source
        self.preserve_thinking = preserve_thinking and self._probe_preserve_thinking(source)
        self.template_source = source
        self._shape: dict[bool, tuple[str, str, str]] = {}
        for thinking in (False, True):   # probed here, so no request pays for the probe renders
            self._assistant_shape(thinking)

    # Probe once at start-up: the same decision is used for every render (key and model).
    def _probe_preserve_thinking(self, source: str) -> bool:
        if "preserve_thinking" not in source:
            return False
        try:
            self._apply([{"role": "user", "content": "hi"}], None, False, {"preserve_thinking": True})
            return True
        except Exception:  # noqa: BLE001
            return False

    def prepare(self, messages: list[dict], tools: list | None) -> tuple[list[dict], list | None]:
        out = []
        for i, msg in enumerate(messages):
            m = copy.copy(msg)
            if m.get("role") == "developer":
                m["role"] = "system"
            if not isinstance(m.get("content"), str) and m.get("content") is not None:
                m["content"] = self.render_content(m["content"], i)
            if m.get("role") == "assistant":
                m = self._assistant(m)
            out.append(m)
        if tools and not self.supports_tools:
            return inject_tool_prompt(out, tools), None
        return out, tools or None

    def render_content(self, content: list, index: int) -> Any:
        """List content for the template: joined text (a VLM renderer keeps image parts)."""
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                raise TemplateError(f"this model is text-only and does not accept images (messages[{index}]"
                                    f".content[{j}] is {part.get('type')!r}); send text only or serve a "
                                    "vision-language model")
        return content_text(content)

    def _assistant(self, m: dict) -> dict:
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning and self.renders_thinking_field:
            m["thinking"] = reasoning
            m.pop("reasoning_content", None)
            m.pop("reasoning", None)
        elif reasoning and not self.renders_reasoning_content:
            content = m.get("content") or ""
            if "<think>" not in content:
                m["content"] = f"<think>\n{reasoning}\n</think>\n\n{content}"
            m.pop("reasoning_content", None)
            m.pop("reasoning", None)
        if m.get("tool_calls") and not self.supports_tools:
            # The template cannot render tool calls: write them as the Hermes markup we prompted for.
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", {})
                args = fn.get("arguments", "{}")
                try:
                    args_obj = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    args_obj = args
                calls.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args_obj}, ensure_ascii=False) + "\n</tool_call>")
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + "\n".join(calls)
            m.pop("tool_calls", None)
        return m

    def _apply(self, messages: list[dict], tools: list | None, enable_thinking: bool, extra: dict,
               add_generation_prompt: bool = True) -> str:
        kwargs: dict[str, Any] = dict(extra)
        if tools:
            kwargs["tools"] = tools
        kwargs["enable_thinking"] = enable_thinking
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def render(self, messages: list[dict], tools: list | None = None, enable_thinking: bool = False,
               add_generation_prompt: bool = True) -> str:
        prepared, tools_arg = self.prepare(messages, tools)
        extra = {"preserve_thinking": True} if self.preserve_thinking else {}
        try:
            return self._apply(prepared, tools_arg, enable_thinking, extra, add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja raises many kinds
            if any(m.get("role") == "system" for m in prepared[1:]):
                demoted = [
                    m if i == 0 or m.get("role") != "system"
                    else {**m, "role": "user", "content": "[system] " + content_text(m.get("content"))}
                    for i, m in enumerate(prepared)
                ]
                try:
                    return self._apply(demoted, tools_arg, enable_thinking, extra, add_generation_prompt)
                except Exception:  # noqa: BLE001
                    pass
            raise TemplateError(f"chat template could not render the messages: {exc}") from None


    def generation_extra(self, enable_thinking: bool, has_tools: bool) -> str:
        """Text the generation prompt adds after the template's own assistant-turn opener
        (e.g. ``<think>\n`` for Qwen3 with thinking on). The KV holds it before the generated
        tokens, so a healed assistant turn must start with it to re-render identically."""
        return self._assistant_shape(enable_thinking)[0]

    def generation_suffix(self, enable_thinking: bool) -> str:
        """All the text the generation prompt appends after the last message
        (``<|im_start|>assistant\n<think>\n``): the template's opener plus ``generation_extra``."""
        return self._assistant_shape(enable_thinking)[2]

    def assistant_closer(self, enable_thinking: bool) -> str:
        """Text the template writes right after an assistant turn's content (e.g.
        ``<|im_end|>\n``): the next turn's prompt is certain to contain it after the reply."""
        return self._assistant_shape(enable_thinking)[1]

    def _assistant_shape(self, enable_thinking: bool) -> tuple[str, str, str]:
        if enable_thinking not in self._shape:
            self._shape[enable_thinking] = self._probe_assistant_shape(enable_thinking)
        return self._shape[enable_thinking]

    def _probe_assistant_shape(self, enable_thinking: bool) -> tuple[str, str, str]:
        marker = "\u2063PROBE\u2063"
        history = [{"role": "user", "content": "probe"}]
        try:
            base = self.render(history, None, enable_thinking, add_generation_prompt=False)
            gen = self.render(history, None, enable_thinking, add_generation_prompt=True)
            probe = self.render(history + [{"role": "assistant", "content": marker}, {"role": "user", "content": "next"}],
                                None, enable_thinking, add_generation_prompt=False)
            after = self.render(history + [{"role": "assistant", "content": marker}], None, enable_thinking,
                                add_generation_prompt=False)
        except TemplateError:
            return "", "", ""
        if not (gen.startswith(base) and probe.startswith(base) and marker in probe and after.startswith(base)):
            return "", "", gen[len(base):] if gen.startswith(base) else ""
        opener = probe[len(base):probe.index(marker)]
        tail = gen[len(base):]
        extra = tail[len(opener):] if tail.startswith(opener) else ""
        # The closer is what follows the content both as the last turn and before the next one.
        close_last = after[after.index(marker) + len(marker):]
        close_mid = probe[probe.index(marker) + len(marker):]
        closer = close_last if close_mid.startswith(close_last) else ""
        return extra, closer, tail


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered chat text (template text carries its own special tokens)."""
    return encoder_for(tokenizer).encode(text)
