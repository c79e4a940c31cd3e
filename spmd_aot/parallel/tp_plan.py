"""A tensor-parallel plan as text: style names, which dimension of each parameter a style
splits, transformers' style names, and binding a plan to a model's module names.

Names and arithmetic only, so the plan value (``plan.py``) can validate a ``tp_plan`` and lay
out parameters without importing the styles' forwards and autograd functions
(``tensor_parallel.py``, whose style classes read ``SPLIT_DIMS`` for their own names).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import TYPE_CHECKING

from ..errors import SpmdAotError, UnsupportedError

if TYPE_CHECKING:  # annotations only: this module stays free of torch at import
    from torch import nn

__all__ = ["SPLIT_DIMS", "STYLE_NAMES", "style_name", "resolve_tp_plan", "first_match", "split_dim",
           "MODEL_PLAN_NAMES", "HF_STYLE_NAMES", "HF_REFUSED_STYLES"]

log = logging.getLogger(__name__)
_WARNED: set = set()  # (model class, skipped patterns) already logged by ``resolve_tp_plan``

#: style name -> parameter of the module -> tensor dimension split over the TP ranks (None:
#: whole on every TP rank); in the order the styles are documented (``tensor_parallel.py``).
SPLIT_DIMS: dict[str, dict[str, int | None]] = {
    "colwise": {"weight": 0, "bias": 0},
    "rowwise": {"weight": 1, "bias": None},
    "colwise_seq": {"weight": 0, "bias": 0},
    "rowwise_seq": {"weight": 1, "bias": None},
    "sequence_parallel": {"weight": None, "bias": None},
    "seq_shard_output": {},
    "seq_gather_input": {},
    "colwise_gather_output": {"weight": 0, "bias": 0},
    "rowwise_split_input": {"weight": 1, "bias": None},
    "embedding_colwise": {"weight": 1},
    "embedding_rowwise": {"weight": 0},
    "replicated_with_grad_allreduce": {},
}
STYLE_NAMES = tuple(SPLIT_DIMS)


# transformers' style names (``config.base_model_tp_plan``, ``model._tp_plan``): the same style
# under another name, or why it is refused and what to use instead.
HF_STYLE_NAMES = {"colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}
_LOCAL = ("leaves parameters as shards that the model's own code combines, which spmd-aot cannot see; "
          "plan the linears 'colwise'/'rowwise'")
HF_REFUSED_STYLES = {
    "packed_colwise": "splits a packed projection part by part; plan it 'colwise_gather_output' "
                      "(and its reader 'rowwise_split_input'), or leave it out",
    "packed_rowwise": "splits a packed projection part by part; plan it 'rowwise_split_input', or leave it out",
    "moe_tp_experts": "is expert parallelism, not supported yet; leave the experts out of the plan",
    "grouped_gemm": "is expert parallelism, not supported yet; leave the experts out of the plan",
    "ep_router": "is expert parallelism, not supported yet; leave the router out of the plan",
    "mla_kv_a_proj": ("is not supported yet; leave the module out of the plan: pass a dict, the model's "
                      "config.base_model_tp_plan without this pattern (and without patterns the model lacks), "
                      "and the projection stays whole on every TP rank"),
    "local_params": _LOCAL, "local": _LOCAL, "local_colwise": _LOCAL, "local_rowwise": _LOCAL,
    "local_packed_rowwise": _LOCAL, "gather": _LOCAL, "isolated": _LOCAL,
    "unit_colwise": "is not supported yet; plan the module 'colwise'",
    "unit_rowwise": "is not supported yet; plan the module 'rowwise'",
    "all_reduce": "all_reduces an output the module computed from local shards; plan its linears 'rowwise'",
    "replicate": "keeps parameters whole: leave the module out of the plan (unplanned parameters are whole "
                 "on every TP rank)",
}


def style_name(pattern: str, style) -> str:
    """``style`` as spmd-aot names it (transformers' names mapped), or an error saying what to use."""
    name = HF_STYLE_NAMES.get(style, style) if isinstance(style, str) else style
    if name in SPLIT_DIMS:
        return name
    if style in HF_REFUSED_STYLES:
        raise SpmdAotError(f"tp_plan[{pattern!r}] is transformers' style {style!r}, which spmd-aot refuses: it "
                           f"{HF_REFUSED_STYLES[style]}")
    raise SpmdAotError(f"tp_plan[{pattern!r}] is {style!r}; expected one of: {', '.join(SPLIT_DIMS)} "
                       f"(or transformers' {', '.join(HF_STYLE_NAMES)})")


#: ``tp_plan`` values that mean "the model's own plan": transformers' ``config.base_model_tp_plan``.
MODEL_PLAN_NAMES = ("hf", "auto")


def resolve_tp_plan(tp_plan, model: nn.Module, skipped: list | None = None) -> tuple[tuple[str, str], ...]:
    """``tp_plan`` bound to ``model``: ``"hf"``/``"auto"`` replaced by the model's own plan, and
    patterns written relative to a transformers base model (``layers.*.self_attn.q_proj``, as
    ``config.base_model_tp_plan`` has them) prefixed with ``model.base_model_prefix`` when they
    match no module as written but do under the prefix.

    The model's own plan is written for an architecture, not for this instance: an MoE's plan
    can name the dense MLP's projections (``layers.*.mlp.gate_proj``) that its sparse layers
    replace with experts, and a config can drop optional modules. As transformers does, its
    patterns that match no module are dropped with a warning naming them (and appended to
    ``skipped``, which the build records in its stats). A plan the user wrote keeps every
    pattern: one that matches nothing is refused later (``planned_modules``), since a typo
    would otherwise leave a layer whole on every rank without a word."""
    fqns = [fqn for fqn, _ in model.named_modules()]
    prefix = getattr(model, "base_model_prefix", "")

    def bound(pattern: str) -> str | None:
        """``pattern`` as it matches ``model``'s module names; None when it matches none."""
        if any(fnmatch.fnmatchcase(f, pattern) for f in fqns):
            return pattern
        prefixed = f"{prefix}.{pattern}" if prefix else None
        if prefixed and any(fnmatch.fnmatchcase(f, prefixed) for f in fqns):
            return prefixed
        return None

    if isinstance(tp_plan, str):
        config = getattr(model, "config", None)
        own = getattr(config, "base_model_tp_plan", None)
        if not own:
            raise UnsupportedError(
                f"tp_plan={tp_plan!r} takes the model's own plan (transformers' config.base_model_tp_plan), "
                f"but {type(model).__qualname__} has none; pass tp_plan={{PATTERN: STYLE, ...}}")
        resolved, unmatched = [], []
        for pattern, style in own.items():
            where = bound(pattern)
            if where is None:
                unmatched.append(pattern)
            else:  # styles are checked only for modules the model has, as transformers applies them
                resolved.append((where, style_name(pattern, style)))
        said = (type(model).__qualname__, tuple(unmatched))
        if unmatched and said not in _WARNED:  # once per process: every job start binds the plan again
            _WARNED.add(said)
            log.warning("tp_plan=%r: %s's own plan names module(s) it does not have, skipped (transformers "
                        "skips them too): %s", tp_plan, type(model).__qualname__, ", ".join(unmatched))
        if unmatched and skipped is not None:
            skipped.extend(unmatched)
        if not resolved:
            raise UnsupportedError(
                f"tp_plan={tp_plan!r}: none of the patterns of {type(model).__qualname__}'s own plan "
                f"(config.base_model_tp_plan: {', '.join(own)}) matches a module of the model; pass "
                "tp_plan={PATTERN: STYLE, ...} naming its modules (see model.named_modules())")
        return tuple(resolved)
    return tuple((bound(pattern) or pattern, style) for pattern, style in tp_plan)


def first_match(tp_plan, fqn: str) -> tuple[str, str] | None:
    """The (pattern, style name) pair of ``tp_plan`` that module ``fqn`` takes (first match wins)."""
    for pattern, name in tp_plan:
        if fnmatch.fnmatchcase(fqn, pattern):
            return pattern, name
    return None


def split_dim(tp_plan, param_fqn: str) -> tuple[str, int | None] | None:
    """(style name, tensor dimension split over TP or None) of parameter ``param_fqn`` under
    ``tp_plan``, from the style of the module that owns it; None when that module is unplanned."""
    owner, _, name = param_fqn.rpartition(".")
    match = first_match(tp_plan, owner)
    return (match[1], SPLIT_DIMS[match[1]].get(name)) if match else None
