"""No symbolic link inside a cache is ever followed.

Someone with write access to a shared cache plants a link at every place the layout has (each
subdirectory, a fan-out directory, a blob, a ref, a ``used/`` stamp, a lease, a build lock, a
temp file), pointing at a directory or file outside the cache. Then every operation runs:
load (lease, read, touch), build (lock, write, clean temp files), gc evicting everything,
``rm``, verify. Each may succeed or refuse with an ``SpmdAotError``; none may read, create,
change or delete anything outside the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import pytest

from support.jobs import build_unsigned
from spmd_aot.entries import read_artifact, read_manifest
from spmd_aot.cli.app import main as cli
from spmd_aot.errors import SpmdAotError
from spmd_aot.store import LocalStore
from spmd_aot.store.eviction import collect_garbage
from spmd_aot.store.leases import reading, touch_used

OLD = time.time() - 7200  # older than clean_tmp's hour


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    cache = tmp_path_factory.mktemp("links") / "cache"
    result = build_unsigned(cache)
    store = LocalStore(cache)
    touch_used(store, result.key)
    return cache, result.key, result.digest


def _snapshot(root) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            data = b""
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    data = f.read()
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime, hashlib.sha256(data).hexdigest())
    return out


def _outside(tmp_path, digest: str):
    """A directory outside the cache that looks like cache contents (so a followed link would act)."""
    out = tmp_path / "outside"
    out.mkdir()
    for name in ("victim", digest[2:], f"{digest}.lock", "gc.lock", "x.lock", "somekey", "a.tmp"):
        (out / name).write_bytes(b"not yours\n")
        os.utime(out / name, (OLD, OLD))
    return out


def _places(key: str, digest: str, part: str) -> dict:
    """place -> (path inside the cache, link target relative to the outside dir or None for the dir)."""
    return {
        "tmp/": ("tmp", None), "used/": ("used", None), "leases/": ("leases", None), "locks/": ("locks", None),
        "refs/": ("refs", None), "quarantine/": ("quarantine", None), "objects/": ("objects", None),
        "objects/<fan>/": (f"objects/{digest[:2]}", None),
        "objects/<fan>/<blob>": (f"objects/{part[:2]}/{part[2:]}", "victim"),
        "refs/<key>": (f"refs/{key}", "victim"),
        "used/<key>": (f"used/{key}", "created-by-touch"),
        "leases/<digest>.lock": (f"leases/{digest}.lock", "created-by-lease"),
        "leases/gc.lock": ("leases/gc.lock", "created-by-gc"),
        "locks/<key>.lock": (f"locks/{key}.lock", "created-by-lock"),
        "tmp/<file>": ("tmp/planted.1.2.deadbeef.tmp", "victim"),
    }


def _attempt(results: list, what: str, fn) -> None:
    try:
        fn()
        results.append((what, "ok"))
    except SpmdAotError as exc:  # refusing is fine; an OSError or a followed link is not
        results.append((what, f"refused: {str(exc)[:80]}"))


@pytest.mark.parametrize("place", list(_places("k", "0" * 64, "1" * 64)))
def test_planted_link_is_never_followed(pristine, tmp_path, place, capsys):
    src, key, digest = pristine
    cache = tmp_path / "cache"
    shutil.copytree(src, cache, symlinks=True)
    part = read_manifest(LocalStore(cache), digest)["blobs"]["graph"]
    outside = _outside(tmp_path, digest)
    inside, target = _places(key, digest, part)[place]
    path = cache / inside
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside if target is None else outside / target, path)
    before = _snapshot(outside)

    results: list = []
    store = LocalStore(cache)

    def load():
        with reading(store, digest):
            read_artifact(store, digest).check()
        touch_used(store, key)

    def build():
        with store.lock(key):
            store.set_ref("another", store.put(b"new blob"))
        store.clean_tmp(older_than=0)

    _attempt(results, "load", load)
    _attempt(results, "build", build)
    _attempt(results, "verify", store.verify)
    _attempt(results, "rm", lambda: cli(["rm", "another", "--cache-dir", str(cache)]))
    _attempt(results, "gc", lambda: collect_garbage(store, max_age=0))
    capsys.readouterr()
    assert _snapshot(outside) == before, f"{place}: something outside the cache changed: {results}"
    assert os.path.islink(path), f"{place}: the planted link itself was replaced or removed: {results}"
    print(f"{place}: {results}")


def test_verify_reports_a_planted_link(pristine, tmp_path, capsys):
    src, key, digest = pristine
    cache = tmp_path / "cache"
    shutil.copytree(src, cache, symlinks=True)
    outside = _outside(tmp_path, digest)
    os.symlink(outside / "victim", cache / "refs" / "planted")
    assert cli(["verify", "--cache-dir", str(cache)]) == 1
    assert "refs/planted" in capsys.readouterr().out


def test_a_linked_refs_directory_is_reported_not_listed(pristine, tmp_path, capsys):
    """Listing refs (Store.ref_keys) refuses a linked refs/ instead of listing what it points at
    or answering "no artifacts" (which would let gc sweep every blob)."""
    src, key, digest = pristine
    cache = tmp_path / "cache"
    shutil.copytree(src, cache, symlinks=True)
    outside = _outside(tmp_path, digest)
    shutil.rmtree(cache / "refs")
    os.symlink(outside, cache / "refs")
    capsys.readouterr()
    assert cli(["verify", "--cache-dir", str(cache)]) == 1
    assert f"{cache / 'refs'} is a symbolic link" in capsys.readouterr().out
    assert cli(["ls", "--cache-dir", str(cache)]) == 2
    assert f"{cache / 'refs'} is a symbolic link" in capsys.readouterr().err
    with pytest.raises(SpmdAotError, match="symbolic link"):
        collect_garbage(LocalStore(cache), max_age=0)
    assert LocalStore(cache).has(digest)
