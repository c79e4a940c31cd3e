"""The build-time refusal of code that reads tensor values on the host (``.item()``,
``bool(tensor)``, ``nonzero``, boolean-mask indexing, ``torch.amp.GradScaler``'s skip decision).

A stored step is one graph run without host synchronisation, traced on fake tensors that hold
no values, so control flow or output shapes that depend on values cannot be traced. Fake
tensors raise deep inside torch; ``describe`` turns that into one line: what the user wrote
(the construct, told from torch's op and the user's source line), the user's file, line and
code, the module whose forward ran, and what to write instead, a rewrite that traces and
computes the same values.
"""

from __future__ import annotations

import inspect
import os
import re
import site
import sysconfig
import traceback

import torch

__all__ = ["describe"]

_KINDS = ("DataDependentOutputException", "GuardOnDataDependentSymNode", "DynamicOutputShapeException")
# torch, spmd-aot and the standard library: never the line to name
_TORCH_AND_OURS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__)))
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
# installed libraries (transformers, ...; site-packages may lie inside the standard library's folder):
# their line is named, and the user's own line that called into them
_INSTALLED_DIRS = tuple({os.path.join(p, "") for p in (*site.getsitepackages(), site.getusersitepackages(),
                                                       sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])})

_WHY = ("a compiled step is one graph run without host synchronisation, traced without tensor values, "
        "so its control flow and shapes cannot depend on values")

# construct -> (what the user wrote, what to write instead)
_MASK = ("keep the full shape and mask the values instead: `torch.where(mask, x, 0)`, or "
         "`(x * mask).sum() / mask.sum()` for a mean over the selected entries")
_LOSS = ("let the loss skip the ignored labels itself: `F.cross_entropy(logits, labels, ignore_index=-100)` "
         "(it averages over the kept labels, at a static shape); otherwise ")
_BRANCH_FIX = ("compute both branches and select with `torch.where(cond, a, b)` (`cond` a bool tensor), or "
               "check the value outside the compiled step, on what the step returns")
_CONSTRUCTS = {
    "scaler": ("calls torch.amp.GradScaler, whose `step` decides whether to skip the optimizer step with "
               "`found_inf.item()`",
               "train with bf16 autocast instead (it needs no loss scaling), or call the scaler outside "
               "the compiled step"),
    "nonfinite_clip": ("calls `clip_grad_norm_(..., error_if_nonfinite=True)`, which raises on a non-finite "
                       "total norm by reading it on the host",
                       "drop `error_if_nonfinite` and check what the step returns: return the norm "
                       "`clip_grad_norm_` gives and test `torch.isfinite(norm)` after the step"),
    "averaged_model": ("calls `AveragedModel.update_parameters`, which branches on its `n_averaged` counter "
                       "on the host",
                       "call `update_parameters` after the compiled step returns, or update the average "
                       "under `torch.no_grad()` in the step: `torch._foreach_lerp_(list(avg.parameters()), "
                       "list(model.parameters()), 1 - decay)` is what `get_ema_multi_avg_fn(decay)` computes "
                       "after its first update"),
    "nonzero": ("calls `nonzero()` (its result has one row per nonzero value)", _MASK),
    "bool_index": ("indexes with a boolean mask (`x[mask]`: one element per True value)", _MASK),
    "masked_select": ("calls `masked_select` (one element per True value)", _MASK),
    "unique": ("calls `torch.unique` (one element per distinct value)",
               "work at the static size of the n possible values instead: `F.one_hot(x, n).amax(0)` says "
               "which occur, `F.one_hot(x, n).sum(0)` counts them"),
    "repeat_interleave": ("calls `repeat_interleave` with tensor repeats (its length is their sum)",
                          "repeat a fixed number of times (`repeats` a Python int), or repeat up to the largest "
                          "count and mask the rest: `torch.where(mask, x, 0)`"),
    "shape": ("makes a tensor whose shape depends on values", _MASK),
    "equal": ("calls `torch.equal` (a Python bool made from the values)",
              "compare as a tensor: `~(a != b).any()` is a bool tensor, True where `torch.equal(a, b)` is, to use "
              "in arithmetic or `torch.where(cond, a, b)`"),
    "assert": ("asserts on a tensor's value (`assert t`)",
               "check the value outside the compiled step, on what the step returns, or remove the "
               "assert from the step"),
    "branch": ("branches on a tensor's value (`if t:`, `while t:`, `bool(t)`, `x if t else y`)", _BRANCH_FIX),
    "read": ("reads a tensor's value on the host (`.item()`, `float(t)`, `int(t)`, `.tolist()`)",
             "keep it a 0-dim tensor and compute with it (`loss * n`, not `loss * n.item()`); to log it, return "
             "the tensor from the step and call `.item()` on what the step returns"),
}
_LOSS_LINE = re.compile(r"cross_entropy|nll_loss|ignore_index|-100|label", re.IGNORECASE)


def describe(exc: BaseException, module: str = "") -> str | None:
    """The one-line refusal for a data-dependent operation, or None when ``exc`` is not one.
    ``module``: which module's forward was running (", in module ..."), if any."""
    kind = next((k for k in _KINDS if any(c.__name__ == k for c in type(exc).__mro__)), None)
    if kind is None:
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    op = _op(exc)
    user = next((f for f in reversed(frames) if _is_user(f.filename)), None)
    line = (user.line or "").strip() if user else ""
    construct = _construct(kind, op, line, frames)
    wrote, fix = _CONSTRUCTS[construct]
    if construct in ("nonzero", "bool_index", "masked_select") and _LOSS_LINE.search(_function_source(exc, user)):
        fix = _LOSS + fix
    if user is not None and user.filename.startswith(_INSTALLED_DIRS):  # not the user's line to rewrite
        fix = _library_fix(user.filename, line, _function_source(exc, user)) + f"; in code you write: {fix}"
    return f"the step {wrote}{_where(frames, user)}{module} ({type(exc).__name__}: {op}): {_WHY}; {fix}"


# transformers' CTC heads (Wav2Vec2, HuBERT, WavLM, ...ForCTC) check their labels on the host, then
# compute CTC, whose kernel indexes with label values it does not bound: no load may admit it
_CTC_CHECK = re.compile(r"labels\.max\(\)\s*>=\s*self\.config\.vocab_size")
_CTC_FIX = ("the line is transformers' label check of a CTC head (`...ForCTC(labels=...)`): CTC loss is not "
            "admitted in a stored graph (torch's CTC kernel indexes with label values it does not bound); "
            "compile a step with a loss of static shapes (the model without `labels`, its logits into "
            "`F.cross_entropy` per frame, or a `...ForSequenceClassification` head; with `layerdrop=0.0` in its "
            "config), or run the CTC step eagerly")
# transformers' LayerDrop (speech encoders: Wav2Vec2, HuBERT, WavLM, Whisper) draws on the host
# whether to skip each layer
_LAYERDROP = re.compile(r"skip_the_layer|layerdrop")
_LAYERDROP_FIX = ("the line is transformers' LayerDrop, which draws on the host whether to skip each layer while "
                  "training: set `layerdrop=0.0` in the model's config (`from_pretrained(..., layerdrop=0.0)`)")


def _library_fix(filename: str, line: str, source: str) -> str:
    """What to do when the line is an installed library's (``source``: the function holding it)."""
    transformers = f"{os.sep}transformers{os.sep}" in filename
    if transformers and _CTC_CHECK.search(line):
        return _CTC_FIX
    if transformers and _LAYERDROP.search(line):
        return _LAYERDROP_FIX
    moe = (" (transformers' mixture-of-experts models: their default `experts_implementation`, `grouped_mm`, "
           "or `\"batched_mm\"` in their config)"
           if transformers and "expert" in source.lower() else "")
    return (f"the line is in an installed library: choose its static-shape option where it has one{moe}, or "
            "swap the module for a stand-in that computes the same with static shapes while tracing "
            "(`spmd_aot.Override`)")


def _construct(kind: str, op: str, line: str, frames) -> str:
    """Which construct of ``_CONSTRUCTS`` the user wrote: from torch's op and the user's line."""
    if any(f.filename.endswith(os.path.join("amp", "grad_scaler.py")) for f in frames):
        return "scaler"
    if any(f.filename.endswith(os.path.join("nn", "utils", "clip_grad.py")) for f in frames):
        return "nonfinite_clip"
    if any(f.filename.endswith(os.path.join("optim", "swa_utils.py")) for f in frames):
        return "averaged_model"
    if kind == "DynamicOutputShapeException":
        if "nonzero" in op or "argwhere" in op:
            return "nonzero" if re.search(r"nonzero\(|argwhere\(|where\(", line) else "bool_index"
        if "masked_select" in op:
            return "masked_select"
        if "repeat_interleave" in op:
            return "repeat_interleave"
        return "unique" if "unique" in op else "shape"
    if "aten.equal" in op and not re.match(r"(if|elif|while|assert)\b", line):
        return "equal"
    if re.match(r"assert\b", line):
        return "assert"
    if re.match(r"(if|elif|while)\b", line) or re.search(r"\bif\b.+\belse\b", line) or \
            kind == "GuardOnDataDependentSymNode":
        return "branch"
    return "read"


def _function_source(exc: BaseException, user) -> str:
    """The source of the function holding the user's line (that line alone when it cannot be read):
    whether it computes a loss over labels decides which rewrite to name first."""
    line = (user.line or "") if user else ""
    tb = exc.__traceback__
    while tb is not None and user is not None:
        code = tb.tb_frame.f_code
        if code.co_filename == user.filename and tb.tb_lineno == user.lineno:
            try:
                return "".join(inspect.getsourcelines(code)[0])
            except (OSError, TypeError):
                return line
        tb = tb.tb_next
    return line


def _where(frames, user) -> str:
    """`` at FILE:LINE `code` ``; for a line in an installed library, also the user's own line
    that called into it."""
    if user is None:
        return ""
    where = f" at {user.filename}:{user.lineno} `{(user.line or '').strip()}`"
    if user.filename.startswith(_INSTALLED_DIRS):
        own = next((f for f in reversed(frames) if _is_user(f.filename) and not f.filename.startswith(_INSTALLED_DIRS)),
                   None)
        if own is not None:
            where += f" (called from {own.filename}:{own.lineno} `{(own.line or '').strip()}`)"
    return where


def _is_user(filename: str) -> bool:
    """Code outside torch, spmd-aot and the standard library: the user's or an installed library's."""
    if filename.startswith("<") or filename.startswith(_TORCH_AND_OURS):
        return False
    return not filename.startswith(_STDLIB) or filename.startswith(_INSTALLED_DIRS)


def _op(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
