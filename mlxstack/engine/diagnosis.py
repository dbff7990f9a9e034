"""Cache diagnoses on the inference worker: a request's fingerprint at start, its comparison with
the session's previous request and with the reply the client named, and the fingerprint kept at
finish for the next request to compare with (cache/diagnosis.py holds the pure parts).

    report = start_report(state, job, prep, session_id, match, from_disk)   # after the lookup
    keep_fingerprint(state, seq, tokens)                                     # at finish
"""
from __future__ import annotations

from typing import Any

from ..cache.diagnosis import NONE, Diagnosis, diagnose, fingerprint, with_tokens
from .request import CacheReport, ChatJob, PreparedPrompt, Request


def request_settings(job: ChatJob) -> dict[str, Any]:
    """The settings that shape the prompt (compared after the messages)."""
    body = job.body if isinstance(job.body, dict) else {}
    return {"text_format": job.response_format,
            "reasoning": [job.enable_thinking, body.get("reasoning_effort"), body.get("thinking")],
            "tool_choice": job.tool_choice}


def prompt_fingerprint(job: ChatJob, prep: PreparedPrompt) -> Any:
    body = job.body if isinstance(job.body, dict) else {}
    return fingerprint(model=str(body.get("model")), messages=prep.original, canonical=prep.canonical,
                       tools=job.tools, settings=request_settings(job), prompt_cache_key=body.get("prompt_cache_key"),
                       tokens=prep.model_np)


def start_report(state: Any, job: ChatJob, prep: PreparedPrompt, session_id: str, match: Any,
                 from_disk: bool) -> tuple[Any, CacheReport]:
    """(the prompt's fingerprint, the report) once the lookup has run."""
    fp = prompt_fingerprint(job, prep)
    cached = match.depth if match.hit else 0
    on = bool(state.kv.enabled)
    previous = state.fingerprint("session:" + session_id)
    session = diagnose(previous, fp, prep.model_np, cached=cached, cache_on=on) if previous is not None else None
    asked = None
    if job.diagnose:
        if job.compare_to is None:
            asked = Diagnosis(NONE)          # opted in on a first turn: nothing to compare with
        else:
            asked = diagnose(state.fingerprint(reply_key(job.scope, job.compare_to)), fp, prep.model_np,
                             cached=cached, cache_on=on)
    report = CacheReport(tier="disk" if from_disk else ("ram" if match.hit else "none"),
                         match=match.match_type if match.hit else "miss", cached=cached,
                         prompt=len(prep.model_tokens), session=session, asked=asked)
    # the turn's entry will hold the whole prompt (finish() says 0 again for an aborted reply)
    report.written = report.prompt - cached if on and report.prompt > cached else 0
    return fp, report


def reply_key(scope: str, response_id: str) -> str:
    """Where a reply's fingerprint is kept: under its id in its cache scope (a reply of another
    scope is never found, whatever id a request names)."""
    return f"id:{scope}/{response_id}" if scope else "id:" + response_id


def keep_fingerprint(state: Any, seq: Request, tokens: list[int]) -> None:
    """Keep the request's fingerprint over ``tokens`` (its prompt and the reply the next turn
    continues from) under its session and its reply's id. A first turn in an implicit session is
    kept under the id its next turn has and under its own (a retry of the same first turn, which
    has no reply yet, compares with it too)."""
    if seq.fingerprint is None:
        return
    fp = with_tokens(seq.fingerprint, tokens)
    keys = ["session:" + (seq.record_session or seq.session.session_id), "session:" + seq.session.session_id]
    if seq.job.response_id:
        keys.append(reply_key(seq.job.scope, seq.job.response_id))
    state.keep_fingerprint(keys, fp)


__all__ = ["keep_fingerprint", "prompt_fingerprint", "request_settings", "start_report"]
