"""The contract of ``_c10d_functional.all_to_all_single`` (expert parallel's token exchange).

Why its own module: the op takes its split sizes as numbers a stored graph supplies, and the
process group copies ``split[i]`` rows from and to raw offsets it computes from them. Expert
parallel only ever exchanges equal, static blocks, so the contract admits exactly that: the
input contiguous with a dim 0, input and output splits the same list of equal, non-negative
sizes whose sum is dim 0 (the output then has the input's shape). c10d itself also checks the
split count against the group's size and the sums against the tensors.
"""

from __future__ import annotations

from .rules import Args, _contiguous, _ints, _need, _shape

__all__ = ["all_to_all_single"]


def all_to_all_single(a: Args) -> None:
    x = a.tensor("input")
    _contiguous(x, "input", "the process group sends its raw buffer")
    _need(x.dim() >= 1, "input", "must have a dimension 0 to exchange blocks of")
    outs, ins = _ints(a.get("output_split_sizes"), "output_split_sizes"), _ints(a.get("input_split_sizes"),
                                                                               "input_split_sizes")
    _need(len(ins) > 0 and outs == ins, "output_split_sizes",
          f"= {outs} must equal input_split_sizes = {ins} (expert parallel exchanges equal blocks)")
    _need(all(v == ins[0] and v >= 0 for v in ins), "input_split_sizes",
          f"= {ins} must be equal, non-negative sizes")
    _need(sum(ins) == x.shape[0], "input_split_sizes",
          f"= {ins} must sum to dim 0 of input {_shape(x)}")
