"""Lockstep records as plain data: JSON with a few tags, never pickle (LESSONS 66).

    data = encode(record)        # rank 0: bytes for the control channel
    record = decode(data)        # a follower: a Record, or RecordError (the rank stops)

A record carries a chat job's fields (messages, body, headers without credentials, sampling
parameters), a grammar's spec and the worker calls every rank repeats. JSON has no tuples, sets,
non-string keys or dataclasses, so each is written as an object with one tag key:

    {"$t": [...]}              a tuple (the scheduler digest compares tuples)
    {"$fs": [...]}             a frozenset (stop token ids)
    {"$d": [[k, v], ...]}      a dict whose keys are not all plain strings, or one of whose keys
                               starts with "$" (a client's JSON cannot pass for a tag)
    {"$b": "base64"}           bytes
    {"$dc": name, "f": {...}}  one of ``DATACLASSES`` (by name; no other class is ever built)

Decoding builds only JSON values, these containers and the listed dataclasses with their own
field names: unlike ``pickle.loads``, no input can name a callable to run. Pure.
"""
from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

from ..constraints.grammars import GrammarSpec, Stage
from ..runner.sampling import SamplingParams

__all__ = ["encode", "decode", "to_plain", "from_plain", "RecordError", "DATACLASSES"]

DATACLASSES: dict[str, type] = {c.__name__: c for c in (SamplingParams, GrammarSpec, Stage)}
_TAGS = ("$t", "$fs", "$d", "$b", "$dc")


class RecordError(ValueError):
    """Bytes that are not a record this codec wrote."""


def to_plain(value: Any) -> Any:
    """``value`` as JSON-ready data (tags above); TypeError for anything else (a callable, an
    array, an unlisted class): what a record may carry is decided here, not by the sender."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if isinstance(value, tuple):
        return {"$t": [to_plain(v) for v in value]}
    if isinstance(value, frozenset):
        return {"$fs": [to_plain(v) for v in sorted(value, key=repr)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: to_plain(v) for k, v in value.items()}
        return {"$d": [[to_plain(k), to_plain(v)] for k, v in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"$b": base64.b64encode(bytes(value)).decode("ascii")}
    name = type(value).__name__
    if dataclasses.is_dataclass(value) and DATACLASSES.get(name) is type(value):
        return {"$dc": name, "f": {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    raise TypeError(f"a lockstep record cannot carry a {type(value).__module__}.{name}")


def from_plain(value: Any) -> Any:
    """The inverse of ``to_plain``; RecordError for a tag it did not write."""
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = next((k for k in value if k.startswith("$")), None)
    if tag is None:
        return {k: from_plain(v) for k, v in value.items()}
    if tag not in _TAGS or len(value) != (2 if tag == "$dc" else 1):
        raise RecordError(f"unknown tag {tag!r} in a record")
    body = value[tag]
    try:
        if tag == "$t":
            return tuple(from_plain(v) for v in body)
        if tag == "$fs":
            return frozenset(from_plain(v) for v in body)
        if tag == "$d":
            return {_key(from_plain(k)): from_plain(v) for k, v in body}
        if tag == "$b":
            return base64.b64decode(body.encode("ascii"), validate=True)
        cls = DATACLASSES.get(body) if isinstance(body, str) else None
        fields = value.get("f")
        if cls is None or not isinstance(fields, dict):
            raise RecordError(f"no such record class: {body!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        if not set(fields) <= names:
            raise RecordError(f"{body}: unknown fields {sorted(set(fields) - names)}")
        return cls(**{k: from_plain(v) for k, v in fields.items()})
    except RecordError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise RecordError(f"a malformed {tag} value in a record: {exc}") from None


def _key(k: Any) -> Any:
    if isinstance(k, (list, dict)):
        raise RecordError("a dict key that is a list or a dict")
    return k


def encode(record: Any) -> bytes:
    """A ``lockstep.Record`` (any dataclass whose fields ``to_plain`` takes) as UTF-8 JSON."""
    fields = {f.name: to_plain(getattr(record, f.name)) for f in dataclasses.fields(record)}
    return json.dumps(fields, ensure_ascii=False, separators=(",", ":"), allow_nan=True).encode("utf-8")


def decode(data: bytes, cls: type) -> Any:
    """``cls`` (the record's dataclass) from ``encode``'s bytes; RecordError otherwise."""
    try:
        fields = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"not a JSON record: {exc}") from None
    names = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(fields, dict) or set(fields) != names:
        raise RecordError(f"a record has the fields {sorted(names)}")
    return cls(**{k: from_plain(v) for k, v in fields.items()})
