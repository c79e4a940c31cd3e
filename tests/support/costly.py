"""Crafted cache entries that cost a loader as much work as the load limits allow.

Each helper takes a built artifact (``store``, manifest ``digest``) and writes a new entry of the
same key whose graph is the built one plus crafted nodes, using only the documented format (a
msgpack graph, a manifest naming every blob by sha256), as a writer of the cache without a
signing key could. Used by ``tests/format/test_bounded_work.py`` and ``tools/stress/worst_case_load.py``.
"""

from __future__ import annotations

import msgpack

from spmd_aot.entries import read_manifest
from spmd_aot.format.artifact import pack_manifest


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _base(store, digest: str) -> tuple[dict, dict, str]:
    """(manifest, graph doc, name of a 2-D floating placeholder) of the built artifact."""
    manifest = read_manifest(store, digest)
    doc = msgpack.unpackb(store.get(manifest["blobs"]["graph"]), raw=False)
    layout = msgpack.unpackb(store.get(manifest["blobs"]["layout"]), raw=False)
    names = [n["name"] for n in doc["nodes"] if n["op"] == "placeholder"]
    matrix = next(name for name, e in zip(names, layout["inputs"])
                  if len(e["local_shape"]) == 2 and e["dtype"].startswith("float"))
    return manifest, doc, matrix


def store_with_nodes(store, digest: str, extra: list[dict], ref: str | None = None) -> str:
    """A new entry: the built graph with ``extra`` nodes before its output (which also returns
    the last of them); returns its manifest digest (and points ``ref`` at it)."""
    manifest, doc, _ = _base(store, digest)
    nodes = doc["nodes"]
    output = nodes.pop()
    output["args"][0]["~list"].append({"~node": extra[-1]["name"]})
    doc["nodes"] = nodes + extra + [output]
    manifest = dict(manifest, blobs=dict(manifest["blobs"]))
    manifest["blobs"]["graph"] = store.put(_pack(doc))
    new = store.put(pack_manifest(manifest))
    if ref:
        store.set_ref(ref, new)
    return new


def base_nodes(store, digest: str) -> int:
    """How many nodes the built graph has (crafted graphs add to them)."""
    return len(_base(store, digest)[1]["nodes"])


def scalar_chain(store, digest: str, n: int, distinct: bool, op: str = "aten::add.Scalar") -> list[dict]:
    """``n`` nodes ``x = op(x, s)`` on a weight: with ``distinct`` every scalar differs, so no
    two calls share metadata and the meta check's memo never hits; else all are memo hits."""
    prev = _base(store, digest)[2]
    out = []
    for i in range(n):
        scalar = 1.0 + i * 2.0 ** -40 if distinct else 1.0
        out.append({"op": "call_function", "name": f"crafted_{i}", "target": op,
                    "args": [{"~node": prev}, scalar], "kwargs": {}})
        prev = f"crafted_{i}"
    return out


def long_foreach(store, digest: str, tensors: int, nodes: int = 1) -> list[dict]:
    """``nodes`` foreach ops, each over a list naming one weight ``tensors`` times (one node
    may list up to ``LoadLimits.items`` values)."""
    matrix = _base(store, digest)[2]
    listed = {"~list": [{"~node": matrix}] * tensors}
    return [{"op": "call_function", "name": f"crafted_foreach_{i}", "target": "aten::_foreach_add.Scalar",
             "args": [listed, 1.0 + i], "kwargs": {}} for i in range(nodes)]
