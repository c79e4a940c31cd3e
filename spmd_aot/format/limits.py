"""Bounds a stored artifact must fit before any of it is decoded or run.

Reading a blob, decoding a graph and running its factory ops all cost memory in proportion
to numbers an attacker with write access to the cache controls. These bounds are checked
first: a blob's size before it is read, every stored document's container lengths, string
lengths and total object count while it is decoded (``bounded.py``: the decoder stops before
allocating past them), a graph's node count and nesting, the work constant folding may do at
load (``constant_fold.py``), and every tensor a graph would create before it runs
(``validate.py``, on meta tensors) together with that check's own work (``meta_work``). The defaults fit a
Llama-70B-shaped AdamW step for 1024
ranks with room to spare; ``SPMD_AOT_LOAD_LIMITS`` overrides any of them, e.g.
``SPMD_AOT_LOAD_LIMITS="graph_bytes=1G,nodes=4000000,tensor_factor=128"``.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from ..errors import SpmdAotError

__all__ = ["LoadLimits", "load_limits", "ENV_LOAD_LIMITS"]

ENV_LOAD_LIMITS = "SPMD_AOT_LOAD_LIMITS"


@dataclasses.dataclass(frozen=True)
class LoadLimits:
    graph_bytes: int = 256 << 20  # the graph blob (a 70B step is ~10 MiB)
    constants_bytes: int = 4 << 30  # graph constants (safetensors)
    part_bytes: int = 256 << 20  # manifest, layout, schema, code blobs
    nodes: int = 250_000  # graph nodes (a 70B AdamW step has ~40k; decoding costs ~10 us a node)
    depth: int = 32  # nesting of argument values (traced graphs use 2 or 3)
    items: int = 1_000_000  # elements in one argument list or map
    # Objects (containers plus their elements) one stored msgpack document may decode to: an
    # empty container is one byte stored and ~70 bytes decoded, so bytes alone bound nothing.
    # The graph may hold objects_per_node x nodes (a traced node decodes to ~12).
    objects: int = 1_000_000
    objects_per_node: int = 32
    guard_file_bytes: int = 64 << 20  # a source file a guard hashes (larger: the guard fails)
    # Constant folding at load: estimated multiply-adds of one folded op, and of all of them.
    fold_op_flops: int = 1 << 26
    fold_total_flops: int = 1 << 30
    # The meta check's work (``validate.py``), in units of one remembered op result (~20 us):
    # each node costs 1, each run of an op's contract and meta kernel 16 plus 4 per tensor
    # argument. A traced 48-layer AdamW step spends 29k-50k; this bounds a crafted graph of
    # distinct calls to a few seconds.
    meta_work: int = 400_000
    # The largest tensor one op may create: tensor_factor x the largest tensor in the state
    # layout (activations), the whole global state (flat communication buffers), or
    # tensor_floor bytes, whichever is largest.
    tensor_factor: int = 64
    tensor_floor: int = 1 << 30


_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _number(text: str) -> int:
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = text[-1:] if text[-1:] in _SUFFIX else ""
    return int(float(text[: len(text) - len(unit)]) * _SUFFIX[unit])


@functools.lru_cache(maxsize=8)
def _parse(spec: str) -> LoadLimits:
    fields = {f.name for f in dataclasses.fields(LoadLimits)}
    values = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        try:
            if not sep or name not in fields:
                raise ValueError(name)
            values[name] = _number(value)
            if values[name] <= 0:
                raise ValueError(value)
        except ValueError:
            raise SpmdAotError(
                f"{ENV_LOAD_LIMITS}={spec!r}: cannot read {item!r}; expected comma-separated "
                f"NAME=NUMBER (K/M/G suffixes allowed) with NAME one of {', '.join(sorted(fields))}"
            ) from None
    return LoadLimits(**values)


def load_limits() -> LoadLimits:
    """The limits in force: the defaults, overridden by ``$SPMD_AOT_LOAD_LIMITS``."""
    return _parse(os.environ.get(ENV_LOAD_LIMITS, ""))
