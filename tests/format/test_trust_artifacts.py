"""An untrusted cache, part 1: crafted stored data (documented format, correct hashes, no key).

Each test stores what an attacker with write access could store and checks it is refused (or
bounded) by construction: no import, no decode before the signature, no memory blowup, no
layout-claimed size lifting the limits, no unbounded folding, and `verify` / `show` doing
exactly what a load does and printing nothing raw.
"""

from __future__ import annotations

import shutil
import sys
import time
import tracemalloc

import msgpack
import pytest
import torch
import torch.utils._pytree as pytree

from support.jobs import build_unsigned
from spmd_aot.format import bounded
from spmd_aot.format import signing
from spmd_aot.entries import read_artifact, read_manifest
from spmd_aot.format.artifact import decode_spec, encode_spec, pack_manifest
from spmd_aot.cli.app import main as cli
from spmd_aot.interpreter.constant_fold import fold_constants
from spmd_aot.errors import CorruptArtifactError, UnsupportedError
from spmd_aot.format.limits import LoadLimits
from spmd_aot.format.serialize import DecodedNode, Ref, decode_graph
from spmd_aot.store import LocalStore


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("trust-pristine")
    return cache, build_unsigned(cache).digest


@pytest.fixture
def store(built, tmp_path, monkeypatch):
    monkeypatch.delenv(signing.ENV_SIGNING_KEY, raising=False)
    shutil.copytree(built[0], tmp_path / "cache")
    return LocalStore(tmp_path / "cache")


def _with_part(store, digest, name, data: bytes, **fields) -> str:
    """A manifest like ``digest``'s whose part ``name`` is ``data`` (plus ``fields``); its digest."""
    manifest = read_manifest(store, digest)
    manifest["blobs"][name] = store.put(data)
    manifest.update(fields)
    return store.put(pack_manifest(manifest))


# ---------------------------------------------------------------- 1. no import through the output spec
def test_output_spec_never_imports_a_module_named_in_the_cache(store, built, tmp_path, monkeypatch):
    """torch's treespec JSON names a defaultdict's factory module; its reader imports it. A
    module planted on sys.path must not run, whatever the layout's spec says."""
    marker = tmp_path / "ran"
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "spmd_trust_planted.py").write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\ndef factory():\n    return 0\n")
    monkeypatch.syspath_prepend(str(planted))
    import spmd_trust_planted  # to write the spec torch would read; then forget it

    spec_json = pytree.treespec_dumps(pytree.tree_structure(
        __import__("collections").defaultdict(spmd_trust_planted.factory, {"a": 1})))
    assert "spmd_trust_planted" in spec_json
    del sys.modules["spmd_trust_planted"]
    marker.unlink()
    layout = msgpack.unpackb(store.get(read_manifest(store, built[1])["blobs"]["layout"]), raw=False)
    layout["outputs"]["spec"] = spec_json
    digest = _with_part(store, built[1], "layout", _pack(layout))
    with pytest.raises(CorruptArtifactError, match="bad output spec"):
        read_artifact(store, digest)
    assert not marker.exists() and "spmd_trust_planted" not in sys.modules


def test_output_spec_round_trips_and_refuses_other_types():
    value = (torch.ones(1), {"loss": torch.ones(1), 3: [None, (torch.ones(2), 1.5)]}, None)
    spec = pytree.tree_structure(value)
    assert decode_spec(msgpack.unpackb(_pack(encode_spec(spec)), raw=False), "t") == spec
    import collections

    with pytest.raises(UnsupportedError, match="OrderedDict"):
        encode_spec(pytree.tree_structure(collections.OrderedDict(a=torch.ones(1))))
    deep = ["leaf"]
    for _ in range(100):
        deep = ["list", [deep]]
    for bad in ("leaf", ["module", "os.system"], ["dict", [[1]], [["leaf"]]], deep, ["tuple", [["leaf"]] * 10 ** 6]):
        with pytest.raises(CorruptArtifactError, match="bad output spec"):
            decode_spec(bad, "t")


# ---------------------------------------------------------------- 2. bounded decoding, signature first
def test_many_empty_containers_are_refused_within_bounded_memory(store, built):
    """32 MiB of empty arrays decoded to 2.4 GiB of lists before; now at most ``objects`` of them."""
    inner = b"\xdd" + (1_000_000).to_bytes(4, "big") + b"\x90" * 1_000_000  # within max_array_len
    crafted = b"\xdc" + (32).to_bytes(2, "big") + inner * 32  # 32M empty arrays in all
    digest = _with_part(store, built[1], "layout", crafted)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptArtifactError, match="more than 1000000 objects|objects"):
            read_artifact(store, digest)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, f"decoding peaked at {peak >> 20} MiB"


def test_graph_objects_are_bounded_by_its_declared_node_count():
    limits = LoadLimits()
    few_nodes_many_lists = _pack({"format": 1, "nodes": [{"op": "placeholder", "name": "x", "target": "x",
                                                          "args": [[]] * 10_000, "kwargs": {}}]})
    with pytest.raises(CorruptArtifactError, match="objects"):
        decode_graph(few_nodes_many_lists, groups=[], device=torch.device("cpu"), limits=limits)
    with pytest.raises(CorruptArtifactError, match="not valid msgpack"):
        bounded.unpack(_pack({"a": msgpack.ExtType(1, b"x")}), "doc", objects=100)


def test_a_document_decodes_to_at_most_twice_its_bytes_in_counted_objects():
    """Why ``bounded`` may skip counting for a document of at most ``objects / 2`` bytes: the
    count (containers plus their elements) never passes twice the bytes, for the densest
    documents there are (nested and flat empty containers, maps of one-byte keys)."""
    import random

    rng = random.Random(0)

    def doc(depth):
        kind = rng.randrange(5) if depth < 6 else 4
        if kind == 0:
            return [doc(depth + 1) for _ in range(rng.randrange(4))]
        if kind == 1:
            return {chr(97 + i): doc(depth + 1) for i in range(rng.randrange(4))}
        return [[[[]]]] if kind == 2 else ([] if kind == 3 else rng.choice([0, None, True, ""]))

    cases = [[[]] * 1000, [[[[[]]]]], {"": []}, [{}] * 500] + [doc(0) for _ in range(300)]
    for case in cases:
        data = _pack(case)
        bounded.unpack(data, "doc", objects=2 * len(data))  # at exactly twice the bytes: never over
        counted = []
        msgpack.unpackb(data, list_hook=lambda o: counted.append(len(o) + 1) or o,
                        object_hook=lambda o: counted.append(len(o) + 1) or o)
        assert sum(counted) <= 2 * len(data), case
    # over the size bound the count still runs and still refuses
    with pytest.raises(CorruptArtifactError, match="objects"):
        bounded.unpack(_pack([[]] * 1000), "doc", objects=1500)


def test_signature_is_checked_before_the_manifest_is_decoded(store, built, monkeypatch):
    garbage = signing.wrap(b"\xdd\x7f\xff\xff\xff" + b"\x90" * 1000)  # unsigned, and hostile inside
    digest = store.put(garbage)
    forged = store.put(signing.MAGIC + b"hmac-sha256 " + b"0" * 16 + b" " + b"0" * 64 + b"\n" + b"\x90" * 100)
    decoded = []
    monkeypatch.setattr(bounded, "unpack", lambda *a, **k: decoded.append(a) or {})
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "key-A")
    with pytest.raises(signing.SignatureError, match="unsigned"):
        read_manifest(store, digest)
    with pytest.raises(signing.SignatureError, match="another key"):
        read_manifest(store, forged)
    assert decoded == []


def test_manifest_without_the_format_3_header_is_refused(store, built):
    body = signing.split(store.get(built[1]), "m")[1]
    with pytest.raises(CorruptArtifactError, match="not a manifest of this spmd-aot"):
        read_manifest(store, store.put(body))  # a format-2 style bare msgpack manifest


# ---------------------------------------------------------------- 5. limits never trust the layout
def test_inflated_global_shape_is_refused(store, built):
    layout = msgpack.unpackb(store.get(read_manifest(store, built[1])["blobs"]["layout"]), raw=False)
    layout["inputs"][0]["global_shape"] = [1 << 20, 1 << 20]  # would lift the tensor limit to TiBs
    digest = _with_part(store, built[1], "layout", _pack(layout))
    with pytest.raises(CorruptArtifactError, match="claims global shape"):
        read_artifact(store, digest)
    assert cli(["verify", "--cache-dir", str(store.root)]) == 0  # unreferenced: verify checks refs
    store.set_ref("inflated", digest)
    assert cli(["verify", "--cache-dir", str(store.root)]) == 1


def test_live_global_shape_must_match_the_layout(store, built):
    from spmd_aot.format.artifact import layout_mismatch

    art = read_artifact(store, built[1])

    class Live:  # what layout_mismatch reads of a live slot, via _slot_entry
        def __init__(self, entry, shape):
            self.kind, self.fqn, self.aliases, self.local_shape = entry["kind"], entry["fqn"], [], entry["local_shape"]
            self.shape, self.layout, self.dtype = shape, None, entry["dtype"]
            self.device_type, self.requires_grad = entry["device_type"], entry["requires_grad"]

    entries = [e for e in art.slots if e["kind"] != "batch"][:1]
    entry = entries[0]
    honest = [Live(entry, entry["global_shape"])]
    plan = art.plan
    stored = [dict(entry, placement=["Replicate()"] * len(plan.mesh_shape))]
    assert layout_mismatch(stored, honest, plan) is None
    liar = [dict(stored[0], global_shape=[2 * entry["global_shape"][0], *entry["global_shape"][1:]])]
    assert "global_shape" in layout_mismatch(liar, honest, plan)


# ---------------------------------------------------------------- 5. bounded folding
def _chain(n: int) -> list[DecodedNode]:
    nodes = [DecodedNode("get_attr", "c", "c", (), {})]
    for i in range(1, n):
        nodes.append(DecodedNode("call_function", f"n{i}", torch.ops.aten.neg.default, (Ref(i - 1),), {}))
    nodes.append(DecodedNode("output", "output", "output", ([Ref(n - 1)],), {}))
    return nodes


def test_folding_is_linear_and_within_its_budget():
    """80k foldable nodes took 47 s (a set union per node); now one pass, and at most
    fold_total_flops / per-op charge of them fold."""
    limits = LoadLimits(fold_total_flops=1 << 26)
    nodes = _chain(80_000)
    template = [torch.ones(4)] + [None] * (len(nodes) - 1)
    start = time.perf_counter()
    folded = fold_constants(nodes, template, nodes[-1].args)
    assert 0 < len(fold_constants(_chain(50), [torch.ones(4)] + [None] * 50, ()))
    fold_constants(nodes, list(template), (), limits)
    seconds = time.perf_counter() - start
    assert seconds < 60, f"folding 80k nodes took {seconds:.1f} s"
    assert len(folded) < 80_000  # the budget stopped it


def test_a_costly_convolution_is_not_folded():
    x = torch.ones(1, 64, 128, 128)
    w = torch.ones(64, 64, 7, 7)
    nodes = [DecodedNode("get_attr", "x", "x", (), {}), DecodedNode("get_attr", "w", "w", (), {}),
             DecodedNode("call_function", "conv", torch.ops.aten.convolution.default,
                         (Ref(0), Ref(1), None, [1, 1], [3, 3], [1, 1], False, [0, 0], 1), {}),
             DecodedNode("call_function", "small", torch.ops.aten.neg.default, (Ref(0),), {}),
             DecodedNode("output", "output", "output", ([Ref(2)],), {})]
    start = time.perf_counter()
    folded = fold_constants(nodes, [x, w, None, None, None], ())
    assert time.perf_counter() - start < 5
    assert 2 not in folded and 3 in folded


# ---------------------------------------------------------------- 6. verify = load's checks; show escapes
def test_verify_flags_a_ref_to_another_keys_manifest(store, built, capsys):
    store.set_ref("someone-elses-key", built[1])
    assert cli(["verify", "--cache-dir", str(store.root)]) == 1
    out = capsys.readouterr().out
    assert "someone-else" in out and "manifest of key" in out


def test_show_escapes_terminal_sequences(store, built, capsys):
    evil = "\x1b]0;owned\x07\x1b[2J\u202e"
    manifest = read_manifest(store, built[1])
    manifest["stats"]["comm"] = [{"kind": evil, "label": evil, "bytes": 1, "params": [evil]}]
    manifest["ingredients"] = {evil: next(iter(manifest["ingredients"].values()))}
    manifest["blobs"]["code"] = store.put(f"# {evil}\nx = 1\n".encode())
    store.set_ref("evil", store.put(pack_manifest(manifest)))
    assert cli(["show", "evil", "--code", "--cache-dir", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "\\x1b]0;owned" in out and "x = 1" in out
