"""The build-time refusal of code that reads tensor values on the host (``.item()``,
``bool(tensor)``, ``nonzero``, ``torch.amp.GradScaler``'s skip decision).

A stored step is one graph run without host synchronisation, traced on fake tensors that hold
no values, so control flow or output shapes that depend on values cannot be traced. Fake
tensors raise deep inside torch; ``describe`` turns that into which user line made the call.
"""

from __future__ import annotations

import os
import sysconfig
import traceback

import torch

__all__ = ["describe"]

_KINDS = {  # exception type name -> what the user wrote
    "DataDependentOutputException": "reads a tensor's value on the host (`.item()`, `float(t)`, `bool(t)`, `if t:`)",
    "GuardOnDataDependentSymNode": "branches on a tensor's value (`bool(t)`, `if t:`, `.item()` in a condition)",
    "DynamicOutputShapeException": "makes a tensor whose shape depends on values (`nonzero`, boolean-mask "
                                   "indexing, `torch.unique`, `masked_select`)",
}
_LIBRARY_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__))) + \
    (sysconfig.get_paths()["stdlib"] + os.sep,)


def describe(exc: BaseException, module: str = "") -> str | None:
    """The refusal for a data-dependent operation, or None when ``exc`` is not one.
    ``module``: which module's forward was running (", in module ..."), if any."""
    kind = next((k for k in _KINDS if any(c.__name__ == k for c in type(exc).__mro__)), None)
    if kind is None:
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    user = [i for i, f in enumerate(frames) if _is_user(f.filename)]
    where = ""
    if user:
        f = frames[user[-1]]
        where = f" at {f.filename}:{f.lineno} `{(f.line or '').strip()}`"
    scaler = any(f.filename.endswith(os.path.join("amp", "grad_scaler.py")) for f in frames)
    advice = ("torch.amp.GradScaler decides whether to skip the optimizer step with `found_inf.item()`; "
              "train with bf16 autocast instead (it needs no loss scaling), or call the scaler outside "
              "the compiled step" if scaler else
              "keep it a tensor operation (`torch.where`, multiplying by a mask, `clamp`), or move it "
              "out of the compiled step")
    return (f"the step {_KINDS[kind]}{where}{module} ({type(exc).__name__}: {_op(exc)}): a compiled step "
            f"is one graph run without host synchronisation, traced without tensor values, so its "
            f"control flow and shapes cannot depend on values; {advice}")


def _is_user(filename: str) -> bool:
    return not filename.startswith("<") and not filename.startswith(_LIBRARY_DIRS)


def _op(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
