"""Which sampling values a request gets when it does not name them: its own fields first, then the
model's ``generation_config.json``, then the settings. Pure (the file is read by models/loaded.py).

    defaults = SamplingDefaults.resolve(settings, generation_config)      # once, at load
    values, origin = defaults.for_request(body)                           # per request

Two rules make explicit greedy mean greedy (LESSONS 64):

* ``temperature: 0`` is the model's argmax with only the penalties the request itself asks for: a
  default repetition penalty (the settings' or the model's) is not applied to a greedy request.
  Coding agents copy (an edit tool's ``old_string`` must reproduce the file byte for byte), and a
  hidden penalty pushes the model away from exactly the tokens it should copy; OpenAI's and
  Anthropic's APIs apply none, vLLM and llama.cpp default to none.
* a configured repetition penalty looks at the reply's own tokens (``REPETITION_PENALTY_SCOPE=
  reply``, the default), not the prompt's: it breaks a reply's loops without steering the model
  off text it was asked to reproduce. ``all`` penalises prompt and reply, as mlx-lm does.

``frequency_penalty`` / ``presence_penalty`` are OpenAI's: over the tokens generated so far, never
a default. ``origin`` says, per field, where each value came from ("request", "generation_config",
"settings", or "greedy" for a default penalty a greedy request did not get): the request log and
/v1/cache/stats show it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["SamplingDefaults", "FIELDS", "from_generation_config"]

# field -> (settings attribute, generation_config key, type)
FIELDS: dict[str, tuple[str, str, type]] = {
    "temperature": ("default_temperature", "temperature", float),
    "top_p": ("default_top_p", "top_p", float),
    "top_k": ("default_top_k", "top_k", int),
    "min_p": ("default_min_p", "min_p", float),
    "repetition_penalty": ("default_repetition_penalty", "repetition_penalty", float),
}
_LIMITS = {"temperature": (0.0, 5.0), "top_p": (0.0, 1.0), "top_k": (0, 1 << 31), "min_p": (0.0, 1.0),
           "repetition_penalty": (0.0, 10.0)}


def from_generation_config(config: Mapping[str, Any] | None) -> dict[str, float | int]:
    """The sampling values a model's ``generation_config.json`` ships (those we serve, in range),
    as Hugging Face writes them. ``do_sample: false`` means greedy: temperature 0. A value of the
    wrong type or out of range is left out (the settings answer for it)."""
    if not isinstance(config, Mapping):
        return {}
    out: dict[str, float | int] = {}
    for name, (_, key, kind) in FIELDS.items():
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        lo, hi = _LIMITS[name]
        if kind is int and float(value) != int(value):
            continue
        if lo <= value <= hi:
            out[name] = kind(value)
    if config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


@dataclass(frozen=True)
class SamplingDefaults:
    """The values a request falls back to, each with where it came from."""
    values: Mapping[str, float | int]
    origin: Mapping[str, str]                 # field -> "generation_config" | "settings"
    repetition_context_size: int = 256
    penalty_scope: str = "reply"              # REPETITION_PENALTY_SCOPE: reply | all
    model_file: Mapping[str, float | int] = field(default_factory=dict)   # what the model's file said

    @classmethod
    def resolve(cls, settings: Any, generation_config: Mapping[str, Any] | None = None) -> "SamplingDefaults":
        """The model's file over the settings (``GENERATION_CONFIG=off``: the settings alone)."""
        model = from_generation_config(generation_config) if getattr(settings, "generation_config", "auto") != "off" else {}
        values: dict[str, float | int] = {}
        origin: dict[str, str] = {}
        for name, (attr, _, kind) in FIELDS.items():
            if name in model:
                values[name], origin[name] = model[name], "generation_config"
            else:
                values[name], origin[name] = kind(getattr(settings, attr)), "settings"
        return cls(values, origin, int(settings.default_repetition_context_size),
                   getattr(settings, "repetition_penalty_scope", "reply"), model)

    def for_request(self, given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """(values, origin) for a request whose own (validated) fields are ``given`` (only those it
        sent): its fields, else the defaults; a greedy request gets no default repetition penalty."""
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for name in FIELDS:
            if given.get(name) is not None:
                values[name], origin[name] = given[name], "request"
            else:
                values[name], origin[name] = self.values[name], self.origin[name]
        if values["temperature"] <= 0 and origin["repetition_penalty"] != "request" \
                and values["repetition_penalty"] != 1.0:
            values["repetition_penalty"], origin["repetition_penalty"] = 1.0, "greedy"
        return values, origin

    def describe(self) -> dict:
        """For /v1/cache/stats: each default, where it came from, and the two rules."""
        return {"defaults": {name: {"value": self.values[name], "from": self.origin[name]} for name in FIELDS},
                "generation_config": dict(self.model_file),
                "repetition_penalty_scope": self.penalty_scope,
                "repetition_context_size": self.repetition_context_size,
                "greedy": "temperature 0 is the argmax with only the penalties the request names"}
