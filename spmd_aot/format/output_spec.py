"""What a step returns, stored as plain data and read back without looking up any type by name.

torch's own ``TreeSpec`` serialization names Python types, which its reader imports; a cache
writer could make a load import any module. So the output structure is stored in spmd-aot's own
tagged form and rebuilt from plain containers within the load limits.
"""

from __future__ import annotations

import torch.utils._pytree as pytree

from ..errors import CorruptArtifactError, UnsupportedError
from .limits import LoadLimits, load_limits

__all__ = ["encode_spec", "decode_spec"]

# What a step returns, as plain data: ["leaf"], ["none"], ["tuple", [children]], ["list",
# [children]], ["dict", [keys], [children]] (str or int keys). Nothing else is written or read:
# torch's own spec format names Python types, which its reader imports.
_SPEC_TYPES = {tuple: "tuple", list: "list", dict: "dict", type(None): "none"}


def encode_spec(spec: pytree.TreeSpec) -> list:
    """A step's output ``TreeSpec`` -> the stored form; ``UnsupportedError`` for any other type."""
    if spec.is_leaf():
        return ["leaf"]
    tag = _SPEC_TYPES.get(spec.type)
    if tag is None:
        raise UnsupportedError(
            f"the step returns a {getattr(spec.type, '__qualname__', spec.type)}; a stored step may return "
            "tensors and Python scalars nested in tuples, lists, dicts (str or int keys) and None only. "
            "Return a dict or tuple instead")
    children = [encode_spec(c) for c in spec.children()]
    if tag == "none":
        return ["none"]
    if tag == "dict":
        keys = list(spec.context)
        if not all(isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)) for k in keys):
            raise UnsupportedError(f"the step returns a dict with keys {keys[:5]!r}; only str or int keys "
                                   "can be stored")
        return ["dict", keys, children]
    return [tag, children]


def decode_spec(stored, where: str, limits: LoadLimits | None = None) -> pytree.TreeSpec:
    """The stored form -> a ``TreeSpec``, within ``limits.depth`` and ``limits.items`` nodes;
    anything else is ``CorruptArtifactError``. Builds a skeleton of plain containers and lets
    pytree take its structure: no type is ever looked up by name."""
    limits = limits or load_limits()
    count = 0

    def bad(why):
        raise CorruptArtifactError(f"{where}: bad output spec: {why}")

    def build(node, depth):
        nonlocal count
        count += 1
        if depth > limits.depth or count > limits.items:
            bad(f"deeper than {limits.depth} levels or more than {limits.items} nodes")
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            bad(f"node {str(node)[:60]!r} is not a tagged list")
        tag = node[0]
        if tag == "leaf" and len(node) == 1:
            return 0
        if tag == "none" and len(node) == 1:
            return None
        if tag in ("tuple", "list") and len(node) == 2 and isinstance(node[1], list):
            items = [build(c, depth + 1) for c in node[1]]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict" and len(node) == 3 and isinstance(node[1], list) and isinstance(node[2], list) \
                and len(node[1]) == len(node[2]):
            keys = node[1]
            if not all(isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)) for k in keys) \
                    or len(set(keys)) != len(keys):
                bad("dict keys must be distinct strings or integers")
            return dict(zip(keys, (build(c, depth + 1) for c in node[2])))
        bad(f"unknown node {str(node)[:60]!r}")

    return pytree.tree_structure(build(stored, 0))
