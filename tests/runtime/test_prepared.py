"""A hit keeps its built program in a per-user record and later hits rebuild it from there
without decoding the graph: same results as a decode and as eager; a torn, forged or foreign
record, an op off the allowlist, or a folder others can write means a full decode instead."""

from __future__ import annotations

import hashlib
import os
import pickle

import msgpack
import pytest
import torch

import spmd_aot
from spmd_aot.errors import CorruptArtifactError
from spmd_aot.format import records, serialize
from spmd_aot.format.limits import ENV_LOAD_LIMITS
from spmd_aot.format.serialize import Ref
from spmd_aot.interpreter import program_form
from spmd_aot.runtime import prepared
from spmd_aot.interpreter.program import Program, ProgramTable
from support.jobs import hit_and_eager, load_job


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    spmd_aot.build(load_job(), world_size=1, cache_dir=tmp_path / "cache")
    return tmp_path / "cache"


@pytest.fixture
def decodes(monkeypatch):
    """How many times a load decoded a stored graph."""
    calls = []
    real = serialize.decode_graph

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr("spmd_aot.entries.artifact.decode_graph", counted)
    return calls


def _stored(path):
    """The record's content, as ``prepared.load`` reads it."""
    return records.decode(path.read_bytes()[len(prepared._MAGIC) + 32:])


def _records():
    folder = prepared.record_dir()
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_a_second_hit_rebuilds_the_program_from_the_record_with_the_same_results(cache, decodes):
    first, first_losses, eager, eager_losses = hit_and_eager(cache)
    assert len(decodes) == 1 and len(_records()) == 1
    second, second_losses, _, _ = hit_and_eager(cache)
    assert len(decodes) == 1  # rebuilt from the record: no decode
    assert second_losses == first_losses  # bit-identical to the decoded program's
    for a, b, e in zip(first, second, eager):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert first_losses == pytest.approx(eager_losses, rel=1e-5)


def test_the_rebuilt_program_folds_and_checks_as_the_decoded_one(cache):
    hit_and_eager(cache, steps=1)
    (path,) = _records()
    table = program_form.table_from_stored(_stored(path))
    assert isinstance(table, ProgramTable) and table.folds  # the causal mask is folded
    program = Program.from_table(table, {})
    assert program.n_folded == len(table.folds) > 0
    # the embedding's backward keeps its run-time index check when rebuilt
    checked = [fn for fn, *_ in program._steps if type(fn).__name__ == "_ValueChecked"]
    assert checked and all(fn.__name__ == "aten::embedding_dense_backward.default" for fn in checked)
    # and every run-time invariant (invariants.py): the expected metadata is in the record
    assert program.n_checked > 100 and all(len(f) == 2 or f[4] is not None for f in table.folds)


def _rewrite(path, body: bytes) -> None:
    path.write_bytes(prepared._MAGIC + hashlib.sha256(body).digest() + body)


def test_a_torn_or_corrupted_record_is_ignored_and_replaced(cache, decodes):
    first, *_ = hit_and_eager(cache, steps=1)
    (path,) = _records()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    again, *_ = hit_and_eager(cache, steps=1)
    assert len(decodes) == 2  # the damaged record was not used
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    path.write_bytes(path.read_bytes()[:100])  # torn
    hit_and_eager(cache, steps=1)
    assert len(decodes) == 3 and len(_records()) == 1  # a whole record again


def test_a_forged_record_runs_nothing(cache, decodes, tmp_path):
    hit_and_eager(cache, steps=1)
    (path,) = _records()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    _rewrite(path, pickle.dumps(Payload()))  # a valid checksum: only the reader stands guard
    hit_and_eager(cache, steps=1)
    assert not marker.exists() and len(decodes) == 2
    # msgpack that names a callable: a tag the reader does not know, refused
    _rewrite(path, msgpack.packb({"f": ["os", "system", f"touch {marker}"]}))
    hit_and_eager(cache, steps=1)
    assert not marker.exists() and len(decodes) == 3


def test_an_op_off_the_allowlist_in_a_record_is_refused(cache, decodes):
    hit_and_eager(cache, steps=1)
    (path,) = _records()
    plain = list(_stored(path))
    steps = list(plain[6])
    steps[0] = ("aten::_local_scalar_dense.default", *steps[0][1:])  # not on the allowlist
    plain[6] = tuple(steps)
    _rewrite(path, records.encode(tuple(plain)))
    hit_and_eager(cache, steps=1)
    assert len(decodes) == 2  # refused, decoded instead


def test_a_record_holds_only_tagged_plain_data_refs_slices_and_torch_enums():
    value = (1, 2.5, "s", None, True, [Ref(3), slice(1, None, 2)], {"k": torch.float16},
             torch.channels_last, torch.strided, torch.device("cpu"), float("-inf"), -0.0, ((2, 3), (3, 1)))
    back = records.decode(records.encode(value))
    assert back[:5] == value[:5] and back[5][0].index == 3 and back[5][1] == slice(1, None, 2)
    assert back[6]["k"] is torch.float16 and back[7] is torch.channels_last and back[8] is torch.strided
    assert back[9] == torch.device("cpu") and back[10] == float("-inf") and str(back[11]) == "-0.0"
    assert back[12] == ((2, 3), (3, 1)) and type(back[12][0]) is tuple and type(back[5]) is list
    for unstored in (os.getcwd, torch.zeros(1), Program, {1: 2}, b"bytes"):
        with pytest.raises(TypeError):
            records.encode(unstored)
    for hostile in ({"f": "os.system"}, {"d": "Tensor"}, {"d": "float32", "t": []}, {"r": -1},
                    {"m": ["contiguous_format"]}, msgpack.ExtType(1, b"x")):
        with pytest.raises((ValueError, CorruptArtifactError)):
            records.decode(msgpack.packb(hostile))
    with pytest.raises(CorruptArtifactError):  # trailing bytes, not msgpack: the bounded decoder's refusal
        records.decode(records.encode(1) + b"\x00")


def test_a_record_folder_others_can_write_is_neither_read_nor_written(cache, decodes):
    hit_and_eager(cache, steps=1)
    os.chmod(prepared.record_dir(), 0o777)
    hit_and_eager(cache, steps=1)
    assert len(decodes) == 2
    for path in _records():
        path.unlink()
    hit_and_eager(cache, steps=1)
    assert _records() == []


def test_records_are_named_by_artifact_checker_groups_and_device(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    cpu = torch.device("cpu")
    base = prepared._name("a" * 64, ["0"], cpu)
    assert base == prepared._name("a" * 64, ["0"], cpu)  # no process-random state
    assert len({base, prepared._name("b" * 64, ["0"], cpu), prepared._name("a" * 64, ["1"], cpu),
                prepared._name("a" * 64, ["0"], torch.device("meta"))}) == 4
    monkeypatch.setenv(ENV_LOAD_LIMITS, "tensor_factor=32")
    assert prepared._name("a" * 64, ["0"], cpu) != base  # other load limits: another checker


def test_only_the_most_recent_records_are_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(prepared, "MAX_RECORDS", 2)
    table = ProgramTable(1, 1, 0, (), (), Ref(0), ())
    for i in range(4):
        prepared.save(f"{i:064x}", [], torch.device("cpu"), table)
        assert prepared.load(f"{i:064x}", [], torch.device("cpu")) is not None
    assert len(_records()) == 2
    assert prepared.load(f"{0:064x}", [], torch.device("cpu")) is None


def test_a_record_that_does_not_fit_its_artifact_is_dropped(cache, decodes):
    first, *_ = hit_and_eager(cache, steps=1)
    (path,) = _records()
    plain = list(_stored(path))
    plain[3] = ((0, "not_a_stored_constant"),)  # names a constant the artifact does not hold
    _rewrite(path, records.encode(tuple(plain)))
    again, *_ = hit_and_eager(cache, steps=1)
    assert len(decodes) == 2 and all(torch.equal(a, b) for a, b in zip(first, again))


def test_gloo_ranks_of_a_later_job_rebuild_from_records_and_match_ddp(tmp_path, monkeypatch):
    from support.jobs import make_job
    from support.jobs import ddp_and_loaded_counting_decodes
    from support.multiproc import run_ranks

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    spmd_aot.build(make_job("transformer", "adamw"), world_size=2, cache_dir=tmp_path / "cache")
    first = run_ranks(ddp_and_loaded_counting_decodes, 2, str(tmp_path / "cache"))
    assert sum(r["decodes"] for r in first) >= 1 and len(_records()) == 1  # both ranks: cpu, same groups
    second = run_ranks(ddp_and_loaded_counting_decodes, 2, str(tmp_path / "cache"))
    for r in first + second:
        assert r["hit"] and r["param"] <= 1e-5 and r["state"] <= 1e-5 and r["loss"] <= 1e-5, r
    assert [r["decodes"] for r in second] == [0, 0]
