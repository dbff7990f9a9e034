"""Tool results that answer no call: refused with 400 on every front (pure).

OpenAI answers a chat request whose ``tool`` message does not follow an assistant message with
``tool_calls`` (or names a call id that message did not make) with 400; LiteLLM's transforms and
chat templates take it silently and the model sees a result for a call it never made. The front
door of 4000 (routing/front_door.py) and the MLX server's validation (server/common/validation.py) both ask
this function, so the answer is the same through 4000 and 8080.
"""
from __future__ import annotations

__all__ = ["orphan_tool_result"]


def orphan_tool_result(messages: list, i: int) -> tuple[str, str] | None:
    """(param, message) when ``messages[i]`` is a tool result that answers no call of the
    assistant message before it (OpenAI: 400 "messages with role 'tool' must be a response to a
    preceding message with 'tool_calls'"), else None. Pure; the MLX server applies it too."""
    msg = messages[i]
    if not isinstance(msg, dict) or msg.get("role") != "tool":
        return None
    where = f"messages[{i}]"
    j = i - 1
    while j >= 0 and isinstance(messages[j], dict) and messages[j].get("role") == "tool":
        j -= 1
    calls = messages[j].get("tool_calls") if j >= 0 and isinstance(messages[j], dict) \
        and messages[j].get("role") == "assistant" else None
    if not isinstance(calls, list) or not calls:
        return where, (f"'{where}' has role 'tool' but does not follow an assistant message with 'tool_calls': "
                       "a tool result must answer a call")
    ids = {c.get("id") for c in calls if isinstance(c, dict)}
    call_id = msg.get("tool_call_id")
    if call_id is not None and None not in ids and call_id not in ids:      # calls without ids: no check
        return f"{where}.tool_call_id", (f"'{where}.tool_call_id' {str(call_id)[:80]!r} matches no call of the "
                                         "assistant message before it")
    return None
