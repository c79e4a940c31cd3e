"""An untrusted cache, part 2: files that are not what the layout says (FIFOs, huge sparse
files, traversing guard paths, oversized bundle members) and the rule for caches others can
write. Every call that could hang runs with a deadline, so a hang fails instead of hanging."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import threading
import tracemalloc

import pytest

from support.jobs import build_unsigned, make_job
from spmd_aot.keying import guards
from spmd_aot.format import signing
from spmd_aot.entries import read_artifact, read_manifest
from spmd_aot.format.artifact import pack_manifest
from spmd_aot.cli.app import main as cli
from spmd_aot.errors import CorruptArtifactError
from spmd_aot.store import LocalStore
from spmd_aot.store.bundle import BundleError, import_bundle
from spmd_aot.store.leases import touch_used
from spmd_aot.store.trust import ENV_TRUST_CACHE, UntrustedCacheError

DEADLINE = 30


def within(fn, *args, seconds: float = DEADLINE, **kwargs):
    """``fn(*args)``'s result or exception, failing the test if it has not returned in time."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 (handed back to the test)
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s (it hangs)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("trust-files")
    return cache, build_unsigned(cache).digest


@pytest.fixture
def store(built, tmp_path, monkeypatch):
    monkeypatch.delenv(signing.ENV_SIGNING_KEY, raising=False)
    monkeypatch.delenv(ENV_TRUST_CACHE, raising=False)
    shutil.copytree(built[0], tmp_path / "cache")
    return LocalStore(tmp_path / "cache")


def _fifo_at(path):
    path.unlink(missing_ok=True)
    os.mkfifo(path)


# ---------------------------------------------------------------- 4. FIFOs never block
def test_fifo_at_a_ref_a_blob_or_a_last_use_record_does_not_hang(store, built):
    key = next(iter(store.refs()))
    _fifo_at(store.root / "refs" / key)
    with pytest.raises(CorruptArtifactError, match="not a regular file"):
        within(store.get_ref, key)
    part = read_manifest(store, built[1])["blobs"]["graph"]
    _fifo_at(store.blob_path(part))
    with pytest.raises(CorruptArtifactError, match="not a regular file"):
        within(read_artifact, store, built[1])
    (store.root / "used").mkdir(exist_ok=True)
    _fifo_at(store.root / "used" / key)
    within(touch_used, store, key)  # quietly not recorded
    assert stat.S_ISFIFO(os.lstat(store.root / "used" / key).st_mode)
    assert within(cli, ["verify", "--cache-dir", str(store.root)]) == 1
    within(cli, ["gc", "--max-age", "0", "--dry-run", "--cache-dir", str(store.root)])


def test_a_huge_sparse_blob_is_refused_unread(store, built):
    part = read_manifest(store, built[1])["blobs"]["layout"]
    os.truncate(store.blob_path(part), 8 << 30)  # 8 GiB on paper, nothing on disk
    tracemalloc.start()
    try:
        with pytest.raises(CorruptArtifactError, match="more than the load limit|more than the"):
            within(read_artifact, store, built[1])
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()
    problems = within(store.verify)
    assert any("larger than any blob a load reads" in p.reason for p in problems)


# ---------------------------------------------------------------- 3. guards stay inside sys.path
def test_guard_path_with_dotdot_is_refused(store, built):
    manifest = read_manifest(store, built[1])
    manifest["guards"]["files"] = [["../../../../etc/hostname", "0" * 64]]
    digest = store.put(pack_manifest(manifest))
    with pytest.raises(CorruptArtifactError, match="not a plain relative path"):
        read_manifest(store, digest)
    opened = []
    real_open = os.open
    try:
        os.open = lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)
        why = guards.check({"files": [["../../../../etc/hostname", "0" * 64]], "distributions": [],
                            "tensors": []}, None)
    finally:
        os.open = real_open
    assert "not a plain relative path" in why and opened == []


def test_guard_file_that_is_a_fifo_or_huge_fails_the_guard(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    os.mkfifo(root / "trust_fifo_guard.py")
    with open(root / "trust_sparse_guard.py", "wb") as f:
        f.truncate(16 << 30)
    outside = tmp_path / "secret.py"
    outside.write_text("x = 1\n")
    (root / "pkg").mkdir()
    (root / "pkg" / "leak.py").symlink_to(outside)
    empty = {"distributions": [], "tensors": []}
    why = within(guards.check, {"files": [["trust_fifo_guard.py", "0" * 64]], **empty}, None)
    assert why is not None and ("not found" in why or "not a regular file" in why)
    assert "not a regular file" in within(guards._guard_digest, str(root / "trust_fifo_guard.py"))[1]
    why = within(guards.check, {"files": [["trust_sparse_guard.py", "0" * 64]], **empty}, None)
    assert "guard_file_bytes" in why
    digest = hashlib.sha256(outside.read_bytes()).hexdigest()
    why = within(guards.check, {"files": [["pkg/leak.py", digest]], **empty}, None)
    assert why is not None and "not found" in why  # a link out of its sys.path entry is not followed


# ---------------------------------------------------------------- 5. bundles are streamed within limits
def _tar_with_header(path, name: str, size: int, extra: bytes = b""):
    """A tar whose one member claims ``size`` bytes; the file is sparse (holes, not data)."""
    info = tarfile.TarInfo(name)
    info.size = size
    header = info.tobuf(tarfile.PAX_FORMAT)
    with open(path, "wb") as f:
        f.write(header)
        f.write(extra)
        f.truncate(len(header) + size + (-size % 512) + 1024)


def test_bundle_member_larger_than_any_load_is_refused_before_reading(store, tmp_path):
    bundle = tmp_path / "big.tar"
    _tar_with_header(bundle, "objects/" + "0" * 64, 5 << 30)
    assert os.stat(bundle).st_blocks * 512 < 1 << 20  # small on disk
    with pytest.raises(BundleError, match="more than"):
        within(import_bundle, store, bundle)


def test_bundle_members_are_streamed_into_the_store(store, tmp_path):
    size = 64 << 20
    digest = hashlib.sha256(bytes(size)).hexdigest()
    index = json.dumps({"format": "spmd-aot-bundle", "version": 1, "refs": {}, "blobs": {digest: size}}).encode()
    bundle = tmp_path / "stream.tar"
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("index.json")
        info.size = len(index)
        tar.addfile(info, io.BytesIO(index))
        info = tarfile.TarInfo("objects/" + digest)
        info.size = size
        tar.addfile(info, io.BytesIO(bytes(size)))
    tracemalloc.start()
    try:
        within(import_bundle, store, bundle, seconds=120)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert store.size(digest) == size
    assert peak < size // 2, f"import held {peak >> 20} MiB for a {size >> 20} MiB member"


def test_bundle_index_with_deep_nesting_or_arrays_is_refused(store, tmp_path):
    for raw in (b"{" * 100_000, b'{"format": [[[]]]}'):
        bundle = tmp_path / "index.tar"
        with tarfile.open(bundle, "w") as tar:
            info = tarfile.TarInfo("index.json")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
        with pytest.raises(BundleError, match="index.json"):
            within(import_bundle, store, bundle)


# ---------------------------------------------------------------- 7. caches others can write
def test_a_cache_others_can_write_is_refused_without_a_key_or_opt_in(tmp_path, monkeypatch):
    monkeypatch.delenv(signing.ENV_SIGNING_KEY, raising=False)
    monkeypatch.delenv(ENV_TRUST_CACHE, raising=False)
    cache = tmp_path / "shared"
    LocalStore(cache).put(b"x")  # created 0755 whatever the umask
    assert stat.S_IMODE(os.stat(cache).st_mode) & 0o022 == 0
    os.chmod(cache, 0o775)
    with pytest.raises(UntrustedCacheError) as info:
        LocalStore(cache)
    msg = str(info.value)
    assert str(cache) in msg and "group" in msg and "0775" in msg
    assert ENV_TRUST_CACHE in msg and "--trust-cache" in msg and signing.ENV_SIGNING_KEY in msg
    assert cli(["verify", "--cache-dir", str(cache)]) == 2
    assert cli(["verify", "--trust-cache", "--cache-dir", str(cache)]) == 0
    assert os.environ.get(ENV_TRUST_CACHE) is None  # the flag lasts one command
    LocalStore(cache, trust_cache=True)
    monkeypatch.setenv(ENV_TRUST_CACHE, "1")
    LocalStore(cache)
    monkeypatch.delenv(ENV_TRUST_CACHE)
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "key-A")  # only signed entries load: fine
    LocalStore(cache)


def test_build_and_compile_take_trust_cache(tmp_path, monkeypatch):
    import spmd_aot

    monkeypatch.delenv(signing.ENV_SIGNING_KEY, raising=False)
    monkeypatch.delenv(ENV_TRUST_CACHE, raising=False)
    cache = tmp_path / "shared"
    LocalStore(cache).put(b"x")
    os.chmod(cache, 0o775)
    with pytest.raises(UntrustedCacheError):
        spmd_aot.build(make_job("mlp", "sgd"), world_size=1, cache_dir=cache)
    spmd_aot.build(make_job("mlp", "sgd"), world_size=1, cache_dir=cache, trust_cache=True)
    with pytest.raises(UntrustedCacheError):
        _ = spmd_aot.compile(lambda m, o, b: None, cache_dir=cache).store  # opening the store refuses
    assert spmd_aot.compile(lambda m, o, b: None, cache_dir=cache, trust_cache=True).store is not None


def test_subdirectories_owners_and_ancestors_are_checked(tmp_path, monkeypatch):
    monkeypatch.delenv(signing.ENV_SIGNING_KEY, raising=False)
    monkeypatch.delenv(ENV_TRUST_CACHE, raising=False)
    cache = tmp_path / "mine"
    store = LocalStore(cache)
    digest = store.put(b"blob")
    fan = cache / "objects" / digest[:2]
    os.chmod(fan, 0o777)
    with pytest.raises(UntrustedCacheError, match="writable by group and others"):
        LocalStore(cache).get(digest)
    os.chmod(fan, 0o755)
    assert LocalStore(cache).get(digest) == b"blob"
    if os.getuid() == 0:  # as root, give a directory to someone else
        os.chown(fan, 12345, -1)
        with pytest.raises(UntrustedCacheError, match="owned by uid 12345"):
            LocalStore(cache).get(digest)
        os.chown(fan, 0, -1)
    parent = tmp_path / "open-parent"
    parent.mkdir()
    LocalStore(parent / "cache")
    os.chmod(parent, 0o777)  # anyone may rename the cache away: refused
    with pytest.raises(UntrustedCacheError, match="ancestor"):
        LocalStore(parent / "cache")
    os.chmod(parent, 0o1777)  # sticky, like /tmp: others cannot rename what they do not own
    LocalStore(parent / "cache")
