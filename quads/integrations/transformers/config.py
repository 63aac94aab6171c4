"""``QuadsConfig``: a transformers quantization config (``quant_method="quads"``) carrying one
side's :class:`~quads.QuadsPolicy`.

``config.json``'s ``quantization_config`` holds it as plain JSON::

    {"quant_method": "quads", "format_version": 1, "policy": {"side": "rollout", ...every field}}

Read back, every policy field goes through ``QuadsPolicy``'s own validation (its errors name the
field); a field this version does not know, or a newer ``format_version``, is refused by name.

A rollout's ``config.json`` also holds ``transformers_weights`` = :data:`PLAIN_LOAD_REFUSAL`:
transformers (5.x) refuses a ``transformers_weights`` that names no safetensors file, in one
line quoting it, before it builds the model; so a ``from_pretrained`` without quads' quantizer
(quads never imported, or ``quantization_config=None``) fails with that line instead of loading
the packed weights as missing, randomly initialised ones. quads' quantizer removes it first.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from quads.policies.policy import QuadsPolicy

__all__ = ["QuadsConfig", "FORMAT_VERSION", "PLAIN_LOAD_REFUSAL", "QUANT_METHOD", "policy_to_json",
           "policy_from_json"]

QUANT_METHOD = "quads"
#: the checkpoint layout this version writes and reads (see docs/ecosystem.md)
FORMAT_VERSION = 1
_POLICY_FIELDS = tuple(f.name for f in fields(QuadsPolicy))
#: a rollout's ``config.json`` ``transformers_weights`` (module doc): the line a load without quads ends with
PLAIN_LOAD_REFUSAL = ("quads NVFP4 rollout: model.safetensors holds packed weights that load only through quads; "
                      "import quads before from_pretrained (and pass no quantization_config=None)")


def policy_to_json(policy: QuadsPolicy) -> dict[str, Any]:
    """Every field of ``policy`` as plain JSON values (patterns as lists)."""
    out = {}
    for name in _POLICY_FIELDS:
        value = getattr(policy, name)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def policy_from_json(data: Any, what: str = "quantization_config.policy") -> QuadsPolicy:
    """The policy :func:`policy_to_json` wrote; unknown fields refused by name, values validated
    by ``QuadsPolicy`` (its errors name the field)."""
    if isinstance(data, QuadsPolicy):
        return data
    if not isinstance(data, dict):
        raise TypeError(f"{what} must be a JSON object of QuadsPolicy fields, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_POLICY_FIELDS))
    if unknown:
        raise ValueError(f"{what}: field {unknown[0]!r} is unknown to this quads version (QuadsPolicy has "
                         f"{', '.join(_POLICY_FIELDS)}); the checkpoint needs a newer quads")
    if "side" not in data:
        raise ValueError(f"{what}: no 'side' (\"trainer\" or \"rollout\")")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return QuadsPolicy(**values)


class QuadsConfig(QuantizationConfigMixin):
    """``from_pretrained(path, quantization_config=QuadsConfig(policy))`` quantizes a plain
    checkpoint at load (the model ``quads.quantize_(model, policy)`` gives); a quads checkpoint
    (``save_pretrained`` of a quads model) carries one in ``config.json`` and loads back as the
    quads model it was, with no argument."""

    def __init__(self, policy: QuadsPolicy | dict | None = None, format_version: int = FORMAT_VERSION,
                 quant_method: str = QUANT_METHOD, **kwargs):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"QuadsConfig: quant_method must be {QUANT_METHOD!r}, got {quant_method!r}")
        if kwargs:
            raise ValueError(f"QuadsConfig: unknown entry {sorted(kwargs)[0]!r} in quantization_config "
                             f"(this quads version reads quant_method, format_version, policy)")
        if isinstance(format_version, bool) or not isinstance(format_version, int) or format_version < 1:
            raise ValueError(f"QuadsConfig: format_version must be a positive int, got {format_version!r}")
        if format_version > FORMAT_VERSION:
            raise ValueError(f"QuadsConfig: format_version {format_version} is newer than this quads reads "
                             f"({FORMAT_VERSION}); upgrade quads to load this checkpoint")
        if policy is None:
            raise TypeError("QuadsConfig needs a policy: QuadsConfig(quads.QuadsPolicy(side='trainer' or 'rollout'))")
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.policy = policy_from_json(policy)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "format_version": self.format_version,
                "policy": policy_to_json(self.policy)}

    def __iter__(self):
        yield from self.to_dict().items()

    def __eq__(self, other) -> bool:
        return isinstance(other, QuadsConfig) and other.to_dict() == self.to_dict()

    __hash__ = None
