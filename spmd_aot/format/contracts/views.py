"""Contracts of the views that reinterpret memory: ``as_strided`` (a view from raw sizes, strides
and an offset) and the complex views of rotary embeddings (``view_as_complex``,
``view_as_real``), plus ``polar``, which builds the complex rotations they multiply by.

Why these can be admitted: with static shapes, everything such a view can reach is known from
its arguments and its input's storage, both fixed by the artifact's layout. ``as_strided`` is
safe exactly when the last element it addresses, ``offset + sum((size - 1) * stride)`` (nothing
when a size is 0), lies inside its input's storage and no number is negative; the complex views
are safe when the pairs they reinterpret line up (a last dimension of 2 values with stride 1,
even strides and offset elsewhere) and the dtypes pair up. Torch's CPU kernels check these too;
the contract states them so a load refuses a graph that breaks them, naming the node, before
anything runs, and so the same rule holds on every device.
"""

from __future__ import annotations

import math

import torch

from .rules import Args, _broadcast, _ints, _need, _shape, _wrap

#: Real dtype -> the complex dtype whose values are pairs of it (torch has no bf16 complex).
COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}
REAL_OF = {c: r for r, c in COMPLEX_OF.items()}

#: Sizes, strides and offsets are at most this (the layout's own bound on sizes): sums and
#: products of them stay far from int64 overflow in the kernels that use them.
_LIMIT = 1 << 48


def strided_view(a: Args) -> None:
    """``as_strided(self, size, stride, storage_offset)``: one stride per size, every number in
    ``[0, 2**48)``, the element count below ``2**62``, and the view's extent inside ``self``'s
    storage (a view with a size 0 reaches no element; its offset must still lie in the storage)."""
    x = a.tensor("self")
    size, stride = _ints(a.get("size"), "size"), _ints(a.get("stride"), "stride")
    _need(len(size) == len(stride), "stride", f"= {stride} must have one value per size {size}")
    _need(len(size) <= 64, "size", f"has {len(size)} dimensions, more than 64")
    for name, values in (("size", size), ("stride", stride)):
        _need(all(0 <= v < _LIMIT for v in values), name, f"= {values} must hold values in [0, 2**48)")
    _need(math.prod(max(n, 1) for n in size) < 1 << 62, "size", f"= {size} has too many elements")
    offset = a.get("storage_offset")
    if offset is None:
        offset = x.storage_offset()
    _need(isinstance(offset, int) and not isinstance(offset, bool) and 0 <= offset < _LIMIT, "storage_offset",
          f"= {offset!r} must be an int in [0, 2**48)")
    itemsize, storage = x.element_size(), x.untyped_storage().nbytes()
    end = offset if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    _need(end * itemsize <= storage, "stride",
          f"makes a view of shape {size}, strides {stride}, offset {offset} that reaches byte {end * itemsize} "
          f"of a {storage}-byte storage (self's)")


#: The most tensors one splitting op may return: each is an object built and checked per call,
#: so a count taken from a (stride-0, huge) size would be unbounded work for a few bytes of graph.
MAX_RESULTS = 1 << 16


def split_views(a: Args, *, kind: str) -> None:
    """``unbind``, ``split`` and ``chunk``: ``dim`` names a dimension of ``self``, and the views
    they return number at most ``MAX_RESULTS`` (``self.shape[dim]`` for ``unbind``,
    ``ceil(size / split_size)`` for ``split``, at most ``chunks`` for ``chunk``)."""
    x = a.tensor("self")
    d = _wrap(a.get("dim"), x.dim(), "dim")
    n = x.shape[d] if x.dim() else 1
    if kind == "unbind":
        count, what = n, f"self.shape[{d}] = {n}"
    elif kind == "split":
        size = a.get("split_size")
        _need(isinstance(size, int) and (size > 0 or (size == 0 and n == 0)), "split_size",
              f"= {size!r} must be positive")
        count, what = (-(-n // size) if size else 1), f"ceil({n} / {size})"
    else:
        chunks = a.get("chunks")
        _need(isinstance(chunks, int) and chunks > 0, "chunks", f"= {chunks!r} must be positive")
        count, what = min(chunks, max(n, 1)), f"min(chunks, {n})"
    _need(count <= MAX_RESULTS, "dim" if kind == "unbind" else "split_size" if kind == "split" else "chunks",
          f"would make {what} views, more than {MAX_RESULTS}")


def complex_view(a: Args) -> None:
    """``view_as_complex(self)``: ``self`` float16/float32/float64 (complex32/64/128 result), its
    last dimension 2 values with stride 1 (the real and imaginary part of one value), every other
    stride and the storage offset even (a complex value starts on a pair)."""
    x = a.tensor("self")
    _need(x.dtype in COMPLEX_OF, "self", f"must be float16, float32 or float64 (a complex dtype's parts), is {x.dtype}")
    _need(x.dim() >= 1 and x.shape[-1] == 2, "self", f"has shape {_shape(x)}; its last dimension must be 2 (real, imag)")
    _need(x.stride(-1) == 1, "self", f"has strides {list(x.stride())}; its last dimension must have stride 1")
    _need(all(s % 2 == 0 for s in x.stride()[:-1]), "self",
          f"has strides {list(x.stride())}; all but the last must be even (a complex value starts on a pair)")
    _need(x.storage_offset() % 2 == 0, "self", f"has storage offset {x.storage_offset()}, which must be even")


def real_view(a: Args) -> None:
    """``view_as_real(self)``: ``self`` complex32/64/128 (float16/32/64 result, one more
    dimension of 2), its conjugation resolved (a lazily conjugated view has no real layout)."""
    x = a.tensor("self")
    _need(x.dtype in REAL_OF, "self", f"must be complex32, complex64 or complex128, is {x.dtype}")
    _need(not x.is_conj(), "self", "is a lazily conjugated view; resolve it first (resolve_conj)")


def conj_view(a: Args) -> None:
    """``_conj(self)``: a complex ``self`` (torch asserts inside the op on any other dtype;
    ``conj`` calls it only for complex tensors)."""
    x = a.tensor("self")
    _need(x.dtype in REAL_OF, "self", f"must be complex32, complex64 or complex128, is {x.dtype}")


def polar(a: Args) -> None:
    """``polar(abs, angle)``: float32 or float64, one dtype, shapes that broadcast (a complex
    result of their broadcast shape)."""
    r, theta = a.tensor("abs"), a.tensor("angle")
    for name, t in (("abs", r), ("angle", theta)):
        _need(t.dtype in (torch.float32, torch.float64), name, f"must be float32 or float64, is {t.dtype}")
    _need(theta.dtype == r.dtype, "angle", f"has dtype {theta.dtype}, must be abs's {r.dtype}")
    _broadcast([r.shape, theta.shape], ["abs", "angle"])
