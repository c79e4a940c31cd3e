"""Tests for spmd_aot.store: content addressing, corruption handling, refs, locks, concurrency."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing as mp
import os
import pathlib
import threading
import time

import pytest

from spmd_aot.errors import CacheIOError, CorruptArtifactError, LockTimeoutError, SpmdAotError
from spmd_aot.store import BlobProblem, LocalStore, resolve_cache_dir

PKG_DIR = pathlib.Path(__file__).resolve().parents[2] / "spmd_aot"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _flip_byte(path: pathlib.Path, offset: int = 0) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture
def store(tmp_path: pathlib.Path) -> LocalStore:
    return LocalStore(tmp_path / "cache")


# ---------------------------------------------------------------- child processes
#
# Spawned children run `exec(<source>, globals)` rather than a function from this module:
# unpickling a function would import this module, hence the whole `spmd_aot` package (which
# imports torch), in each of 8 children. Instead each child imports `spmd_aot.store` under a
# bare package stub with `import torch` blocked, which keeps the test fast and proves that the
# store works in a process without torch.

_CHILD_PRELUDE = """
import hashlib, os, sys, types
_pkg = types.ModuleType("spmd_aot")
_pkg.__path__ = [PKG_DIR]
sys.modules["spmd_aot"] = _pkg
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from spmd_aot.store import LocalStore
"""

_PUT_CHILD = """
try:
    data = hashlib.sha256(str(seed).encode()).digest() * (size // 32)
    s = LocalStore(root)
    barrier.wait(timeout=30)
    digests = set()
    for _ in range(3):
        d = s.put(data)
        s.set_ref("shared-ref", d)
        assert s.get(d) == data
        assert s.get_ref("shared-ref") == d
        digests.add(d)
    results.put((os.getpid(), sorted(digests)))
except BaseException as e:  # report instead of leaving the parent waiting
    results.put((os.getpid(), f"error: {e!r}"))
    raise
"""

_HOLD_LOCK_CHILD = """
s = LocalStore(root)
with s.lock(key, timeout=30):
    acquired.set()
    release.wait(timeout=30)
"""


def _child(ctx, body: str, **names):
    """A spawned process that runs ``body`` with ``LocalStore`` and ``names`` in scope."""
    env = {"PKG_DIR": str(PKG_DIR), **names}
    return ctx.Process(target=exec, args=(_CHILD_PRELUDE + body, env))


# ---------------------------------------------------------------- blobs


def test_put_get_round_trip_and_digest_is_sha256(store: LocalStore) -> None:
    data = b"hello spmd-aot\x00\xff" * 1000
    digest = store.put(data)
    assert digest == _sha(data)
    assert store.get(digest) == data
    assert store.has(digest)
    path = store.blob_path(digest)
    assert path == store.root / "objects" / digest[:2] / digest[2:]
    assert path.read_bytes() == data


def test_put_is_idempotent(store: LocalStore) -> None:
    data = b"same bytes"
    d1 = store.put(data)
    ino = store.blob_path(d1).stat().st_ino
    d2 = store.put(data)
    assert d1 == d2
    assert list(store.blobs()) == [d1]
    # A good existing copy is left alone, not rewritten.
    assert store.blob_path(d1).stat().st_ino == ino
    assert list((store.root / "tmp").iterdir()) == []


def test_empty_blob(store: LocalStore) -> None:
    d = store.put(b"")
    assert d == _sha(b"")
    assert store.get(d) == b""


def test_layout_created_at_init(tmp_path: pathlib.Path) -> None:
    s = LocalStore(tmp_path / "a" / "b")
    for name in ("objects", "refs", "locks", "tmp", "quarantine"):
        assert (s.root / name).is_dir(), name
    assert s.root.is_absolute()


def test_blobs_lists_digests_and_delete(store: LocalStore) -> None:
    ds = sorted(store.put(bytes([i]) * 10) for i in range(5))
    assert list(store.blobs()) == ds
    store.delete(ds[0])
    assert not store.has(ds[0])
    assert list(store.blobs()) == ds[1:]
    store.delete(ds[0])  # absent: no error
    with pytest.raises(CorruptArtifactError, match="missing"):
        store.get(ds[0])


def test_corrupted_blob_is_detected_and_quarantined(store: LocalStore) -> None:
    data = os.urandom(4096)
    digest = store.put(data)
    path = store.blob_path(digest)
    _flip_byte(path, 100)
    actual = _sha(path.read_bytes())
    assert actual != digest

    # verify() reports it and does not move anything.
    problems = store.verify()
    assert problems == [BlobProblem(digest, str(path), f"content hashes to {actual}")]
    assert path.exists()

    with pytest.raises(CorruptArtifactError) as ei:
        store.get(digest)
    msg = str(ei.value)
    assert str(path) in msg and digest in msg and actual in msg

    # Moved aside: no longer served, kept for inspection, store is clean again.
    assert not path.exists()
    assert not store.has(digest)
    quarantined = list((store.root / "quarantine").iterdir())
    assert len(quarantined) == 1
    assert quarantined[0].name.startswith(digest + ".")
    assert str(quarantined[0]) in msg
    assert _sha(quarantined[0].read_bytes()) == actual
    assert store.verify() == []

    # A second get now reports the blob as missing; a new put repairs it.
    with pytest.raises(CorruptArtifactError, match=f"blob {digest} missing at"):
        store.get(digest)
    assert store.put(data) == digest
    assert store.get(digest) == data


def test_truncated_blob_detected(store: LocalStore) -> None:
    data = os.urandom(10_000)
    digest = store.put(data)
    path = store.blob_path(digest)
    with open(path, "r+b") as f:
        f.truncate(5000)
    assert [p.reason for p in store.verify()] == [f"content hashes to {_sha(data[:5000])}"]
    with pytest.raises(CorruptArtifactError, match="corrupt"):
        store.get(digest)
    assert not path.exists()


def test_put_repairs_damaged_copy(store: LocalStore) -> None:
    data = os.urandom(2048)
    digest = store.put(data)
    _flip_byte(store.blob_path(digest))
    assert store.put(data) == digest
    assert store.verify() == []
    assert store.get(digest) == data


def test_missing_blob_message(store: LocalStore) -> None:
    digest = _sha(b"never stored")
    with pytest.raises(CorruptArtifactError) as ei:
        store.get(digest)
    assert str(ei.value) == f"blob {digest} missing at {store.blob_path(digest)}"
    assert not store.has(digest)


@pytest.mark.parametrize(
    "bad", ["", "abc", "A" * 64, "g" * 64, "0" * 63, "0" * 65, "../" + "0" * 61, None]
)
def test_invalid_digest_rejected(store: LocalStore, bad) -> None:
    with pytest.raises(CorruptArtifactError, match="invalid blob digest"):
        store.get(bad)
    with pytest.raises(CorruptArtifactError):
        store.blob_path(bad)
    with pytest.raises(CorruptArtifactError):
        store.set_ref("k", bad)


def test_failed_write_leaves_no_temp_file(store: LocalStore, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(CacheIOError, match=r"cannot write .*objects.*simulated\) \(ENOSPC\); the filesystem is full"):
        store.put(b"payload")
    monkeypatch.undo()
    assert list((store.root / "tmp").iterdir()) == []
    assert list(store.blobs()) == []


def test_verify_reports_dangling_ref_and_junk(store: LocalStore) -> None:
    good = store.put(b"good")
    missing = _sha(b"gone")
    store.set_ref("points-nowhere", missing)
    store.set_ref("ok", good)
    junk = store.root / "objects" / "zz" / "not-a-digest"
    junk.parent.mkdir()
    junk.write_bytes(b"x")
    stray = store.root / "objects" / "stray.txt"
    stray.write_bytes(b"y")
    problems = store.verify()
    assert BlobProblem(missing, str(store.root / "refs" / "points-nowhere"),
                       "ref points-nowhere points to missing blob") in problems
    assert BlobProblem("zznot-a-digest", str(junk), "bad name") in problems
    assert BlobProblem("stray.txt", str(stray), "bad name") in problems
    assert len(problems) == 3
    assert list(store.blobs()) == [good]


# ---------------------------------------------------------------- refs


def test_refs_set_get_delete_list(store: LocalStore) -> None:
    d1, d2 = store.put(b"one"), store.put(b"two")
    assert store.get_ref("b-key") is None
    store.set_ref("b-key", d1)
    store.set_ref("a.key_1", d2)
    assert store.get_ref("b-key") == d1
    assert (store.root / "refs" / "b-key").read_text() == d1 + "\n"
    refs = store.refs()
    assert refs == {"a.key_1": d2, "b-key": d1}
    assert list(refs) == ["a.key_1", "b-key"]  # sorted by key

    store.set_ref("b-key", d2)  # overwrite
    assert store.get_ref("b-key") == d2
    store.delete_ref("b-key")
    assert store.get_ref("b-key") is None
    store.delete_ref("b-key")  # absent: no error
    assert store.refs() == {"a.key_1": d2}
    assert list((store.root / "tmp").iterdir()) == []


def test_damaged_ref_file(store: LocalStore) -> None:
    (store.root / "refs" / "k").write_text("garbage\n")
    with pytest.raises(CorruptArtifactError, match="refs/k"):
        store.get_ref("k")
    assert any("ref k is damaged" in p.reason for p in store.verify())


@pytest.mark.parametrize(
    "key", ["../evil", "a/b", "", ".hidden", "..", ".", "a\\b", "x" * 201, "sp ace", "é", None]
)
def test_invalid_keys_rejected(store: LocalStore, tmp_path: pathlib.Path, key) -> None:
    d = store.put(b"x")
    for call in (
        lambda: store.set_ref(key, d),
        lambda: store.get_ref(key),
        lambda: store.delete_ref(key),
        lambda: store.lock(key).__enter__(),
    ):
        with pytest.raises(SpmdAotError, match="invalid store key"):
            call()
    assert not (tmp_path / "evil").exists()
    assert not (store.root / "evil").exists()
    assert store.refs() == {}


def test_longest_valid_key(store: LocalStore) -> None:
    key = "k" * 200
    d = store.put(b"x")
    store.set_ref(key, d)
    assert store.get_ref(key) == d


# ---------------------------------------------------------------- cache dir


def test_resolve_cache_dir_precedence(monkeypatch, tmp_path: pathlib.Path) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SPMD_AOT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert resolve_cache_dir() == home / ".cache" / "spmd_aot"

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir() == tmp_path / "xdg" / "spmd_aot"

    monkeypatch.setenv("SPMD_AOT_CACHE_DIR", "~/envcache")
    assert resolve_cache_dir() == home / "envcache"

    assert resolve_cache_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert resolve_cache_dir("~/explicit") == home / "explicit"

    # Empty values count as unset; a relative XDG_CACHE_HOME is ignored (XDG spec).
    monkeypatch.setenv("SPMD_AOT_CACHE_DIR", "")
    assert resolve_cache_dir() == tmp_path / "xdg" / "spmd_aot"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert resolve_cache_dir() == home / ".cache" / "spmd_aot"

    assert not (home / ".cache").exists()  # resolving creates nothing


# ---------------------------------------------------------------- concurrency


def test_concurrent_put_same_blob_from_8_processes(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cache"
    LocalStore(root)
    ctx = mp.get_context("spawn")
    n, size = 8, 1 << 20
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [
        _child(ctx, _PUT_CHILD, root=str(root), seed=7, size=size, barrier=barrier, results=results)
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    for p in procs:  # results are tiny, so children can exit before the queue is drained
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * n
    out = [results.get(timeout=10) for _ in range(n)]
    expected = _sha(hashlib.sha256(b"7").digest() * (size // 32))
    assert len({pid for pid, _ in out}) == n
    assert all(ds == [expected] for _, ds in out)

    s = LocalStore(root)
    assert list(s.blobs()) == [expected]
    assert len(s.get(expected)) == size
    assert s.refs() == {"shared-ref": expected}
    assert s.verify() == []
    assert list((root / "tmp").iterdir()) == []
    assert list((root / "quarantine").iterdir()) == []


def test_concurrent_put_from_threads(store: LocalStore) -> None:
    blobs = [os.urandom(50_000) for _ in range(4)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for b in blobs:
                d = store.put(b)
                assert store.get(d) == b
                store.set_ref(f"t{i % 2}", d)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(store.blobs()) == sorted(_sha(b) for b in blobs)
    assert store.verify() == []
    assert list((store.root / "tmp").iterdir()) == []


def test_lock_timeout_when_another_process_holds_it(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cache"
    store = LocalStore(root, lock_timeout=0.5)
    ctx = mp.get_context("spawn")
    acquired, release = ctx.Event(), ctx.Event()
    holder = _child(
        ctx, _HOLD_LOCK_CHILD, root=str(root), key="build-x", acquired=acquired, release=release
    )
    holder.start()
    try:
        deadline = time.monotonic() + 30
        while not acquired.wait(timeout=0.05):
            assert holder.is_alive(), f"holder process died (exit code {holder.exitcode})"
            assert time.monotonic() < deadline, "holder process never took the lock"
        t0 = time.monotonic()
        with pytest.raises(LockTimeoutError) as ei:
            with store.lock("build-x"):  # default timeout from the store: 0.5 s
                pytest.fail("lock taken while another process holds it")
        elapsed = time.monotonic() - t0
        assert 0.4 <= elapsed < 5.0
        msg = str(ei.value)
        lock_path = root / "locks" / "build-x.lock"
        assert str(lock_path) in msg and "delete" in msg

        # An explicit timeout overrides the store's default (60 s here).
        patient = LocalStore(root, lock_timeout=60.0)
        t0 = time.monotonic()
        with pytest.raises(LockTimeoutError):
            with patient.lock("build-x", timeout=0.2):
                pass
        assert time.monotonic() - t0 < 10.0

        # Other keys are independent.
        with store.lock("build-y", timeout=1):
            pass
    finally:
        release.set()
        holder.join(timeout=30)
    assert holder.exitcode == 0
    with store.lock("build-x", timeout=5) as path:  # free again once the holder exits
        assert path == root / "locks" / "build-x.lock"


# ---------------------------------------------------------------- maintenance


def test_clean_tmp_removes_only_old_files(store: LocalStore) -> None:
    tmp = store.root / "tmp"
    old = [tmp / f"dead.{i}.tmp" for i in range(3)]
    for p in old:
        p.write_bytes(b"partial")
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    fresh = tmp / "inflight.tmp"
    fresh.write_bytes(b"writing")
    assert store.clean_tmp() == 3
    assert sorted(tmp.iterdir()) == [fresh]
    assert store.clean_tmp(older_than=0.0) == 1
    assert list(tmp.iterdir()) == []
    assert store.clean_tmp() == 0

