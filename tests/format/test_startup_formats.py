"""What makes a first load fast must not make it check less: the load check runs foreach ops
index by index through its memo (``validate._check_foreach``) and gets exactly what the whole
call's meta kernel gives; the records' and the signed program part's compact forms (a tuple or
list of references in one map, each distinct tensor description stored once) read back to the
same values, and a position outside its table is refused, not followed."""

from __future__ import annotations

import msgpack
import pytest
import torch

from spmd_aot.errors import CorruptArtifactError, UnsafeArtifactError
from spmd_aot.entries import program_blob, read_artifact, read_manifest
from spmd_aot.format import records, signing, validate
from spmd_aot.format.serialize import DecodedNode, Ref
from spmd_aot.interpreter.invariants import describe

aten = torch.ops.aten
META = torch.device("meta")

# (shape, dtype) of the graph's inputs: three "parameters" of two shapes, their gradients and
# states, as an optimizer's foreach calls see them
SHAPES = [[4, 3], [3], [4, 3]]
LAYOUT = [(s, "float32") for s in SHAPES] * 3 + [([], "float32")]


def _graph(calls):
    nodes = [DecodedNode("placeholder", f"x{i}", f"x{i}", (), {}) for i in range(len(LAYOUT))]
    for name, op, args, kwargs in calls:
        nodes.append(DecodedNode("call_function", name, op, args, kwargs))
    nodes.append(DecodedNode("output", "output", "output", ([Ref(len(nodes) - 1)],), {}))
    return nodes, [{"local_shape": s, "dtype": d} for s, d in LAYOUT]


def _lists():
    p, g, s = ([Ref(k * 3 + i) for i in range(3)] for k in range(3))
    return p, g, s, Ref(9)


def _calls():
    p, g, s, scalar = _lists()
    return [("inplace", aten._foreach_addcmul_.Scalar, (p, g, s), {"value": 0.5}),
            ("outofplace", aten._foreach_mul.List, (p, g), {}),
            ("by_tensor", aten._foreach_mul.Tensor, (s, scalar), {}),
            ("scalars", aten._foreach_add_.ScalarList, (s, [1.0, 2.0, 3.0]), {}),
            ("pow", aten._foreach_pow.ScalarAndTensor, (2.0, g), {}),
            ("norm", aten._foreach_norm.Scalar, (p,), {}),
            ("sqrt", aten._foreach_sqrt.default, (s,), {})]


def _whole(op, args, kwargs):
    """The op's meta kernel on the whole call, as the check ran it before splitting."""
    env = [torch.empty(s, device=META) for s, _ in LAYOUT]

    def meta(v):
        if isinstance(v, Ref):
            return env[v.index]
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        return v
    return op(*meta(args), **meta(kwargs))


@pytest.mark.parametrize("call", _calls(), ids=lambda c: c[0])
def test_a_foreach_call_checked_index_by_index_gives_the_whole_calls_meta_result(call):
    nodes, inputs = _graph([call])
    env = validate.check_graph(nodes, {}, inputs, device_type="cpu")
    assert describe(env[len(LAYOUT)]) == describe(_whole(*call[1:]))


def test_repeated_shapes_run_the_meta_kernel_once_per_distinct_index(monkeypatch):
    """An index's result is worked out (by its meta kernel, or by a shape rule where one answers:
    ``format/shape_rules.py``) once per distinct signature; the memo answers the rest."""
    runs = []
    real, rule = validate.check_node, validate.foreach_index

    def counting(node, *a, **k):
        runs.append(node.name)
        return real(node, *a, **k)

    def counting_rule(op, *a):
        value = rule(op, *a)
        if value is not validate.DECLINE:
            runs.append(op)
        return value
    monkeypatch.setattr(validate, "check_node", counting)
    monkeypatch.setattr(validate, "foreach_index", counting_rule)
    nodes, inputs = _graph(_calls()[:1])
    validate.check_graph(nodes, {}, inputs, device_type="cpu")
    assert runs == [aten._foreach_addcmul_.Scalar] * 2  # indices 0 and 2 share shapes: the memo answers index 2


@pytest.mark.parametrize("call", _calls(), ids=lambda c: c[0])
def test_an_index_key_is_the_signature_of_the_index_call_it_stands_for(call):
    """``_index_key`` builds index k's memo key without building its call: it must be exactly the
    signature of the call ``_element`` builds (tensors collected in the same order: ``_rebuild``
    and aliasing read their positions)."""
    _, op, args, kwargs = call
    env = [torch.empty(s, device=META) for s, _ in LAYOUT]
    args, kwargs = validate._meta_value(args, env), validate._meta_value(kwargs, env)
    found, n = validate._elements(op, args, kwargs)
    parts = validate._index_key_parts(args, kwargs, found, {})
    for k in range(n):
        eargs, ekwargs = validate._element(args, kwargs, found, k)
        want_tensors, want_storages, tensors, storages = [], {}, [], {}
        want = (id(op), validate._signature(eargs, want_tensors, want_storages, {}),
                validate._signature(ekwargs, want_tensors, want_storages, {}))
        assert validate._index_key(op, parts, k, tensors, storages, {}) == want
        assert [id(t) for t in tensors] == [id(t) for t in want_tensors] and storages == want_storages


def test_a_keyed_argument_is_its_meta_value_and_that_values_signature():
    """``_keyed`` walks a decoded argument once for what ``_meta_value`` and ``_signature`` give."""
    env = [torch.empty(s, device=META) for s, _ in LAYOUT]
    env.append([env[0], env[1]])  # a multi-output result read whole
    view = env[0][1:]
    env.append(view)  # a view: shares its storage with input 0
    for value in [(Ref(0), Ref(0), Ref(11)), (Ref(1), [Ref(2), 2.0, -0.0], {"alpha": 1, "out": Ref(11)}),
                  (Ref(10), True, None, "mean", torch.float32), (slice(1, None), torch.device("cpu"), float("nan")),
                  ({1, 2},), ([Ref(0)], (Ref(3), 1, 1.0))]:
        want_tensors, want_storages, tensors, storages = [], {}, [], {}
        meta = validate._meta_value(value, env)
        try:
            want = validate._signature(meta, want_tensors, want_storages, {})
        except TypeError:
            want = None
        got_meta, got = validate._keyed(value, env, tensors, storages, {})
        assert repr(got_meta) == repr(meta) and got == want
        if want is not None:
            assert [id(t) for t in tensors] == [id(t) for t in want_tensors] and storages == want_storages


def test_the_whole_calls_contract_still_refuses_a_mismatched_index():
    p, g, s, _ = _lists()
    g = [g[0], g[0], g[2]]  # index 1: a [4, 3] gradient for a [3] parameter
    nodes, inputs = _graph([("bad", aten._foreach_addcmul_.Scalar, (p, g, s), {"value": 0.5})])
    with pytest.raises(UnsafeArtifactError, match="bad .*would broadcast"):
        validate.check_graph(nodes, {}, inputs, device_type="cpu")


def test_lists_of_different_lengths_run_whole_and_are_refused():
    p, g, s, _ = _lists()
    nodes, inputs = _graph([("short", aten._foreach_mul.List, (p, g[:2]), {})])
    with pytest.raises(UnsafeArtifactError, match="short"):
        validate.check_graph(nodes, {}, inputs, device_type="cpu")


def test_records_keep_tuples_and_lists_of_references_and_everything_else():
    value = ((Ref(1), Ref(2)), [Ref(3)], [], (), (4, 5), [(True, 1)], {"a": [Ref(1), 2]},
             (torch.float32, -1), slice(1, None), torch.device("cpu"), ("=", 1), ("=", True))
    back = records.decode(records.encode(value))
    assert repr(back) == repr(value)
    assert type(back[1]) is list and type(back[0]) is tuple and type(back[-1][1]) is bool


@pytest.mark.parametrize("tag", ["T", "R"])
def test_a_reference_list_of_other_than_indices_is_refused(tag):
    for bad in ([-1], [1.5], ["x"], 3):
        with pytest.raises(CorruptArtifactError):
            records.decode(msgpack.packb({tag: bad}))


def test_interned_descriptions_come_back_in_order_and_positions_are_checked():
    a, b = ((4, 3), (3, 1), torch.float32), ((3,), (1,), torch.bfloat16)
    values = [a, None, b, a, [a, b], ("=", 1), ("=", True), a]
    table, ids = records.interned(values)
    assert len(table) == 6 and ids[0] == ids[3] == ids[7]
    assert records.expanded(*records.decode(records.encode((table, ids))), "test") == values
    with pytest.raises(ValueError, match="outside"):
        records.expanded(table, (len(table),), "test")
    with pytest.raises(ValueError, match="outside"):
        records.expanded(table, (-1,), "test")


def test_a_signed_part_naming_an_expectation_outside_its_table_is_refused(tmp_path, monkeypatch):
    import spmd_aot
    from spmd_aot.store import LocalStore
    from support.jobs import load_job

    key = "startup-formats-key"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, key)
    spmd_aot.build(load_job(), world_size=1, cache_dir=tmp_path / "c")
    store = LocalStore(tmp_path / "c")
    digest = store.get_ref(store.ref_keys()[0])
    artifact = read_artifact(store, digest)
    doc = records.decode(artifact.program_blob[len(program_blob.MAGIC):])
    table = list(doc["table"])
    step = next(s for s in table[6] if s[6] is not None)
    k = table[6].index(step)
    table[6] = (*table[6][:k], (*step[:6], len(table[8]) + 5), *table[6][k + 1:])
    forged = program_blob.MAGIC + records.encode(dict(doc, table=tuple(table)))
    body = msgpack.unpackb(signing.split(store.get(digest), "manifest")[1], raw=False)
    body["blobs"][program_blob.PART] = store.put(forged)
    resigned = store.put(signing.wrap(msgpack.packb(body, use_bin_type=True), key.encode()))
    assert read_manifest(store, resigned)["blobs"][program_blob.PART] != artifact.manifest["blobs"][program_blob.PART]
    with pytest.raises(CorruptArtifactError, match="expectation .* outside the table"):
        program_blob.program(read_artifact(store, resigned), [], torch.device("cpu"))
