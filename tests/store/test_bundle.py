"""Tests for ``spmd-aot export`` / ``spmd-aot import``: round trip, tampering, path traversal."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import tarfile

import pytest

import spmd_aot
from spmd_aot.entries import read_artifact
from spmd_aot.cli.app import main
from spmd_aot.store import LocalStore

from support.jobs import make_job


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> LocalStore:
    """A cache with the MLP/SGD job built for world sizes 1 and 2."""
    store = LocalStore(tmp_path_factory.mktemp("src"))
    job = make_job("mlp", "sgd")
    for world in (1, 2):
        spmd_aot.build(job, world_size=world, store=store)
    return store


@pytest.fixture(scope="module")
def bundle(source, tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("bundle") / "artifacts.tar"
    keys = list(source.refs())
    assert main(["export", *(k[:10] for k in keys), "-o", str(out), "--cache-dir", str(source.root)]) == 0
    return out


def _members(path: pathlib.Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(path) as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]


def _write_tar(path: pathlib.Path, members) -> pathlib.Path:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            info = tarfile.TarInfo(info.name) if isinstance(info, tarfile.TarInfo) and data is not None \
                else info
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def _empty(cache: pathlib.Path) -> bool:
    store = LocalStore(cache)
    return not store.refs() and not list(store.blobs())


# ---------------------------------------------------------------------------- round trip
def test_round_trip_into_an_empty_cache_then_verify_clean(source, bundle, tmp_path, capsys):
    dest = tmp_path / "dest"
    capsys.readouterr()
    assert main(["import", str(bundle), "--cache-dir", str(dest)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("imported 2 artifacts (11 blobs, 11 new,")
    store = LocalStore(dest)
    assert store.refs() == source.refs()
    assert set(store.blobs()) == set(source.blobs())
    assert main(["verify", "--cache-dir", str(dest)]) == 0
    assert capsys.readouterr().out.strip().endswith("11 blobs, 2 artifacts checked, 0 problems")
    for digest in store.refs().values():
        read_artifact(store, digest)  # every blob re-hashed, every field validated
    # importing again writes nothing new
    assert main(["import", str(bundle), "--cache-dir", str(dest)]) == 0
    assert "11 blobs, 0 new" in capsys.readouterr().out


def test_bundle_layout_and_reproducible_bytes(source, bundle, tmp_path):
    members = _members(bundle)
    names = [m.name for m, _ in members]
    assert names[0] == "index.json"
    assert all(n.startswith("objects/") and len(n) == 8 + 64 for n in names[1:])
    index = json.loads(members[0][1])
    assert index["format"] == "spmd-aot-bundle" and index["refs"] == source.refs()
    for m, data in members[1:]:
        assert hashlib.sha256(data).hexdigest() == m.name[len("objects/"):]
    again = tmp_path / "again.tar"
    assert main(["export", *source.refs(), "-o", str(again), "--cache-dir", str(source.root)]) == 0
    assert again.read_bytes() == bundle.read_bytes()


def test_compressed_bundle(source, tmp_path):
    out = tmp_path / "b.tar.gz"
    key = next(iter(source.refs()))
    assert main(["export", key, "-o", str(out), "--cache-dir", str(source.root)]) == 0
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    assert main(["import", str(out), "--cache-dir", str(tmp_path / "d")]) == 0
    assert LocalStore(tmp_path / "d").refs() == {key: source.refs()[key]}


# ---------------------------------------------------------------------------- refused bundles
def test_tampered_blob_is_refused_and_nothing_is_written(bundle, tmp_path, capsys):
    members = _members(bundle)
    # flip one byte of the largest blob, keeping its name
    i = max(range(1, len(members)), key=lambda j: len(members[j][1]))
    info, data = members[i]
    raw = bytearray(data)
    raw[len(raw) // 2] ^= 0x01
    members[i] = (info, bytes(raw))
    bad = _write_tar(tmp_path / "tampered.tar", members)
    dest = tmp_path / "dest"
    assert main(["import", str(bad), "--cache-dir", str(dest)]) == 2
    err = capsys.readouterr().err
    assert "tampered" in err and info.name in err
    assert _empty(dest)


def test_ref_to_another_keys_manifest_is_refused(bundle, tmp_path, capsys):
    members = _members(bundle)
    index = json.loads(members[0][1])
    (k1, d1), (k2, d2) = index["refs"].items()
    index["refs"] = {k1: d2, k2: d1}  # swapped: each key now names the other build
    members[0] = (members[0][0], json.dumps(index).encode())
    bad = _write_tar(tmp_path / "swapped.tar", members)
    assert main(["import", str(bad), "--cache-dir", str(tmp_path / "dest")]) == 2
    assert "manifest of another key" in capsys.readouterr().err
    assert _empty(tmp_path / "dest")


def test_index_must_list_exactly_the_blobs(bundle, tmp_path, capsys):
    members = _members(bundle)
    extra = b"smuggled"
    members.append((tarfile.TarInfo(f"objects/{hashlib.sha256(extra).hexdigest()}"), extra))
    bad = _write_tar(tmp_path / "extra.tar", members)
    assert main(["import", str(bad), "--cache-dir", str(tmp_path / "dest")]) == 2
    assert "does not match the blobs present" in capsys.readouterr().err


@pytest.mark.parametrize("name, kind", [
    ("../evil", "traversal"),
    ("objects/../../evil", "traversal"),
    ("/tmp/spmd_aot_evil_abs", "traversal"),
    ("link", "symlink"),
    ("objects/" + "a" * 64, "hardlink"),
    ("refs/evil", "unexpected"),
])
def test_path_traversal_and_links_are_refused(bundle, tmp_path, capsys, name, kind):
    members = _members(bundle)
    if kind == "symlink":
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, "../../etc/passwd"
        members.insert(1, (info, None))
    elif kind == "hardlink":
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.LNKTYPE, "/etc/passwd"
        members.insert(1, (info, None))
    else:
        members.insert(1, (tarfile.TarInfo(name), b"owned"))
    bad = _write_tar(tmp_path / "evil.tar", members)
    dest = tmp_path / "deep" / "dest"
    assert main(["import", str(bad), "--cache-dir", str(dest)]) == 2
    err = capsys.readouterr().err
    assert "refusing the bundle" in err or "unexpected member" in err
    assert name in err
    assert _empty(dest)
    assert not (tmp_path / "deep" / "evil").exists() and not (tmp_path / "evil").exists()
    assert not pathlib.Path("/tmp/spmd_aot_evil_abs").exists()
    assert sorted(p.name for p in (tmp_path / "deep").iterdir()) == ["dest"]


def test_not_a_bundle(tmp_path, capsys):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar file" * 50)
    assert main(["import", str(junk), "--cache-dir", str(tmp_path / "c")]) == 2
    assert "cannot read bundle" in capsys.readouterr().err


# ---------------------------------------------------------------------------- bounded work
def _shuffled_gzip_bundle(path: pathlib.Path, n: int, size: int) -> pathlib.Path:
    """A valid gzip bundle of ``n`` random blobs in an order unlike their digests'."""
    import random

    rng = random.Random(7)
    blobs = {hashlib.sha256(b).hexdigest(): b for b in (rng.randbytes(size) for _ in range(n))}
    index = json.dumps({"format": "spmd-aot-bundle", "version": 1, "refs": {},
                        "blobs": {d: size for d in blobs}}).encode()
    order = list(blobs)
    rng.shuffle(order)
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("index.json")
        info.size = len(index)
        tar.addfile(info, io.BytesIO(index))
        for d in order:
            info = tarfile.TarInfo(f"objects/{d}")
            info.size = size
            tar.addfile(info, io.BytesIO(blobs[d]))
    return path


def test_compressed_bundle_is_imported_in_two_forward_passes(tmp_path, monkeypatch):
    """Members in any order: the file is read twice from start to end, never seeked back (a
    seekable gzip stream re-decompresses from its start for every backwards seek)."""
    from spmd_aot.store import bundle as bundle_module

    path = _shuffled_gzip_bundle(tmp_path / "many.tar.gz", 300, 4096)
    opened, reads, seeks = [], [], []
    real_open = bundle_module._open_stream

    class Counted(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def readable(self):
            return True

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def readinto(self, b):
            data = self.read(len(b))
            b[:len(data)] = data
            return len(data)

        def seek(self, *a):  # tarfile's stream mode never seeks; count it if anything does
            seeks.append(a)
            return self.f.seek(*a)

        def close(self):
            self.f.close()
            super().close()

    def counted(p):
        opened.append(p)
        return Counted(real_open(p))

    monkeypatch.setattr(bundle_module, "_open_stream", counted)
    summary = bundle_module.import_bundle(LocalStore(tmp_path / "dest"), path)
    assert summary.blobs == summary.written == 300
    assert len(opened) == 2 and not seeks
    assert sum(reads) <= 2 * path.stat().st_size + 2 * (64 << 10)


def test_index_after_a_blob_is_refused(bundle, tmp_path, capsys):
    members = _members(bundle)
    members[0], members[1] = members[1], members[0]
    bad = _write_tar(tmp_path / "late-index.tar", members)
    assert main(["import", str(bad), "--cache-dir", str(tmp_path / "dest")]) == 2
    assert "not index.json" in capsys.readouterr().err
    assert _empty(tmp_path / "dest")
