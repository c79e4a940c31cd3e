"""Argument contracts: what every admitted op overload's CPU and CUDA kernels assume of their arguments.

Why: a stored graph's arguments are chosen by whoever can write the cache. Torch's kernels do
not check everything they rely on (the fused optimizer steps index every state tensor with the
parameter's element count, ``native_layer_norm_backward`` reads ``mean``/``rstd`` through raw
pointers, ``max_pool2d_with_indices_backward`` writes where its ``indices`` say), and torch's
meta kernels are no bounds checks either. So an op is admitted only with a contract here, and
``validate`` checks it on the meta tensors' metadata before running the node's meta kernel:

* general rules, from the op's schema, for every op: a tensor the op writes (``a!``, ``out=``)
  has no internal overlap (no stride 0, no self-overlapping strides) and overlaps no other
  argument, except the identical tensor where the kernel is elementwise (``x.add_(x)``);
* one relation checker per op family (``checkers``, ``normalization``; ``table.CONTRACTS``: overload name -> checker), as data; a
  checker states the exact size, dtype, stride and contiguity relations between arguments;
  ``views`` holds those of the views that reinterpret memory (``as_strided``: its extent inside
  its input's storage; the complex views of rotary embeddings: pairs that line up).

Ops whose kernels read index *values* without a bounds check get a value check at run time
(``values.VALUE_CHECKS``, applied by ``program`` right before the call). An allowed op with no
contract is refused at load (and a test keeps the allowlist covered).
"""

from .rules import Broken, no_internal_overlap
from .table import CONTRACTS, check_call, contract_of, op_name
from .values import VALUE_CHECKS

__all__ = ["CONTRACTS", "VALUE_CHECKS", "Broken", "check_call", "contract_of", "no_internal_overlap", "op_name"]
