"""``MixedPrecisionPolicy``: which dtypes a step computes, reduces and returns in.

The same four fields, and the same meaning, as FSDP2's
``torch.distributed.fsdp.MixedPrecisionPolicy``, under both placements:

- ``param_dtype``: parameters are cast to it for compute (under ``shard`` each shard is cast
  before the all_gather, so the gather moves ``param_dtype`` bytes); floating-point forward
  inputs are cast to it when ``cast_forward_inputs``. The parameters the optimizer updates
  (its *master* weights) stay in their own dtype, fp32 for an fp32 model.
- ``reduce_dtype``: gradients are averaged in it (all_reduce under ``replicate``, reduce_scatter
  under ``shard``) and then cast to the parameter's dtype, so the optimizer steps in fp32.
  ``None`` reduces in ``param_dtype``, as FSDP2 and DDP's ``_MixedPrecision`` do.
- ``output_dtype``: floating-point outputs of the model (and of each ``shard`` block, as each
  ``fully_shard`` module casts its own) are cast to it.

A pure value (names and dtypes): the casts themselves are traced where parameters become compute
tensors (``expand.py``, ``groups.py``) and around module forwards (``casts.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from ..errors import SpmdAotError

__all__ = ["MixedPrecisionPolicy", "DTYPES"]

# the dtypes a policy may name, by the short names the CLI and the stored plan use
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def _dtype(field: str, value) -> torch.dtype | None:
    """``value`` (a torch dtype, a short name or None) as a dtype, checked."""
    if value is None or isinstance(value, torch.dtype) and value in _NAMES:
        return value
    if isinstance(value, str) and _ALIASES.get(value, value) in DTYPES:
        return DTYPES[_ALIASES.get(value, value)]
    raise SpmdAotError(f"mixed precision {field}={value!r}: expected one of {', '.join(DTYPES)} "
                       "(or torch.bfloat16, torch.float16, torch.float32), or None to leave it as is")


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's policy (see the module docstring); ``MixedPrecisionPolicy()`` changes nothing."""

    param_dtype: torch.dtype | str | None = None
    reduce_dtype: torch.dtype | str | None = None
    output_dtype: torch.dtype | str | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for field in _FIELDS[:3]:
            object.__setattr__(self, field, _dtype(field, getattr(self, field)))
        if not isinstance(self.cast_forward_inputs, bool):
            raise SpmdAotError(f"mixed precision cast_forward_inputs must be True or False, "
                               f"got {self.cast_forward_inputs!r}")
        if self.reduce_dtype is torch.float16 or (self.reduce_dtype is None and self.param_dtype is torch.float16):
            raise SpmdAotError(
                "mixed precision: gradients reduced in fp16 need FSDP2's pre/post-division against overflow, "
                "which spmd-aot does not do; set reduce_dtype to bf16 or fp32 (e.g. --reduce-dtype fp32)")

    @classmethod
    def of(cls, value) -> MixedPrecisionPolicy | None:
        """A policy from ours, torch's FSDP2 one (same fields) or a mapping; None or a policy that
        changes nothing gives None, so such a plan is the plan without one (same key)."""
        if value is None:
            return None
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(_FIELDS))
            if unknown:
                raise SpmdAotError(f"mixed precision: unknown field(s) {', '.join(unknown)}; "
                                   f"a policy has {', '.join(_FIELDS)}")
            value = cls(**value)
        elif not isinstance(value, cls):
            if not all(hasattr(value, f) for f in _FIELDS):
                raise SpmdAotError(f"mixed_precision must be a spmd_aot.MixedPrecisionPolicy (or torch's FSDP2 "
                                   f"MixedPrecisionPolicy), got {type(value).__name__}")
            value = cls(**{f: getattr(value, f) for f in _FIELDS})
        return value if value.active else None

    @property
    def active(self) -> bool:
        """Whether the policy casts anything."""
        return any(getattr(self, f) is not None for f in _FIELDS[:3])

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What a parameter (or forward input) of ``dtype`` computes in."""
        return self.param_dtype if self.param_dtype is not None and dtype.is_floating_point else dtype

    def gradient_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What the gradient of a parameter of ``dtype`` is averaged in."""
        if not dtype.is_floating_point:
            return dtype
        return self.reduce_dtype or self.param_dtype or dtype

    def to_dict(self) -> dict:
        """The text form stored in the plan, hashed into the key and printed by ``show``."""
        return {"param_dtype": _NAMES.get(self.param_dtype), "reduce_dtype": _NAMES.get(self.reduce_dtype),
                "output_dtype": _NAMES.get(self.output_dtype), "cast_forward_inputs": self.cast_forward_inputs}

    @classmethod
    def from_dict(cls, d) -> MixedPrecisionPolicy:
        if not isinstance(d, Mapping) or set(d) != set(_FIELDS):
            raise SpmdAotError(f"a mixed precision policy has exactly the fields {', '.join(_FIELDS)}")
        return cls(**d)

    def describe(self) -> str:
        """``mp=bf16/fp32`` (compute / reduce), ``+out=fp32`` when outputs are cast."""
        text = f"mp={_NAMES.get(self.param_dtype, '-')}/{_NAMES.get(self.gradient_dtype(torch.float32), '-')}"
        text += f"+out={_NAMES[self.output_dtype]}" if self.output_dtype is not None else ""
        return text + ("" if self.cast_forward_inputs else "+uncast-inputs")
