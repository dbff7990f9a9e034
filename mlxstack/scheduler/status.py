"""Where a request is on its way through the engine core: one explicit status, set at every
transition (engine/core.py), read by the stats, the request log and the tests.

    WAITING    started (rendered, looked up, checked out), not yet given a row
    PARKED     started, waiting for KV memory (admission by bytes: engine/core.py ``parked``)
    PREFILLING feeding its prompt, chunk by chunk or in a short batch
    FOLLOWING  waiting to take a leader's prefill of a shared prompt (scheduler/shared_prefill.py)
    DECODING   a row of the decode batch
    PREEMPTED  left the batch for a more urgent request, its KV and pending token kept; resumes
               exactly where it was (scheduler/priority.py)
    CLOSING    replied; its turn's closer is fed and stored later, with others (``closing``)
    FINISHED   resolved: its outcome or its error went back
"""
from __future__ import annotations

from enum import Enum


class RequestStatus(str, Enum):
    WAITING = "waiting"
    PARKED = "parked"
    PREFILLING = "prefilling"
    FOLLOWING = "following"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    CLOSING = "closing"
    FINISHED = "finished"
