"""``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` given a mask and no ``is_causal``, traced.

Why: those modules ask ``torch.nn.modules.transformer._detect_is_causal_mask`` whether the mask
is the causal one, which compares its values on the host (``bool((mask == causal).all())``). A
traced step holds no values, so the question has no answer and tracing fails, although the
answer changes no result: it is a hint that lets the layers call attention with ``is_causal=True``
instead of the mask, and torch documents that ``False`` for a mask that is in fact causal "may
lead to reduced performance" only. So while tracing, a mask with no hint is answered ``False``:
the layers apply the mask as given, which computes what eager computes with either answer (to
rounding: the causal kernel and the masked one agree to ~1e-7). An explicit ``is_causal`` is
passed through untouched, so users who want the causal kernel keep it.
"""

from __future__ import annotations

import contextlib

from torch.nn.modules import transformer

__all__ = ["masks_used_as_given"]


def _as_given(mask, is_causal=None, size=None) -> bool:
    """``_detect_is_causal_mask`` without reading the mask: the hint when given, else False."""
    return is_causal is True


@contextlib.contextmanager
def masks_used_as_given():
    """While active, torch's transformer modules use an unhinted mask as given (see the module doc)."""
    saved = transformer._detect_is_causal_mask
    transformer._detect_is_causal_mask = _as_given
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = saved
