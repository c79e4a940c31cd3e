"""Integrity: corrupted, tampered, crafted and fuzzed artifacts are refused before anything runs.

* 200 random corruptions of a built artifact's blobs (bit flips, truncations, appended
  bytes, one blob's bytes under another's name): every load raises CorruptArtifactError.
* Crafted graphs that name dangerous callables or smuggle code into names: the manifest and
  every blob hash correctly, so the op allowlist is the only thing that can refuse them.
* Fuzzing: 1600 structurally mutated manifests and graph docs (``tools/fuzz/fuzz_artifacts.py``:
  as many as you like); the loaders may accept a harmless mutation or refuse with an
  ``SpmdAotError``, never raise anything else.
* Signing (``SPMD_AOT_SIGNING_KEY``): unsigned, wrongly signed and modified manifests refused.
"""

from __future__ import annotations

import copy
import hashlib
import random
import shutil

import msgpack
import pytest
import torch

import spmd_aot
from support.jobs import build_unsigned, make_job
from spmd_aot.format import signing
from spmd_aot.entries import read_artifact, read_manifest
from spmd_aot.format.artifact import pack_manifest
from spmd_aot.errors import CorruptArtifactError, SpmdAotError, UnsafeArtifactError
from spmd_aot.interpreter.program import Program
from spmd_aot.format.serialize import decode_graph
from spmd_aot.format.signing import SignatureError
from spmd_aot.store import LocalStore

CPU = torch.device("cpu")
GROUPS = ["0"]  # world size 2: one mesh dimension


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def load(store: LocalStore, digest: str):
    """What a job does with a manifest digest: read and verify every blob, decode, bind."""
    return read_artifact(store, digest).program(GROUPS, CPU)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(cache dir, manifest digest, {blob name: digest}) of an unsigned MLP build, world size 2."""
    cache = tmp_path_factory.mktemp("pristine")
    result = build_unsigned(cache)
    blobs = read_manifest(LocalStore(cache), result.digest)["blobs"]
    return cache, result.digest, {"manifest": result.digest, **blobs}


@pytest.fixture
def store(built, tmp_path, monkeypatch):
    """A private copy of the built cache, with no signing key in the environment."""
    monkeypatch.delenv(signing.ENV_SIGNING_KEY, raising=False)
    shutil.copytree(built[0], tmp_path / "cache")
    return LocalStore(tmp_path / "cache")


# ---------------------------------------------------------------- random corruption

def _corrupt(rng: random.Random, data: bytes, others: list[bytes]) -> tuple[str, bytes]:
    kind = rng.choice(["bitflip", "truncate", "append", "swap"])
    if kind == "bitflip":
        raw = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(raw) * 8)
            raw[pos // 8] ^= 1 << (pos % 8)
        return kind, bytes(raw)
    if kind == "truncate":
        return kind, data[: rng.randrange(len(data))]
    if kind == "append":
        return kind, data + rng.randbytes(rng.randint(1, 64))
    return kind, rng.choice(others)


def test_200_random_corruptions_are_all_detected(store, built):
    _, manifest_digest, digests = built
    pristine = {name: store.get(d) for name, d in digests.items()}
    assert load(store, manifest_digest).n_ops > 0
    rng = random.Random(20240611)
    detected, kinds = 0, {}
    for case in range(200):
        name = rng.choice(sorted(digests))
        path = store.blob_path(digests[name])
        kind, bad = _corrupt(rng, pristine[name], [v for k, v in pristine.items() if k != name])
        assert bad != pristine[name]
        path.write_bytes(bad)
        try:
            load(store, manifest_digest)
        except CorruptArtifactError as exc:
            assert digests[name] in str(exc), f"case {case}: error does not name the blob: {exc}"
            detected += 1
            kinds[kind] = kinds.get(kind, 0) + 1
        else:
            pytest.fail(f"case {case}: {kind} of the {name} blob was loaded")
        assert not path.exists()  # the bad copy went to quarantine/
        path.write_bytes(pristine[name])  # restore, and check the restore
        assert load(store, manifest_digest).n_ops > 0
    print(f"\ncorruptions: 200 tried, {detected} detected, by kind {dict(sorted(kinds.items()))}")
    assert detected == 200
    assert len(kinds) == 4
    assert len(list((store.root / "quarantine").iterdir())) == 200


# ---------------------------------------------------------------- crafted artifacts

def store_with_graph(store: LocalStore, manifest_digest: str, graph_doc: dict) -> str:
    """Store ``graph_doc`` and a manifest naming it (blob digests all valid); its digest."""
    manifest = read_manifest(store, manifest_digest)
    manifest["blobs"]["graph"] = store.put(_pack(graph_doc))
    return store.put(pack_manifest(manifest))


def _graph(store, built) -> dict:
    return _unpack(store.get(built[2]["graph"]))


def _first_call(doc) -> dict:
    return next(n for n in doc["nodes"] if n["op"] == "call_function")


def test_crafted_graph_round_trip_loads(store, built):
    """Control: re-encoding the unchanged graph loads, so refusals below are the allowlist's."""
    digest = store_with_graph(store, built[1], _graph(store, built))
    assert load(store, digest).n_ops > 0


MARKER_NAME = "spmd_aot_pwned"

EVIL_TARGETS = [
    "builtins.eval", "eval", "builtins.exec", "os.system", "posix.system", "subprocess.call",
    "torch.load", "torch.save", "pickle.loads", "importlib.import_module", "builtins.__import__",
    "torch.ops.aten.add.Tensor", "aten.add.Tensor", "aten::add", "aten::add.__call__",
    "aten::__class__.__init__", "aten::add.__globals__", "aten::__dict__.add", "aten::add.Tensor.__doc__",
    "aten::name.upper", "aten::add.Tensor; import os", "aten::add.Tensor\x00", "aten:: add.Tensor",
    "os::system.default", "builtins::eval.default", "torch::load.default", "__main__::x.default",
    "operator.getitem ", " operator.getitem", "operator.getitem\x00", "_operator.getitem",
    "operator.attrgetter", "operator.methodcaller", "operator.getitem.__globals__", "operator.__getitem__",
    "OPERATOR.GETITEM", "operator .getitem", "aten::nonexistent_op_xyz.default",
    "aten::from_file.default", "aten::_print.default",
    42, None, ["os", "system"], {"~node": "arg0_1"}, b"os.system",
]


@pytest.mark.parametrize("target", EVIL_TARGETS, ids=repr)
def test_crafted_call_target_is_refused_before_anything_runs(store, built, tmp_path, target):
    marker = tmp_path / MARKER_NAME
    doc = _graph(store, built)
    node = _first_call(doc)
    node["target"] = target
    node["args"] = [f"touch {marker}"]  # what os.system would run
    digest = store_with_graph(store, built[1], doc)
    read_manifest(store, digest)  # the manifest and every blob are sound ...
    artifact = read_artifact(store, digest)
    with pytest.raises(CorruptArtifactError):  # ... so the allowlist is what refuses it
        artifact.program(GROUPS, CPU)
    with pytest.raises(CorruptArtifactError):
        artifact.graph_module(GROUPS, CPU)
    assert not marker.exists()


CRAFTED = {  # name -> (mutation of the graph doc, error expected)
    "get_attr __class__": (lambda d: d["nodes"].insert(1, {"op": "get_attr", "name": "c", "target": "__class__",
                                                            "args": [], "kwargs": {}}), UnsafeArtifactError),
    "get_attr __dict__": (lambda d: _first_call(d).update(op="get_attr", target="__dict__"), UnsafeArtifactError),
    "get_attr dotted": (lambda d: _first_call(d).update(op="get_attr", target="os.system"), UnsafeArtifactError),
    "get_attr unknown constant": (lambda d: _first_call(d).update(op="get_attr", target="weights", args=[]),
                                  CorruptArtifactError),
    "node name with code": (lambda d: _first_call(d).update(name="x; import os"), CorruptArtifactError),
    "node name dunder import": (lambda d: _first_call(d).update(name="__import__('os')"), CorruptArtifactError),
    "node name keyword": (lambda d: _first_call(d).update(name="import"), CorruptArtifactError),
    "duplicate node name": (lambda d: _first_call(d).update(name=d["nodes"][0]["name"]), CorruptArtifactError),
    "opcode call_method": (lambda d: _first_call(d).update(op="call_method", target="system"), UnsafeArtifactError),
    "opcode call_module": (lambda d: _first_call(d).update(op="call_module", target="os"), UnsafeArtifactError),
    "kwarg name with code": (lambda d: _first_call(d).update(kwargs={"x=os.system('id'),y": 1}),
                             CorruptArtifactError),
    "unknown value tag": (lambda d: _first_call(d).update(args=[{"~eval": "os.system('id')"}]),
                          CorruptArtifactError),
    "dtype tag naming a function": (lambda d: _first_call(d).update(args=[{"~dtype": "load"}]),
                                    CorruptArtifactError),
    "dtype tag dunder": (lambda d: _first_call(d).update(args=[{"~dtype": "__class__"}]), CorruptArtifactError),
    "device tag with index and code": (lambda d: _first_call(d).update(args=[{"~device": "cuda:0;rm -rf"}]),
                                       CorruptArtifactError),
    "group out of range": (lambda d: _first_call(d).update(args=[{"~group": 7}]), CorruptArtifactError),
    "forward node reference": (lambda d: _first_call(d).update(args=[{"~node": "output"}]),
                               CorruptArtifactError),
    "placeholder after ops": (lambda d: d["nodes"].insert(-1, {"op": "placeholder", "name": "late",
                                                               "target": "late", "args": [], "kwargs": {}}),
                              CorruptArtifactError),
    "extra node field": (lambda d: _first_call(d).update(code="import os"), CorruptArtifactError),
    "no output node": (lambda d: d["nodes"].pop(), CorruptArtifactError),
    "graph format 2": (lambda d: d.update(format=2), CorruptArtifactError),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_graph_is_refused(store, built, case):
    mutate, expected = CRAFTED[case]
    doc = _graph(store, built)
    mutate(doc)
    digest = store_with_graph(store, built[1], doc)
    artifact = read_artifact(store, digest)  # every blob hashes right
    with pytest.raises(expected):
        artifact.program(GROUPS, CPU)


# ---------------------------------------------------------------- fuzzing

_ATOMS = [None, True, False, 0, 1, -1, 7, 2**31, 2**63 - 1, -2**63, 2**64 - 1, 0.5, -0.0, float("nan"),
          float("inf"), "", "x", "arg0_1", "output", "__class__", "__import__", "os.system", "x; import os",
          "aten::add.Tensor", "aten::detach.default", "operator.getitem", "placeholder", "call_function",
          "get_attr", "cpu", "cuda", "float32", "0" * 64, "a" * 300, "\x00", "\ufffd", b"", b"\x00\xff", b"bytes"]
_TAGGED = ["~node", "~tuple", "~list", "~slice", "~dtype", "~layout", "~memory_format", "~device", "~group",
           "~eval"]


def _random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.55:
        return rng.choice(_ATOMS)
    if r < 0.7:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.85:
        return {rng.choice(_TAGGED): _random_value(rng, depth + 1)}
    return {str(rng.choice(_ATOMS)): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _containers(obj, out=None):
    """Every (container, key) slot in a msgpack tree."""
    out = [] if out is None else out
    if isinstance(obj, dict):
        for k in list(obj):
            out.append((obj, k))
            _containers(obj[k], out)
    elif isinstance(obj, list):
        for i in range(len(obj)):
            out.append((obj, i))
            _containers(obj[i], out)
    return out


def _mutate_tree(rng: random.Random, doc):
    """1-3 random structural mutations of a decoded msgpack tree, in place."""
    for _ in range(rng.randint(1, 3)):
        slots = _containers(doc)
        if not slots:
            return _random_value(rng)
        parent, key = rng.choice(slots)
        op = rng.choice(["delete", "replace", "swap", "transplant", "retype", "insert", "rename", "deepen"])
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = _random_value(rng)
        elif op == "swap":
            other, okey = rng.choice(slots)
            try:
                parent[key], other[okey] = other[okey], parent[key]
            except (KeyError, IndexError):  # the slots overlapped; keep what we have
                pass
        elif op == "transplant":
            other, okey = rng.choice(slots)
            try:
                parent[key] = copy.deepcopy(other[okey])
            except (KeyError, IndexError):
                pass
        elif op == "retype":
            v = parent[key]
            parent[key] = (str(v) if not isinstance(v, str) else rng.choice([v.encode(), [v], len(v), {v: v}]))
        elif op == "insert":
            if isinstance(parent, dict):
                parent[rng.choice(["op", "name", "args", "kwargs", "target", "blobs", "plan", "format",
                                   "signature", "~node", "zz"])] = _random_value(rng)
            else:
                parent.insert(key, _random_value(rng))
        elif op == "rename" and isinstance(parent, dict):
            parent[rng.choice(["op", "name", "target", "args", "kwargs", "x", "__class__"])] = parent.pop(key)
        elif op == "deepen":
            parent[key] = {"~list": [parent[key]]} if rng.random() < 0.5 else [parent[key]]
    return doc


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    raw = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["flip", "set", "cut", "insert"])
        if not raw:
            raw = bytearray(rng.randbytes(4))
        pos = rng.randrange(len(raw))
        if op == "flip":
            raw[pos] ^= 1 << rng.randrange(8)
        elif op == "set":
            raw[pos] = rng.choice([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xD9, 0xDC, 0xDE, 0xFF, rng.randrange(256)])
        elif op == "cut":
            del raw[pos: pos + rng.randint(1, 16)]
        else:
            raw[pos:pos] = rng.randbytes(rng.randint(1, 8))
    return bytes(raw)


def _fuzz_inputs(rng: random.Random, doc: dict, n: int):
    for _ in range(n):
        if rng.random() < 0.25:
            yield _mutate_bytes(rng, _pack(doc))
        else:
            mutated = _mutate_tree(rng, copy.deepcopy(doc))
            try:
                yield _pack(mutated)
            except (OverflowError, TypeError, ValueError):  # not representable: nothing to feed
                continue


class FuzzTally:
    def __init__(self):
        self.tried = self.refused = self.accepted = 0
        self.foreign: list[str] = []

    def run(self, fn, data: bytes):
        self.tried += 1
        try:
            fn(data)
        except SpmdAotError:
            self.refused += 1
        except Exception as exc:  # a loader bug: foreign exception on malformed input
            self.foreign.append(f"{type(exc).__name__}: {str(exc)[:200]} <- {data[:300]!r}")
        else:
            self.accepted += 1


# Rounds per run of the suite; ``tools/fuzz/fuzz_artifacts.py`` runs the same fuzzers for thousands
# of rounds from any seed.
MANIFEST_ROUNDS, GRAPH_ROUNDS = 400, 1200


def fuzz_manifests(store: LocalStore, manifest_digest: str, rounds: int, seed: int) -> FuzzTally:
    """Mutated copies of a manifest through everything a job start reads from one."""
    tally = FuzzTally()

    def feed(data: bytes):
        digest = store.put(data)
        read_manifest(store, digest)
        load(store, digest)
        art = read_artifact(store, digest)
        art.plan, art.out_spec()  # what the runtime reads next

    for data in _fuzz_inputs(random.Random(seed), read_manifest(store, manifest_digest), rounds):
        tally.run(feed, data)
    return tally


def fuzz_graphs(store: LocalStore, manifest_digest: str, rounds: int, seed: int) -> FuzzTally:
    """Mutated copies of a graph doc through the decoder and ``Program``, then deep nestings."""
    graph_bytes = store.get(read_manifest(store, manifest_digest)["blobs"]["graph"])
    tally = FuzzTally()

    def feed(data: bytes):
        Program(decode_graph(data, groups=GROUPS, device=CPU), {})

    for data in _fuzz_inputs(random.Random(seed), _unpack(graph_bytes), rounds):
        tally.run(feed, data)
    for depth in (50, 200, 300):  # nesting the decoder and Program handle (deeper: see below)
        tally.run(feed, _pack(_nested_arg_graph(_unpack(graph_bytes), depth)))
    return tally


def test_fuzzed_manifests_raise_only_spmd_aot_errors(store, built):
    tally = fuzz_manifests(store, built[1], MANIFEST_ROUNDS, seed=7)
    print(f"\nmanifest fuzz: {tally.tried} tried, {tally.refused} refused, {tally.accepted} accepted, "
          f"{len(tally.foreign)} foreign exceptions")
    # Most accepted mutations land in ingredient_values, free-form JSON shown in miss messages.
    assert tally.tried >= MANIFEST_ROUNDS * 5 // 6 and tally.refused >= tally.tried // 3
    assert tally.foreign == [], "\n".join(tally.foreign[:10])


def test_fuzzed_graphs_raise_only_spmd_aot_errors(store, built):
    tally = fuzz_graphs(store, built[1], GRAPH_ROUNDS, seed=11)
    print(f"\ngraph fuzz: {tally.tried} tried, {tally.refused} refused, {tally.accepted} accepted, "
          f"{len(tally.foreign)} foreign exceptions")
    assert tally.tried >= GRAPH_ROUNDS * 5 // 6 and tally.refused >= tally.tried // 2
    assert tally.foreign == [], "\n".join(tally.foreign[:10])


def _nested_arg_graph(doc: dict, depth: int) -> dict:
    value = {"~node": "arg0_1"}
    for _ in range(depth):
        value = {"~list": [value]}
    _first_call(doc)["args"] = [value]
    return doc


def test_deepest_graph_value_decode_accepts_is_refused_cleanly(store, built):
    for depth in range(1000, 0, -10):  # the deepest nesting decode_graph still accepts
        try:
            nodes = decode_graph(_pack(_nested_arg_graph(_graph(store, built), depth)), groups=GROUPS, device=CPU)
            break
        except (CorruptArtifactError, ValueError):  # too deep for the decoder (or for msgpack)
            continue
    try:
        Program(nodes, {})
    except SpmdAotError:
        pass  # refusing is fine; accepting is fine; any other exception is the bug


# ---------------------------------------------------------------- signing

@pytest.fixture
def signed(tmp_path, monkeypatch):
    """A cache with one artifact built and signed with key 'key-A'."""
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "key-A")
    result = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, cache_dir=tmp_path / "signed")
    return LocalStore(tmp_path / "signed"), result.digest


def test_signed_artifact_loads_with_its_key_and_without_any(signed, monkeypatch):
    store, digest = signed
    kid, mac = signing.split(store.get(digest), "manifest")[0]
    assert len(kid) == 16 and len(mac) == 64
    assert load(store, digest).n_ops > 0  # key-A is set
    monkeypatch.delenv(signing.ENV_SIGNING_KEY)
    assert load(store, digest).n_ops > 0  # no key: the signature is ignored
    assert "signature" not in read_manifest(store, digest)  # it sits beside the body, not in it


def test_unsigned_artifact_refused_when_a_key_is_set(store, built, monkeypatch):
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "key-A")
    with pytest.raises(SignatureError) as info:
        load(store, built[1])
    msg = str(info.value)
    assert built[1] in msg and "unsigned" in msg and "Rebuild" in msg and signing.ENV_SIGNING_KEY in msg
    assert isinstance(info.value, CorruptArtifactError)
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "")  # empty counts as unset
    assert load(store, built[1]).n_ops > 0


def test_wrong_key_refused(signed, monkeypatch):
    store, digest = signed
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "key-B")
    with pytest.raises(SignatureError) as info:
        load(store, digest)
    msg = str(info.value)
    assert digest in msg and "signature mismatch" in msg and "another key" in msg and "Rebuild" in msg


def test_modified_signed_manifest_refused(signed):
    store, digest = signed
    data = store.get(digest)
    (kid, mac), body = signing.split(data, "manifest")
    header = data[: len(data) - len(body)]
    manifest = _unpack(body)

    def resigned(m):  # the original signature line over another body
        return header + _pack(m)

    cases = {  # each returns the forged manifest blob
        "stats changed": lambda m: resigned(m["stats"].update(nodes=m["stats"]["nodes"] + 1) or m),
        "graph swapped": lambda m: resigned(m["blobs"].update(graph=m["blobs"]["code"]) or m),
        "mac bit flipped": lambda m: header.replace(mac.encode(), format(int(mac, 16) ^ 1, "064x").encode()) + body,
        "fields reordered": lambda m: resigned(dict(reversed(list(m.items())))),
        "signature removed": lambda m: signing.wrap(body),
        "signed with another key": lambda m: signing.wrap(body, b"key-B"),
    }
    for mutate in cases.values():
        forged = store.put(mutate(copy.deepcopy(manifest)))  # under its own digest
        assert forged != digest
        with pytest.raises(SignatureError, match="unsigned|mismatch"):
            read_manifest(store, forged)
    garbled = store.put(data.replace(b"hmac-sha256", b"hmac-sha1", 1))
    with pytest.raises(CorruptArtifactError, match="not a manifest"):
        read_manifest(store, garbled)


def test_bit_flips_in_a_signed_manifest_are_all_refused(signed, monkeypatch):
    """Flip one bit, store the result under its own name (the hash check cannot help):
    with the key every flip is refused; without it some would load."""
    store, digest = signed
    data = store.get(digest)
    rng = random.Random(3)
    refused_with_key, loaded_without_key = 0, 0
    positions = rng.sample(range(len(data) * 8), 300)
    for pos in positions:
        raw = bytearray(data)
        raw[pos // 8] ^= 1 << (pos % 8)
        forged = store.put(bytes(raw))
        monkeypatch.setenv(signing.ENV_SIGNING_KEY, "key-A")
        try:
            read_manifest(store, forged)
        except CorruptArtifactError:
            refused_with_key += 1
        monkeypatch.delenv(signing.ENV_SIGNING_KEY)
        try:
            read_manifest(store, forged)
            loaded_without_key += 1
        except CorruptArtifactError:
            pass
    print(f"\nsigned manifest bit flips: {len(positions)} tried, {refused_with_key} refused with the key, "
          f"{loaded_without_key} would load without it")
    assert refused_with_key == len(positions)
    assert loaded_without_key > 0  # the signature is what catches those


def test_tampered_graph_loads_unsigned_but_not_signed(signed, monkeypatch):
    """The threat signing answers: a consistent, allowlisted but altered graph + manifest."""
    store, digest = signed
    monkeypatch.delenv(signing.ENV_SIGNING_KEY)
    doc = _unpack(store.get(read_manifest(store, digest)["blobs"]["graph"]))
    node = next(n for n in doc["nodes"] if n["target"] == "aten::relu.default")
    node["target"] = "aten::neg.default"  # allowlisted, so only the signature can object
    manifest = read_manifest(store, digest)
    manifest["blobs"]["graph"] = store.put(_pack(doc))
    forged = store.put(pack_manifest(manifest))
    assert load(store, forged).n_ops > 0  # without a key, a consistent forgery loads
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "key-A")
    with pytest.raises(SignatureError, match="unsigned"):
        load(store, forged)


def test_signing_helpers_are_deterministic_and_key_bound():
    body = _pack({"format": 3, "key": "k", "stats": {"x": 1.5}})
    a1, a2 = signing.wrap(body, b"A"), signing.wrap(body, b"A")
    b = signing.wrap(body, b"B")
    assert a1 == a2 and a1 != b
    assert signing.sign_manifest_blob(a1, b"A") == a1  # re-signing replaces, never nests
    assert signing.sign_manifest_blob(signing.wrap(body), b"A") == a1
    assert signing.verified_body(a1, "d" * 64, b"A") == body
    with pytest.raises(SignatureError):
        signing.verified_body(a1, "d" * 64, b"B")
    assert hashlib.sha256(a1).hexdigest() != hashlib.sha256(signing.wrap(body)).hexdigest()


# ---------------------------------------------------------------- damaged entries are rebuilt
def test_build_rebuilds_an_entry_with_a_missing_part(store, built):
    manifest = read_manifest(store, built[1])
    store.delete(manifest["blobs"]["graph"])
    again = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, store=store)
    assert again.traced  # the damaged entry was not taken for a hit
    read_artifact(store, again.digest).program(GROUPS, CPU)


def test_ref_to_another_keys_manifest_is_not_served(store, built, tmp_path):
    other = spmd_aot.build(make_job("mlp", "adamw"), world_size=2, store=store)
    key = read_manifest(store, built[1])["key"]
    store.set_ref(key, other.digest)  # a ref that names a valid manifest of another key
    again = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, store=store)
    assert again.traced and read_manifest(store, store.get_ref(key))["key"] == key


@pytest.mark.parametrize("mutate", [
    lambda layout: layout.update(inputs=[0] * len(layout["inputs"])),
    lambda layout: layout.update(outputs={}),
    lambda layout: layout["outputs"].update(spec="not a spec"),
    lambda layout: layout["inputs"][0].update(local_shape="3x4"),
    lambda layout: layout["outputs"].update(gradients={"0": True}),
    lambda layout: layout["outputs"].update(gradients=[[len(layout["inputs"]), True]]),
    lambda layout: layout["outputs"].update(gradients=[[0, True], [0, False]]),
], ids=["inputs-not-maps", "no-outputs", "bad-spec", "shape-not-list", "gradients-not-list",
        "gradient-of-no-parameter", "gradient-twice"])
def test_malformed_layout_is_refused_on_read(store, built, mutate):
    manifest = read_manifest(store, built[1])
    layout = _unpack(store.get(manifest["blobs"]["layout"]))
    mutate(layout)
    manifest["blobs"]["layout"] = store.put(_pack(layout))
    digest = store.put(pack_manifest(manifest))
    with pytest.raises(CorruptArtifactError, match="layout|spec"):
        read_artifact(store, digest)
