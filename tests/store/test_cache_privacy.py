"""A cache is private unless declared shared, and no other user can make the owner wait.

A new cache directory is 0700 and its lock and lease files 0600 (a cache declared shared with
``trust_cache`` / ``$SPMD_AOT_TRUST_CACHE``: 0755 and 0660), since ``flock`` needs only a
readable descriptor: any user who could open a lease file could hold it exclusively and fail the
owner's hits. A lease held anyway (a descriptor opened on a lease file an older release made
readable) delays a hit by ``leases.LEASE_WAIT`` at most; the hit then reads without a lease.

The other user is real: a child forked from the test drops to uid/gid 65534 (nobody) before it
touches the cache, so the kernel's permission checks apply (the tests that need it run as root).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time

import pytest

from support.jobs import compiled_run
from spmd_aot.store import LocalStore
from spmd_aot.store import leases
from spmd_aot.store.trust import ENV_TRUST_CACHE

NOBODY = 65534
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="needs root to act as a second user (setuid)")


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def other_user_locks(path):
    """A process of another user (uid 65534) that opens ``path`` read-only and takes an exclusive
    ``flock`` on it, holding it until the block ends. Yields what it got: ``"held"`` or
    ``"denied: <errno name>"``."""
    result_r, result_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: only system calls from here on, then _exit
        code = 0
        try:
            os.close(result_r)
            os.close(stop_w)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(result_w, b"held")
            except OSError as exc:
                os.write(result_w, f"denied: {errno.errorcode.get(exc.errno, exc.errno)}".encode())
            os.close(result_w)
            os.read(stop_r, 1)  # hold until the parent closes its end
        except BaseException:
            code = 1
        os._exit(code)
    os.close(result_w)
    os.close(stop_r)
    try:
        got = os.read(result_r, 200).decode()
        yield got
    finally:
        os.close(stop_w)
        os.close(result_r)
        os.waitpid(pid, 0)


@pytest.fixture
def readable_cache(monkeypatch):
    """A cache the owner made readable by everyone (0755, e.g. so other users' jobs can load
    from it), under a folder everyone can traverse (pytest's own tmp folders are 0700)."""
    monkeypatch.delenv(ENV_TRUST_CACHE, raising=False)
    base = tempfile.mkdtemp(prefix="spmd-aot-privacy-", dir="/tmp")
    os.chmod(base, 0o755)
    cache = os.path.join(base, "cache")
    LocalStore(cache)
    os.chmod(cache, 0o755)
    try:
        yield cache
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_new_cache_is_private_unless_declared_shared(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_TRUST_CACHE, raising=False)
    store = LocalStore(tmp_path / "new" / "cache")
    assert _mode(tmp_path / "new") == _mode(store.root) == 0o700
    digest = store.put(b"entry")
    with store.lock("some-key"), leases.reading(store, digest):
        assert _mode(store.root / "locks" / "some-key.lock") == 0o600
        assert _mode(store.root / "leases" / f"{digest}.lock") == 0o600

    shared = LocalStore(tmp_path / "shared", trust_cache=True)
    assert _mode(shared.root) & 0o077 == 0o055 & ~_umask()
    with shared.lock("some-key"):
        assert _mode(shared.root / "locks" / "some-key.lock") == 0o660 & ~_umask()  # the group's, not others'


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_an_older_readable_lock_file_is_narrowed_when_the_owner_opens_it(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_TRUST_CACHE, raising=False)
    store = LocalStore(tmp_path / "cache")
    (store.root / "locks").mkdir(exist_ok=True)
    old = store.root / "locks" / "k.lock"
    old.touch()
    os.chmod(old, 0o644)  # what releases before this one created
    with store.lock("k"):
        assert _mode(old) == 0o600


@as_root
def test_another_user_who_can_read_the_cache_cannot_hold_its_locks(readable_cache):
    store = LocalStore(readable_cache)
    digest = store.put(b"entry")
    with store.lock("some-key"), leases.reading(store, digest):
        pass  # both files exist now, made by their owner
    blob = store.blob_path(digest)
    with other_user_locks(blob) as got:
        assert got == "held"  # the cache is readable: the other user really reaches it
    for path in (store.root / "leases" / f"{digest}.lock", store.root / "locks" / "some-key.lock"):
        with other_user_locks(path) as got:
            assert got == "denied: EACCES", path
            start = time.monotonic()
            with leases.reading(store, digest, timeout=30), store.lock("some-key", timeout=30):
                pass
            assert time.monotonic() - start < 5


@as_root
def test_a_lease_held_by_another_user_delays_a_hit_by_the_lease_wait_at_most(readable_cache, monkeypatch, caplog):
    """The lease file of a built entry made readable (as releases before this one created it),
    and another user holding it exclusively: the owner's job still hits, LEASE_WAIT later
    (before: it waited 120 s, then failed)."""
    *_, info = compiled_run("mlp", "sgd", 0, 1, 1, readable_cache)  # world 1: traced and stored
    assert not info.hit
    store = LocalStore(readable_cache)
    digest = store.get_ref(info.key)
    lease = store.root / "leases" / f"{digest}.lock"
    os.chmod(lease, 0o644)
    monkeypatch.setattr(leases, "LEASE_WAIT", 1.0)
    caplog.set_level(logging.WARNING, logger="spmd_aot")
    with other_user_locks(lease) as got:
        assert got == "held"
        start = time.monotonic()
        *_, info = compiled_run("mlp", "sgd", 0, 1, 1, readable_cache)
        waited = time.monotonic() - start
        assert info.hit
        assert any("held exclusively" in r.getMessage() and str(lease) in r.getMessage() for r in caplog.records)
        assert _mode(lease) == 0o600  # narrowed by the owner's open: nobody else opens it again
        with other_user_locks(lease) as again:
            assert again == "denied: EACCES"
    assert waited < 30, f"the hit took {waited:.1f} s"
