#!/usr/bin/env python3
"""Tokens NORMALIZE_WRITE_TOOL_CONTENT_FOR_PROMPT saves (and costs) on a 10-turn file-writing session.

No recorded client session with file writes is in the repository, so the session is synthetic but
shaped like Claude Code's: its system prompt and tools, one user request, then ten turns in which
the agent writes one file with ``Write`` (file_path, content) and gets ``File created successfully
at: …`` back. The files are ten real modules of this repository (2-11 KB). Each
request is prepared by the real engine (heal -> normalise -> canonicalise -> one render -> tokens),
with the setting off and on, on the embedded model's tokenizer and template (``--model`` for another).

Printed per request: prompt tokens (what the model attends to and the KV holds) and the tokens a
turn prefills when the previous turn's entry is in the cache. That entry is taken to hold the
previous prompt and the reply exactly as the next request renders it (the healing store's job):
off, a turn prefills only its tool result; on, the write that was last becomes a placeholder, so
the turn prefills from there (that write's content, decoded once, is prefilled once as a
placeholder and the next write whole).

    .venv/bin/python scripts/measure_write_content.py [--model PATH] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlxstack.cache.lcp import lcp  # noqa: E402
from mlxstack.config.settings import load_settings  # noqa: E402
from mlxstack.engine.chat import ChatJob  # noqa: E402
from mlxstack.engine.factory import make_engine  # noqa: E402
from mlxstack.models.loader import load_model  # noqa: E402
from mlxstack.runner.sampling import SamplingParams  # noqa: E402

FILES = ["mlxstack/prompt/healing.py", "mlxstack/prompt/scrub.py", "mlxstack/prompt/render.py",
         "mlxstack/prompt/sized_lru.py", "mlxstack/prompt/session_context.py", "mlxstack/prompt/tokenize.py",
         "mlxstack/prompt/key_text.py", "mlxstack/prompt/thinking.py", "mlxstack/cache/sessions.py",
         "mlxstack/cache/hashing.py"]
SYSTEM = ("You are Claude Code, Anthropic's official CLI for Claude.\n\nYou are an interactive CLI tool that helps "
          "users with software engineering tasks. Use the instructions below and the tools available to you to "
          "assist the user.\n\n# Tone and style\nBe concise, direct, and to the point.\n\n# Tool usage policy\n"
          "Read files before editing them. Write whole files with Write; change parts with Edit.")
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {k: {"type": "string"} for k in props}, "required": list(props)}}}
    for name, desc, props in (("Write", "Writes a file to the local filesystem.", ("file_path", "content")),
                              ("Read", "Reads a file from the local filesystem.", ("file_path",)),
                              ("Edit", "Performs exact string replacements in files.",
                               ("file_path", "old_string", "new_string")))]


def session(files: list[str]) -> list[list[dict]]:
    """Request t (1-based) holds the agent's first t writes and their results."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Rewrite these ten modules from the design notes, one file per step."}]
    requests = []
    for i, rel in enumerate(files):
        args = {"file_path": f"/work/project/{rel}", "content": (REPO / rel).read_text()}
        messages = messages + [
            {"role": "assistant", "content": f"Writing {rel}.", "tool_calls": [
                {"id": f"toolu_{i:02d}", "type": "function",
                 "function": {"name": "Write", "arguments": json.dumps(args, ensure_ascii=False)}}]},
            {"role": "tool", "tool_call_id": f"toolu_{i:02d}", "content": f"File created successfully at: {args['file_path']}"}]
        requests.append(messages)
    return requests


def prepare(engine, messages: list[dict], tools: list | None = TOOLS):
    job = ChatJob(request_id="measure", messages=messages, tools=tools, enable_thinking=False,
                  params=SamplingParams(temperature=0.0, max_tokens=1), stop=[], body={"session_id": "measure"},
                  headers={}, emit=lambda _t: None, is_cancelled=lambda: False)
    return engine.prepare(job)


def load(model: str = ""):
    """(the loaded model, the settings the engines start from)."""
    env = {"MODEL_PATH": model, "DEFAULT_THINKING": "false", "ENABLE_REQUEST_LOGGING": "false",
           "DISK_CACHE_DIR": "off", "MLX_PORT": "0", "SPEC_CALIBRATE": "off"}
    base = load_settings(env=env)
    return load_model(base), base


def prefill_rows(loaded, base, requests: list[tuple[list[dict], list | None]]) -> list[dict]:
    """Per request (messages, tools), prepared with the setting off and on: its prompt tokens and
    the tokens it prefills when the previous request's prompt plus its reply are cached (the
    healing store's job: the reply as this request renders it; the last assistant message is never
    normalised) -- all of that while the previous prompt is a prefix of this one, else up to where
    the two part (a write that became a placeholder since)."""
    rows: list[dict] = [{} for _ in requests]
    for flag in (False, True):
        engine = make_engine(loaded, base.replace(normalize_write_tool_content_for_prompt=flag))
        previous = None
        for row, (messages, tools) in zip(rows, requests):
            prep = prepare(engine, messages, tools)
            through_reply = prepare(engine, messages[:-1], tools).history_end
            cached = through_reply
            if previous is not None:
                common = lcp(previous.model_np, prep.model_np)
                cached = through_reply if common >= len(previous.model_tokens) else min(through_reply, common)
            key = "on" if flag else "off"
            row[f"prompt_{key}"] = len(prep.model_tokens)
            row[f"prefilled_{key}"] = len(prep.model_tokens) - cached
            previous = prep
    return rows


def totals(rows: list[dict]) -> dict:
    return {k: sum(r[k] for r in rows) for k in ("prompt_off", "prompt_on", "prefilled_off", "prefilled_on")}


def print_rows(rows: list[dict], first: tuple[str, str], second: tuple[str, str]) -> None:
    """The table: two leading columns (key, heading) of each row, then the four counts, a sum line
    and the last request's saving."""
    (k1, h1), (k2, h2) = first, second
    print(f"{h1:>4} {h2:>7} {'prompt off':>10} {'prompt on':>9} {'prefill off':>11} {'prefill on':>10}")
    for r in rows:
        print(f"{r[k1]:>4} {r[k2]:>7} {r['prompt_off']:>10} {r['prompt_on']:>9} "
              f"{r['prefilled_off']:>11} {r['prefilled_on']:>10}")
    t, last = totals(rows), rows[-1]
    print(f"sum  {'':>7} {t['prompt_off']:>10} {t['prompt_on']:>9} {t['prefilled_off']:>11} {t['prefilled_on']:>10}")
    print(f"last request: {last['prompt_off']} -> {last['prompt_on']} prompt tokens "
          f"({last['prompt_off'] - last['prompt_on']} fewer, {100 * (1 - last['prompt_on'] / last['prompt_off']):.0f}%); "
          f"over the {len(rows)} requests: {t['prompt_off'] - t['prompt_on']} prompt tokens fewer, "
          f"{t['prefilled_on'] - t['prefilled_off']} more prefilled")


def measure(model: str) -> dict:
    loaded, base = load(model)
    rows = prefill_rows(loaded, base, [(messages, TOOLS) for messages in session(FILES)])
    for t, row in enumerate(rows):
        row.update({"turn": t + 1, "file_bytes": len((REPO / FILES[t]).read_bytes())})
    return {"model": model or "embedded SmolLM2-135M-Instruct", "rows": rows, "total": totals(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="MODEL_PATH whose tokenizer and template to use (default: embedded)")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args()
    result = measure(args.model)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"model: {result['model']}")
    print_rows(result["rows"], ("turn", "turn"), ("file_bytes", "file B"))


if __name__ == "__main__":
    main()
