"""Tool-call extraction from generated text, tool-call ids, and the fallback tool prompt.

Pure functions: no MLX, no I/O.

    >>> content, calls = parse_tool_calls(
    ...     'Checking.<tool_call>{"name": "ls", "arguments": {"path": "a"}}</tool_call>')
    >>> content, calls[0].name, calls[0].arguments
    ('Checking.', 'ls', '{"path": "a"}')

Three formats are recognised whatever the model family; the family only decides which parser
is tried first on each `<tool_call>` block:

- Qwen XML:    `<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`
- GLM legacy:  `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`
- Hermes JSON: `<tool_call>{"name": NAME, "arguments": {...} | "<json string>"}</tool_call>`

A block is `<tool_call>` up to the next `</tool_call>`; a block missing its close tag ends at the
next `<tool_call>` or at the end of the text. Blocks no parser understands stay in the content
verbatim (a malformed call is never dropped silently).

Argument typing (XML and GLM values are text; JSON values are already typed):
- With a schema for the parameter (`tools[].function.parameters.properties[k].type`):
  integer/number/boolean/null/object/array are parsed from the text when they parse to that type
  (`"42"` -> 42, `"true"` -> True, `'{"a": 1}'` -> {"a": 1}); otherwise the text is kept as a
  string. `string` always stays a string. For JSON calls only string values are coerced.
- Without a schema (no tools, unknown tool or parameter), only unambiguous text is parsed:
  a JSON object or array (`{...}` / `[...]` that `json.loads` accepts), or a number whose
  canonical JSON form is the text itself (`42`, `-1.5`; not `007`, `1e3`, `1.50`).
  `true` / `false` / `null` stay strings, since a string parameter may hold those words.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ToolCall",
    "parse_tool_calls",
    "extract_tool_calls",
    "make_tool_call_id",
    "canonical_arguments",
    "render_tool_prompt",
    "inject_tool_prompt",
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(slots=True, frozen=True)
class ToolCall:
    """One extracted call. `arguments` is always a JSON object serialised as a string."""

    name: str
    arguments: str
    id: str

    def to_openai(self, index: int | None = None) -> dict:
        """OpenAI `tool_calls` entry; pass `index` for a streaming `delta.tool_calls` entry."""
        entry: dict[str, Any] = {}
        if index is not None:
            entry["index"] = index
        entry["id"] = self.id
        entry["type"] = "function"
        entry["function"] = {"name": self.name, "arguments": self.arguments}
        return entry


# ---------------------------------------------------------------------------------------------
# ids and canonical arguments
# ---------------------------------------------------------------------------------------------


def canonical_arguments(arguments: str | dict) -> str:
    """Canonical form of tool-call arguments, for matching clients that re-serialise JSON.

    Parsed value -> `json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)`, so
    `{"path": "a"}`, `{"path":"a"}` and `{"path": "\\u0061"}` all give `{"path":"a"}`. Text that is
    not JSON is returned unchanged (it can only match itself).
    """
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
    else:
        value = arguments
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def make_tool_call_id(name: str, arguments: str | dict, index: int, salt: str = "") -> str:
    """Deterministic id: `call_` + 24 hex of sha256(name, canonical args, index, salt).

    The same call in the same request scope (salt, e.g. the completion id) always gets the same
    id, so re-rendering or re-parsing an output never invents a different id.
    """
    material = "\x00".join((name, canonical_arguments(arguments), str(index), salt))
    return "call_" + hashlib.sha256(material.encode("utf-8")).hexdigest()[:24]


# ---------------------------------------------------------------------------------------------
# argument typing
# ---------------------------------------------------------------------------------------------

_CANONICAL_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?")


def _reject_constant(name: str) -> float:
    # json.loads accepts NaN/Infinity, which json.dumps would write back as invalid JSON.
    raise ValueError(f"non-finite number {name!r}")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def schema_type(schema: Any) -> str | None:
    """The first non-null JSON-schema type of a property schema, or None when unknown."""
    if not isinstance(schema, dict):
        return None
    typ = schema.get("type")
    if isinstance(typ, str):
        return typ
    if isinstance(typ, list):
        names = [t for t in typ if isinstance(t, str) and t != "null"]
        return names[0] if names else ("null" if "null" in typ else None)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            for option in options:
                found = schema_type(option)
                if found and found != "null":
                    return found
    if "properties" in schema:
        return "object"
    if "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return "string"
    return None


def _parse_structured(text: str, want: type) -> Any:
    """Parse JSON (or a Python literal, which some models write) of the wanted container type."""
    try:
        value = _loads(text)
    except ValueError:
        try:
            value = ast.literal_eval(text)
            json.dumps(value)  # must be representable as JSON
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    return value if isinstance(value, want) else None


def _coerce(text: str, typ: str | None) -> Any:
    """Type one textual argument value; see the module docstring for the rules."""
    stripped = text.strip()
    if typ == "string":
        return text
    if typ == "integer":
        try:
            return int(stripped)
        except ValueError:
            try:
                value = _loads(stripped)
            except ValueError:
                return text
            if isinstance(value, float) and value.is_integer():
                return int(value)
            return text
    if typ == "number":
        try:
            value = _loads(stripped)
        except ValueError:
            return text
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        return text
    if typ == "boolean":
        lowered = stripped.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        return text
    if typ == "null":
        return None if stripped.lower() in ("null", "none", "") else text
    if typ == "object":
        value = _parse_structured(stripped, dict)
        return text if value is None else value
    if typ == "array":
        value = _parse_structured(stripped, list)
        return text if value is None else value
    # No schema: parse only what cannot reasonably have been meant as a string.
    if stripped[:1] in ("{", "[") and stripped[-1:] in ("}", "]"):
        try:
            value = _loads(stripped)
        except ValueError:
            return text
        return value if isinstance(value, (dict, list)) else text
    if _CANONICAL_NUMBER.fullmatch(stripped):
        value = _loads(stripped)
        if json.dumps(value) == stripped:
            return value
    return text


def _properties(tools: list | None, name: str) -> dict | None:
    """`parameters.properties` of the named tool in an OpenAI `tools` list, or None."""
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters") or fn.get("input_schema") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return None


def _type_text_args(pairs: list[tuple[str, str]], props: dict | None) -> dict:
    args: dict[str, Any] = {}
    for key, value in pairs:
        args[key] = _coerce(value, schema_type((props or {}).get(key)))
    return args


# ---------------------------------------------------------------------------------------------
# the three block parsers: body text -> (name, args dict) or None
# ---------------------------------------------------------------------------------------------

_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_XML_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL
)
_GLM_NAME = re.compile(r"\s*([^\s<>{}\[\]\"',]+)\s*(?=<arg_key>|\Z)")
_GLM_PAIR = re.compile(
    r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|(?=<arg_key>)|\Z)", re.DOTALL
)


def _parse_xml(body: str, tools: list | None, closed: bool) -> tuple[str, dict] | None:
    m = _XML_FUNCTION.match(body)
    if not m:
        return None
    name = m.group(1).strip()
    inner = m.group(2)
    if not name or inner.replace("</function>", "").strip() and "<parameter=" not in inner:
        return None
    pairs = []
    for p in _XML_PARAMETER.finditer(inner):
        value = p.group(2)
        # The Qwen3 templates write each value on its own line(s): drop exactly that framing.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        pairs.append((p.group(1).strip(), value))
    return name, _type_text_args(pairs, _properties(tools, name))


def _parse_glm(body: str, tools: list | None, closed: bool) -> tuple[str, dict] | None:
    m = _GLM_NAME.match(body)
    if not m:
        return None
    name = m.group(1)
    rest = body[m.end():]
    if not closed and "<arg_key>" not in rest:
        return None  # a bare word after an unclosed <tool_call> is too weak to call a tool
    pairs = []
    pos = 0
    for p in _GLM_PAIR.finditer(rest):
        if rest[pos:p.start()].strip():
            return None  # stray text between pairs: not this format
        pairs.append((p.group(1).strip(), p.group(2)))
        pos = p.end()
    if rest[pos:].strip():
        return None
    return name, _type_text_args(pairs, _properties(tools, name))


def _parse_json(body: str, tools: list | None, closed: bool) -> tuple[str, dict] | None:
    text = body.strip()
    if not text.startswith("{"):
        return None
    try:
        obj, end = json.JSONDecoder(parse_constant=_reject_constant).raw_decode(text)
    except ValueError:
        return None
    if text[end:].strip() or not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        fn = obj.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            obj, name = fn, fn["name"]
        else:
            return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _loads(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    props = _properties(tools, name)
    if props:
        # JSON is already typed; only fix strings the schema says are something else.
        args = {
            k: _coerce(v, schema_type(props.get(k)))
            if isinstance(v, str) and schema_type(props.get(k)) not in (None, "string")
            else v
            for k, v in args.items()
        }
    return name, args


_PARSERS = {"xml": _parse_xml, "glm": _parse_glm, "json": _parse_json}


def _parser_order(family: str) -> tuple[str, ...]:
    """Family-prioritised parser order: qwen* -> XML first, glm* -> legacy first, else JSON."""
    fam = (family or "").lower()
    if fam.startswith("qwen"):
        return ("xml", "json", "glm")
    if fam.startswith("glm"):
        return ("glm", "xml", "json")
    return ("json", "xml", "glm")


# ---------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------


def extract_tool_calls(
    text: str, tools: list | None = None, family: str = "generic", *, id_salt: str = ""
) -> tuple[str, list[ToolCall]]:
    """Like `parse_tool_calls` but the remaining text is not stripped (the streaming splitter
    feeds it through its own whitespace trimming, which must see the raw text)."""
    order = [_PARSERS[n] for n in _parser_order(family)]
    out: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            out.append(text[pos:])
            break
        body_start = start + len(TOOL_CALL_OPEN)
        close = text.find(TOOL_CALL_CLOSE, body_start)
        reopen = text.find(TOOL_CALL_OPEN, body_start)
        closed = close >= 0 and (reopen < 0 or close < reopen)
        if closed:
            body, end = text[body_start:close], close + len(TOOL_CALL_CLOSE)
        else:  # missing close tag: the block runs to the next open tag or the end
            end = reopen if reopen >= 0 else len(text)
            body = text[body_start:end]
        parsed = None
        for parser in order:
            parsed = parser(body, tools, closed)
            if parsed is not None:
                break
        out.append(text[pos:start])
        if parsed is None:
            out.append(text[start:end])  # unknown block: keep it visible
        else:
            name, args = parsed
            arguments = json.dumps(args, ensure_ascii=False)
            calls.append(ToolCall(name, arguments, make_tool_call_id(name, args, len(calls), id_salt)))
        pos = end
    return "".join(out), calls


def parse_tool_calls(
    text: str, tools: list | None = None, family: str = "generic", *, id_salt: str = ""
) -> tuple[str, list[ToolCall]]:
    """Extract tool calls from generated text.

    Args:
        text: generated text (reasoning already removed).
        tools: the request's OpenAI `tools` list, used to type argument values.
        family: model family; decides which parser is tried first ("qwen3", "glm4", "generic").
        id_salt: request-scoped salt for `make_tool_call_id` (e.g. the completion id).

    Returns:
        (content, calls): the text with every recognised `<tool_call>` block removed, then
        stripped of leading/trailing whitespace; and the calls in order. Unrecognised blocks stay
        in the content verbatim.
    """
    rest, calls = extract_tool_calls(text, tools, family, id_salt=id_salt)
    return rest.strip(), calls


def render_tool_prompt(tools: list) -> str:
    """System-prompt block describing `tools` and asking for Hermes JSON tool calls.

    For chat templates that do not accept `tools` (e.g. SmolLM2); the output is parsed back by
    `parse_tool_calls`. Deterministic for the same `tools`, so the prompt prefix stays cacheable.
    """
    lines = [
        "# Tools",
        "",
        "You may call one or more functions to assist with the user query.",
        "",
        "You are provided with function signatures within <tools></tools> XML tags:",
        "<tools>",
    ]
    for tool in tools:
        if isinstance(tool, dict) and "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        lines.append(json.dumps(tool, ensure_ascii=False))
    lines += [
        "</tools>",
        "",
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:",
        "<tool_call>",
        '{"name": <function-name>, "arguments": <args-json-object>}',
        "</tool_call>",
    ]
    return "\n".join(lines)


def inject_tool_prompt(messages: list[dict], tools: list | None) -> list[dict]:
    """Return a new message list with `render_tool_prompt(tools)` in the leading system message.

    The block is appended to messages[0] when it is a system message, else a new system message
    is inserted at index 0. NOTE: only the *leading* system message is used, never a later
    (mid-conversation) one, so that reminders stay where they occur and the prefix is stable.
    Input messages are not mutated. With no tools the list is returned copied, unchanged.
    """
    out = list(messages)
    if not tools:
        return out
    block = render_tool_prompt(tools)
    if out and isinstance(out[0], dict) and out[0].get("role") == "system":
        first = dict(out[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [*content, {"type": "text", "text": "\n\n" + block}]
        elif content:
            first["content"] = f"{content}\n\n{block}"
        else:
            first["content"] = block
        out[0] = first
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
