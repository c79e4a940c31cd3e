"""A signed entry carries its checked program (``entries/program_blob.py``): a job that verifies
the signature builds its program from it, on a fresh node too (no per-user records), with no
graph decode and no meta check, and gets the same bits as the full check; a tampered part is
refused, an unsigned entry's part is never read, and entries without the part load as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest
import torch

import spmd_aot
from spmd_aot.errors import CorruptArtifactError
from spmd_aot.entries import artifact as artifact_module
from spmd_aot.entries import program_blob
from spmd_aot.format import serialize, signing
from spmd_aot.entries import read_artifact, read_manifest
from spmd_aot.store import LocalStore
from support.jobs import hit_and_eager, load_job

KEY = "signing-test-key"


def _build(cache_dir):
    spmd_aot.build(load_job(), world_size=1, cache_dir=cache_dir)
    store = LocalStore(cache_dir)
    (key,) = store.ref_keys()
    return store, key, store.get_ref(key)


@pytest.fixture
def state(tmp_path, monkeypatch):
    """An empty per-user state folder: every load below is a first load on a fresh node."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def signed(tmp_path, state, monkeypatch):
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, KEY)
    return _build(tmp_path / "signed")


@pytest.fixture
def checks(monkeypatch):
    """How many times a load decoded a stored graph and ran the meta check."""
    calls = {"decode": 0, "meta": 0}
    real_decode = serialize.decode_graph
    from spmd_aot.format import validate

    real_check = validate.check_graph

    def decode(*a, **k):
        calls["decode"] += 1
        return real_decode(*a, **k)

    def meta(*a, **k):
        calls["meta"] += 1
        return real_check(*a, **k)
    monkeypatch.setattr(artifact_module, "decode_graph", decode)
    monkeypatch.setattr(validate, "check_graph", meta)
    return calls


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _rewrite_manifest(store, digest, change, key: bytes | None):
    """A new manifest: ``digest``'s content changed by ``change``, signed with ``key`` (or
    unsigned), stored and named by the ref. Returns its digest."""
    body = signing.split(store.get(digest), "manifest")[1]
    manifest = msgpack.unpackb(body, raw=False)
    change(manifest)
    new = store.put(signing.wrap(msgpack.packb(manifest, use_bin_type=True), key))
    store.set_ref(manifest["key"], new)
    return new


def test_a_signed_entry_loads_its_program_without_decode_or_meta_check_and_matches_the_full_check(
        signed, tmp_path, monkeypatch, checks):
    store, key, digest = signed
    manifest = read_manifest(store, digest)
    assert program_blob.PART in manifest["blobs"]  # the builder stored the checked program
    params, losses, eager_params, eager_losses = hit_and_eager(tmp_path / "signed")
    assert checks == {"decode": 0, "meta": 0}
    assert not (tmp_path / "state" / "spmd_aot").exists()  # no per-user record was read or needed
    for p, e in zip(params, eager_params):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)
    # the same entry checked in full (no key: the part is never read) gives the same bits
    monkeypatch.delenv(signing.ENV_SIGNING_KEY)
    assert read_artifact(store, digest).program_blob is None
    full_params, full_losses, *_ = hit_and_eager(tmp_path / "signed")
    assert checks["decode"] == 1 and checks["meta"] == 1
    assert _same(params, full_params) and losses == full_losses
    assert losses == pytest.approx(eager_losses, rel=1e-5)


def test_the_stored_program_is_the_table_a_full_load_builds(signed):
    """Bound to the live (here: no) groups and the device, the part's table is exactly the one
    the decode + meta check path builds, run-time invariants' expectations included."""
    store, key, digest = signed
    art = read_artifact(store, digest)
    from_part = program_blob.program(art, [], torch.device("cpu")).table
    full = art.program([], torch.device("cpu")).table
    from spmd_aot.format import records
    from spmd_aot.interpreter.program_form import stored_form

    # compared in stored form: ops by name (value-checked ops are wrappers), refs by index
    assert records.encode(stored_form(from_part)) == records.encode(stored_form(full))
    assert any(step[-1] is not None for step in from_part.steps)  # invariants stay on
    assert from_part.inputs


def test_a_fresh_process_with_empty_state_loads_a_signed_entry_without_the_checker(signed, tmp_path):
    """A cold process, empty $XDG_STATE_HOME: the checker's module is never imported."""
    code = f"""
import json, sys, torch
sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
from support.jobs import load_objects
import spmd_aot
from spmd_aot.examples.models import train_step
model, optim, batch = load_objects()
step = spmd_aot.compile(train_step, cache_dir={str(tmp_path / 'signed')!r}, require_hit=True)
loss = float(step(model, optim, batch))
print(json.dumps({{"validate": "spmd_aot.format.validate" in sys.modules,
                  "hit": step.cache_info.hit, "loss": loss}}))
"""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "fresh-state"), signing.ENV_SIGNING_KEY: KEY}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hit"] and not result["validate"], result


def test_a_tampered_program_part_is_refused(signed, tmp_path, monkeypatch):
    from spmd_aot.entries import check_entry

    store, key, digest = signed
    # 0. the program part is what a signed load runs: the graph, code and schema are read (and
    # re-hashed) only if asked for, so a damaged graph blob is refused when read, by verify too
    graph = read_manifest(store, digest)["blobs"]["graph"]
    path = store.blob_path(graph)
    os.chmod(path, 0o600)
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    art = read_artifact(store, digest)  # not read: the entry loads from its program part
    assert program_blob.program(art, [], torch.device("cpu")) is not None
    with pytest.raises(CorruptArtifactError, match=graph[:16]):
        art.graph  # noqa: B018
    with pytest.raises(CorruptArtifactError, match=graph[:16]):  # now quarantined: missing
        check_entry(store, key, digest)
    part = read_manifest(store, digest)["blobs"][program_blob.PART]
    # 1. the bytes changed in place: they no longer hash to the name the signed manifest pins
    path = store.blob_path(part)
    os.chmod(path, 0o600)
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    with pytest.raises(CorruptArtifactError, match="blob"):
        read_artifact(store, digest)
    # 2. a forged part named by an edited manifest: the signature no longer verifies
    forged = store.put(program_blob.MAGIC + b"\x80")

    def swap(m):
        m["blobs"][program_blob.PART] = forged
    new = _rewrite_manifest(store, digest, swap, None)
    with pytest.raises(signing.SignatureError):
        read_artifact(store, new)
    # ... signed with another key: refused too
    other = _rewrite_manifest(store, digest, swap, b"another key")
    with pytest.raises(signing.SignatureError, match="another key"):
        read_artifact(store, other)
    with pytest.raises(Exception, match="signature"):
        hit_and_eager(tmp_path / "signed", steps=1)


def test_an_unsigned_entry_with_a_forged_program_part_is_checked_in_full(tmp_path, state, checks):
    store, key, digest = _build(tmp_path / "plain")
    assert program_blob.PART not in read_manifest(store, digest)["blobs"]  # unsigned builds store none
    forged = store.put(program_blob.MAGIC + b"garbage that would fail any decode")

    def add(m):
        m["blobs"][program_blob.PART] = forged
    new = _rewrite_manifest(store, digest, add, None)
    assert read_artifact(store, new).program_blob is None  # never read without a verified signature
    checks.update(decode=0, meta=0)  # the build's own check is not the load's
    params, losses, eager_params, eager_losses = hit_and_eager(tmp_path / "plain")
    assert checks == {"decode": 1, "meta": 1}
    for p, e in zip(params, eager_params):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)


def test_a_signed_entry_without_the_part_still_loads_checked_in_full(signed, tmp_path, checks):
    """Entries stored before the part existed (or whose table has no stored form)."""
    store, key, digest = signed

    def drop(m):
        del m["blobs"][program_blob.PART]
    _rewrite_manifest(store, digest, drop, KEY.encode())
    params, losses, eager_params, _ = hit_and_eager(tmp_path / "signed")
    assert checks == {"decode": 1, "meta": 1}
    for p, e in zip(params, eager_params):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)


def test_a_part_of_other_builder_code_is_ignored(signed, tmp_path, monkeypatch, checks):
    monkeypatch.setattr(program_blob, "_identity", lambda: "another builder")
    first, *_ = hit_and_eager(tmp_path / "signed", steps=1)
    assert checks == {"decode": 1, "meta": 1}


def test_gloo_ranks_bind_the_stored_program_to_their_live_groups_and_match_ddp(tmp_path, monkeypatch):
    from support.jobs import make_job
    from support.jobs import ddp_and_loaded_counting_decodes
    from support.multiproc import run_ranks

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, KEY)
    spmd_aot.build(make_job("transformer", "adamw"), world_size=2, cache_dir=tmp_path / "cache")
    results = run_ranks(ddp_and_loaded_counting_decodes, 2, str(tmp_path / "cache"))
    for r in results:
        assert r["hit"] and r["decodes"] == 0, r
        assert r["param"] <= 1e-5 and r["state"] <= 1e-5 and r["loss"] <= 1e-5, r


def test_verify_refuses_a_signed_part_that_is_not_what_the_graph_gives(signed):
    """``check_entry`` (``spmd-aot verify``, and a build that finds the entry) compares the part
    with the program this code builds from the graph; a re-signed, altered table is refused."""
    from spmd_aot.format import records
    from spmd_aot.entries import check_entry

    store, key, digest = signed
    check_entry(store, key, digest)  # the stored part is exactly what the graph gives
    art = read_artifact(store, digest)
    doc = records.decode(art.program_blob[len(program_blob.MAGIC):])
    table = list(doc["table"])
    table[2] += 1  # one op more than the graph has
    doc["table"] = tuple(table)
    altered = store.put(program_blob.MAGIC + records.encode(doc))

    def swap(m):
        m["blobs"][program_blob.PART] = altered
    new = _rewrite_manifest(store, digest, swap, KEY.encode())
    with pytest.raises(CorruptArtifactError, match="not the program its graph gives"):
        check_entry(store, key, new)


def test_a_two_dimensional_mesh_binds_each_dimension_to_its_live_group(tmp_path, state, monkeypatch):
    """HSDP on a (2, 2) mesh: the part names its groups by mesh dimension, and a load binds
    each to that dimension's live group exactly as decoding the graph does."""
    from spmd_aot.format import records
    from spmd_aot.interpreter.program_form import stored_form
    from support.jobs import make_job

    monkeypatch.setenv(signing.ENV_SIGNING_KEY, KEY)
    spmd_aot.build(make_job("transformer", "adamw"), world_size=4, placement="shard", mesh_shape=(2, 2),
                   cache_dir=tmp_path / "hsdp")
    store = LocalStore(tmp_path / "hsdp")
    (key,) = store.ref_keys()
    art = read_artifact(store, store.get_ref(key))
    doc = records.decode(art.program_blob[len(program_blob.MAGIC):])
    assert doc["mesh_dims"] == 2 and doc["bind"]  # collectives hold group placeholders
    live = ["live-group-of-dim-0", "live-group-of-dim-1"]
    from_part = program_blob.program(art, live, torch.device("cpu")).table
    full = art.program(live, torch.device("cpu")).table
    assert records.encode(stored_form(from_part)) == records.encode(stored_form(full))
    stored = records.encode(stored_form(from_part))
    assert b"live-group-of-dim-0" in stored and b"live-group-of-dim-1" in stored
    assert program_blob.GROUP_PREFIX.encode() not in stored  # no placeholder left unbound
