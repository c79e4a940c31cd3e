"""Hostile cache entries: artifacts crafted with only the documented format (msgpack graph,
manifest naming every blob by sha256), as someone with write access to the cache and no
signing key could write them. Every blob hashes correctly, so the checks under test are the
op allowlist, the typed arguments, the load limits and the meta-tensor check of the graph
against its layout. Each case is refused with a clear error by ``Artifact.check`` (which runs
nothing but meta kernels) and flagged by ``spmd-aot verify``.
"""

from __future__ import annotations

import shutil

import msgpack
import pytest
import torch

import spmd_aot
from support.jobs import build_unsigned, make_job
from spmd_aot.format import signing
from spmd_aot.entries import read_artifact, read_manifest
from spmd_aot.format.artifact import pack_manifest
from spmd_aot.cli.app import main as cli
from spmd_aot.errors import CorruptArtifactError, UnsafeArtifactError
from spmd_aot.format.limits import ENV_LOAD_LIMITS
from spmd_aot.format.serialize import DecodedNode, Ref
from spmd_aot.store import LocalStore
from spmd_aot.format.validate import check_graph

CPU = torch.device("cpu")


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hostile-pristine")
    result = build_unsigned(cache)
    return cache, result.digest


class Crafter:
    """Writes crafted artifacts into a cache: a graph doc -> a manifest (and a ref) naming it."""

    def __init__(self, store: LocalStore, digest: str):
        self.store, self.digest = store, digest
        self.manifest = read_manifest(store, digest)
        self.doc = msgpack.unpackb(store.get(self.manifest["blobs"]["graph"]), raw=False)
        self.layout = msgpack.unpackb(store.get(self.manifest["blobs"]["layout"]), raw=False)
        inputs = self.layout["inputs"]
        names = [n["name"] for n in self.doc["nodes"] if n["op"] == "placeholder"]
        self.shapes = {name: e["local_shape"] for name, e in zip(names, inputs)}
        self.matrix = next(n for n in names if len(self.shapes[n]) == 2)  # a weight [out, in]
        rows, cols = self.shapes[self.matrix]
        self.vector = next(n for n in names if len(self.shapes[n]) == 1 and self.shapes[n][0] != cols)

    def graph(self, *extra_nodes, mutate=None) -> dict:
        doc = msgpack.unpackb(_pack(self.doc), raw=False)
        for node in extra_nodes:  # before the output node; the output also returns them
            doc["nodes"].insert(-1, {"op": "call_function", "args": [], "kwargs": {}, **node})
            doc["nodes"][-1]["args"][0]["~list"].append({"~node": node["name"]})
        if mutate:
            mutate(doc)
        return doc

    def store_graph(self, graph: bytes | dict, ref: str | None = None) -> str:
        manifest = dict(self.manifest, blobs=dict(self.manifest["blobs"]))
        manifest["blobs"]["graph"] = self.store.put(graph if isinstance(graph, bytes) else _pack(graph))
        digest = self.store.put(pack_manifest(manifest))
        if ref:
            self.store.set_ref(ref, digest)
        return digest


def node(name, target, *args, **kwargs):
    return {"name": name, "target": target, "args": list(args), "kwargs": kwargs}


def ref(name):
    return {"~node": name}


def ints(*v):
    return {"~list": list(v)}


def _collective(doc):
    return next(n for n in doc["nodes"] if n["op"] == "call_function" and n["target"].startswith("_c10d"))


def cases(c: Crafter) -> dict:
    """name -> (graph doc or bytes, expected error type, text the message must contain)."""
    m, v = c.matrix, c.vector
    cpu = {"~device": "cpu"}
    return {
        # memory corruption through ops that take raw sizes and strides
        "reshape_alias_oob_read": (c.graph(node("evil", "aten::_reshape_alias.default", ref(m), ints(1 << 16),
                                                 ints(1))), UnsafeArtifactError, "raw sizes"),
        "as_strided_huge_stride": (c.graph(node("evil", "aten::as_strided.default", ref(m), ints(2), ints(1 << 40))),
                                   UnsafeArtifactError, "argument contract: argument 'stride' makes a view"),
        "set_storage": (c.graph(node("evil", "aten::set_.source_Tensor_storage_offset", ref(m), ref(v), 0,
                                     ints(1 << 20), ints(1))), UnsafeArtifactError, "raw sizes"),
        "sparse_constructor": (c.graph(node("evil", "aten::_sparse_coo_tensor_with_dims_and_tensors.default", 1, 1,
                                            ints(5), ref(v), ref(v))), UnsafeArtifactError, "sparse"),
        "unchecked_index_put": (c.graph(node("evil", "aten::_index_put_impl_.default", ref(m), ints(), ref(v))),
                                UnsafeArtifactError, "skips argument checks"),
        "nested_tensor": (c.graph(node("evil", "aten::_nested_tensor_from_tensor_list.default", ints())),
                          UnsafeArtifactError, "nested"),
        "file_op": (c.graph(node("evil", "aten::from_file.default", "/etc/passwd", True, 100)),
                    UnsafeArtifactError, "files"),
        "op_off_the_list": (c.graph(node("evil", "aten::erfinv.default", ref(m))), UnsafeArtifactError,
                            "not on the op allowlist"),
        # allocations the layout does not justify
        "factory_4GiB": (c.graph(node("evil", "aten::empty.memory_format", ints(1 << 30), device=cpu)),
                         UnsafeArtifactError, "would create a tensor"),
        "full_4GiB": (c.graph(node("evil", "aten::full.default", ints(1 << 20, 1 << 10), 1.0)),
                      UnsafeArtifactError, "would create a tensor"),
        "expand_then_clone": (c.graph(node("e", "aten::expand.default", ref(m), ints(1 << 20, *c.shapes[m])),
                                      node("evil", "aten::clone.default", ref("e"))),
                              UnsafeArtifactError, "would create a tensor"),
        # typed arguments
        "group_as_raw_string": (c.graph(mutate=lambda d: _collective(d)["args"].__setitem__(-1, "0")),
                                UnsafeArtifactError, "mesh dimension"),
        "group_outside_collective": (c.graph(node("evil", "aten::add.Tensor", ref(m), {"~group": 0})),
                                     UnsafeArtifactError, "process group"),
        "device_as_string": (c.graph(node("evil", "aten::empty.memory_format", ints(2), device="cpu:0")),
                             UnsafeArtifactError, "device"),
        "device_outside_device_arg": (c.graph(node("evil", "aten::add.Tensor", ref(m), cpu)),
                                      UnsafeArtifactError, "device"),
        "unknown_keyword": (c.graph(node("evil", "aten::add.Tensor", ref(m), ref(m), beta=2)),
                            CorruptArtifactError, "no argument 'beta'"),
        "too_many_arguments": (c.graph(node("evil", "aten::relu.default", ref(m), ref(m))),
                               CorruptArtifactError, "positionally"),
        # a graph that does not fit its own layout
        "shapes_do_not_fit": (c.graph(node("evil", "aten::add.Tensor", ref(m), ref(v))),
                              UnsafeArtifactError, "breaks its op's argument contract"),
        "trailing_bytes": (_pack(c.doc) + b"\xc0", CorruptArtifactError, "after its node list"),
        "format_after_nodes": (_pack({"nodes": c.doc["nodes"], "format": 1}), CorruptArtifactError, "format"),
    }


@pytest.fixture(scope="module")
def hostile(built, tmp_path_factory):
    """A cache holding the pristine artifact and one crafted artifact per case (ref = case name)."""
    cache = tmp_path_factory.mktemp("hostile") / "cache"
    shutil.copytree(built[0], cache)
    store = LocalStore(cache)
    crafter = Crafter(store, built[1])
    table = cases(crafter)
    digests = {name: crafter.store_graph(doc, ref=f"hostile-{name}") for name, (doc, _, _) in table.items()}
    return store, crafter, table, digests


def test_control_the_crafter_round_trip_loads(hostile):
    store, crafter, _, _ = hostile
    digest = crafter.store_graph(crafter.graph(node("fine", "aten::relu.default", ref(crafter.matrix))))
    assert read_artifact(store, digest).program(["0"], CPU).n_ops > 0




def test_every_hostile_entry_is_refused_before_any_op_runs(hostile, monkeypatch):
    store, _, table, digests = hostile
    ran = []
    monkeypatch.setattr("spmd_aot.interpreter.program.Program.__init__", lambda *a, **k: ran.append(a))
    refused = 0
    for name, (_, expected, text) in table.items():
        artifact = read_artifact(store, digests[name])  # the manifest and every blob are sound
        with pytest.raises(expected) as info:
            artifact.program(["0"], CPU)
        assert text in str(info.value), f"{name}: {info.value}"
        refused += 1
    assert ran == []
    print(f"\nhostile entries: {len(table)} tried, {refused} refused before any op ran")
    assert refused == len(table) >= 20


def test_verify_flags_every_hostile_entry(hostile, capsys):
    store, _, table, digests = hostile
    assert cli(["verify", "--cache-dir", str(store.root)]) == 1
    out = capsys.readouterr().out
    flagged = [name for name in table if f"(manifest {digests[name][:12]})" in out]
    problems = out.strip().splitlines()[-1]
    assert problems.endswith(f"{len(table)} problems"), problems
    assert len(flagged) == len(table)


def test_limits_refuse_before_decoding(hostile, monkeypatch):
    store, crafter, _, _ = hostile
    artifact = read_artifact(store, crafter.digest)
    monkeypatch.setenv(ENV_LOAD_LIMITS, "nodes=10")
    with pytest.raises(CorruptArtifactError, match="more than the load limit nodes=10"):
        artifact.check()
    monkeypatch.setenv(ENV_LOAD_LIMITS, "graph_bytes=100")
    with pytest.raises(CorruptArtifactError, match=r"graph blob \w+ is \d+ bytes, more than the load limit"):
        read_artifact(store, crafter.digest)
    assert cli(["verify", "--cache-dir", str(store.root)]) == 1
    monkeypatch.setenv(ENV_LOAD_LIMITS, "nodes=ten")
    with pytest.raises(spmd_aot.SpmdAotError, match=ENV_LOAD_LIMITS):
        read_artifact(store, crafter.digest)


def test_meta_check_catches_a_view_past_its_storage():
    """The storage-extent rule on a view op: as_strided's contract states it before its meta kernel runs."""
    layout = [{"local_shape": [4, 4], "dtype": "float32"}]
    nodes = [DecodedNode("placeholder", "x", "x", (), {}),
             DecodedNode("call_function", "v", torch.ops.aten.as_strided.default, (Ref(0), [2], [1000]), {}),
             DecodedNode("output", "output", "output", ([Ref(1)],), {})]
    with pytest.raises(UnsafeArtifactError, match="reaches byte 4004 of a 64-byte storage"):
        check_graph(nodes, {}, layout, device_type="cpu")
    nodes[1] = DecodedNode("call_function", "v", torch.ops.aten.as_strided.default, (Ref(0), [2], [4]), {})
    check_graph(nodes, {}, layout, device_type="cpu")  # inside the storage: fine



def test_meta_check_refuses_an_op_that_resizes_the_tensor_it_writes():
    """``mm.out`` (allowed: buckets write weight gradients with it) into a wrongly shaped ``out``
    would resize ``out`` in place; later checks assume written tensors keep their geometry."""
    def nodes(out_shape):
        layout = [{"local_shape": [4, 8], "dtype": "float32"}, {"local_shape": [8, 16], "dtype": "float32"},
                  {"local_shape": out_shape, "dtype": "float32"}]
        graph = [DecodedNode("placeholder", n, n, (), {}) for n in "abo"] + [
            DecodedNode("call_function", "mm", torch.ops.aten.mm.out, (Ref(0), Ref(1)), {"out": Ref(2)}),
            DecodedNode("output", "output", "output", ([Ref(3)],), {})]
        return graph, layout

    graph, layout = nodes([4, 16])
    check_graph(graph, {}, layout, device_type="cpu")  # the shape it computes: fine
    graph, layout = nodes([64, 64])
    with pytest.raises(UnsafeArtifactError, match=r"mm.out\) breaks its op's argument contract: argument 'out' has shape"):
        check_graph(graph, {}, layout, device_type="cpu")

# ---------------------------------------------------------------- manifests: exact bytes, explain

def _widen_int(data: bytes, field: bytes) -> bytes:
    """Re-encode the integer after map key ``field`` as a 4-byte uint32 (same value, other bytes)."""
    key = bytes([0xA0 | len(field)]) + field
    at = data.index(key) + len(key)
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data[at:])
    value = unpacker.unpack()
    width = unpacker.tell()
    assert isinstance(value, int) and 0 <= value < 1 << 32
    return data[:at] + b"\xce" + value.to_bytes(4, "big") + data[at + width:]


def test_reencoded_manifest_is_refused_with_or_without_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "key-A")
    result = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, cache_dir=tmp_path / "c")
    store = LocalStore(tmp_path / "c")
    data = store.get(result.digest)
    forged = _widen_int(data, b"nodes")
    body, forged_body = signing.split(data, "m")[1], signing.split(forged, "m")[1]
    assert forged != data and msgpack.unpackb(forged_body, raw=False) == msgpack.unpackb(body, raw=False)
    digest = store.put(forged)
    assert digest != result.digest
    # with the key the MAC (over the stored bytes) refuses it; without, the canonical-form check
    for key, why in (("key-A", "signature mismatch"), ("", "not in canonical form")):
        monkeypatch.setenv(signing.ENV_SIGNING_KEY, key)
        with pytest.raises(CorruptArtifactError, match=why):
            read_manifest(store, digest)
    read_manifest(store, result.digest)  # the original still reads


ODD_VALUES = {
    "deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    "deeper": None,
    "bytes": b"\x00\xff",
    "nan": float("nan"),
    "big": 2 ** 64 - 1,
    "mixed": {"a": [1, {"b": b"x"}], "c": "x" * 10000},
}


def test_explain_never_fails_on_manifest_content(hostile):
    from spmd_aot.keying.explain import explain_miss
    from spmd_aot.keying.key import CacheKey

    store, crafter, _, _ = hostile
    deeper = 1
    for _ in range(500):
        deeper = {"x": [deeper]}
    values = dict(ODD_VALUES, deeper=deeper)
    for name in ("ingredient_values", "ingredients"):
        manifest = dict(crafter.manifest)
        manifest["ingredient_values"] = {n: values for n in manifest["ingredients"]}
        digest = store.put(pack_manifest(manifest))
        store.set_ref("odd-" + name, digest)
    live = CacheKey("0" * 64, {n: "f" * 64 for n in crafter.manifest["ingredients"]},
                    {n: {"live": [1, 2]} for n in crafter.manifest["ingredients"]})
    text = explain_miss(store, live)
    assert isinstance(text, str) and "differs in" in text
    bad = dict(crafter.manifest, ingredient_values="not a map")
    store.set_ref("odd-not-a-map", store.put(pack_manifest(bad)))
    assert isinstance(explain_miss(store, live), str)
