"""The conformance check every store backend passes (``spmd_aot.store.protocol.Store``): run it on
an empty store of a new backend. test_store_protocol.py runs it on the local, memory and layered
stores, test_s3.py on S3Store and on an s3:// LayeredStore against a moto server."""

from __future__ import annotations

import hashlib

import pytest

from spmd_aot.errors import CorruptArtifactError, LockTimeoutError, SpmdAotError
from spmd_aot.store import LocalStore
from spmd_aot.store.protocol import CAPABILITIES, HOLDS, LOCAL_FILES, Store, holds, local_files

BAD_KEYS = ["", "../escape", "a/b", ".hidden", "x" * 201, "with space", "back\\slash", None]
BAD_DIGESTS = ["", "../" + "a" * 61, "A" * 64, "a" * 63, "g" * 64, "ab" * 32 + "/", None]


def check_store_contract(store) -> None:
    """Assert every required member of ``Store`` behaves as its contract says on the empty
    ``store``, that bad names are refused, and that its declared capabilities are real."""
    assert isinstance(store, Store), f"{store!r} lacks required members of spmd_aot.store.Store"
    assert store.capabilities <= CAPABILITIES, store.capabilities
    assert str(store.root)
    assert store.location is None or isinstance(store.location, str)
    assert list(store.blobs()) == [] and store.refs() == {} and store.ref_keys() == []

    # blobs: named by their sha256, idempotent, verified on read
    a, b = b"alpha", b"beta" * 1000
    da, db = hashlib.sha256(a).hexdigest(), hashlib.sha256(b).hexdigest()
    assert store.put(a) == da and store.put(a) == da and store.put(b) == db
    empty = store.put(b"")
    assert store.get(da) == a and store.get(db) == b and store.get(empty) == b""
    assert store.has(da) and store.size(db) == len(b) and store.size(empty) == 0
    assert list(store.blobs()) == sorted([da, db, empty])
    missing = "ab" * 32
    assert not store.has(missing) and store.size(missing) is None
    with pytest.raises(CorruptArtifactError, match=missing):
        store.get(missing)

    # refs: opaque keys, sorted listings, repointing
    store.set_ref("k.0", db)
    store.set_ref("k-1", da)
    assert store.get_ref("k-1") == da and store.get_ref("absent") is None
    assert store.refs() == {"k-1": da, "k.0": db} and list(store.refs()) == ["k-1", "k.0"]
    assert store.ref_keys() == ["k-1", "k.0"]
    store.set_ref("k-1", db)
    assert store.get_ref("k-1") == db

    # names are checked before storage is touched (names.py)
    for key in BAD_KEYS:
        for call in (lambda: store.set_ref(key, da), lambda: store.get_ref(key), lambda: store.delete_ref(key)):
            with pytest.raises(SpmdAotError, match="invalid store key"):
                call()
        with pytest.raises(SpmdAotError, match="invalid store key"):
            with store.lock(key, timeout=1):
                pass
    for digest in BAD_DIGESTS:
        for call in (lambda: store.get(digest), lambda: store.has(digest), lambda: store.size(digest),
                     lambda: store.delete(digest), lambda: store.set_ref("k", digest)):
            with pytest.raises(CorruptArtifactError, match="invalid blob digest"):
                call()
    assert store.ref_keys() == ["k-1", "k.0"] and list(store.blobs()) == sorted([da, db, empty])

    # locks: exclusive (a second taker times out while the first holds it), then released
    with store.lock("k-1", timeout=5):
        with pytest.raises(LockTimeoutError):
            with store.lock("k-1", timeout=0.2):
                pass
    with store.lock("k-1", timeout=5):
        pass

    # verify: a clean store has no problems; a ref to a missing blob is one
    assert store.verify() == []
    store.set_ref("dangling", missing)
    problems = store.verify()
    assert problems and {p.digest for p in problems} == {missing}, problems
    assert all("points to missing blob" in p.reason for p in problems), problems
    store.delete_ref("dangling")

    # deletes are idempotent
    store.delete_ref("k.0")
    store.delete_ref("k.0")
    store.delete(empty)
    store.delete(empty)
    assert store.ref_keys() == ["k-1"] and not store.has(empty) and store.get_ref("k.0") is None

    # declared capabilities are real, undeclared ones answer "no"
    if HOLDS in store.capabilities:
        assert store.holds(da, a) and not store.holds(da, b"not alpha") and not store.holds(missing, a)
    else:
        assert not holds(store, da, a)
    if LOCAL_FILES in store.capabilities:
        local = local_files(store)
        assert isinstance(local, LocalStore) and local.blob_path(db).is_file()
    else:
        assert local_files(store) is None
