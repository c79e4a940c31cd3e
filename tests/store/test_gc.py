"""Tests for ``spmd-aot rm`` / ``spmd-aot gc`` and the reader leases that keep gc safe."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import filelock
import pytest

import spmd_aot
from spmd_aot.cli.app import main
from spmd_aot.store import LocalStore
from spmd_aot.store.eviction import cache_size, collect_garbage, parse_age, parse_size
from spmd_aot.store.leases import ArtifactGoneError, last_used, reading, touch_used
from spmd_aot.store.transfer import artifact_blobs, copy_artifact

from support.jobs import make_job

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = [("sgd", 1), ("sgd", 2), ("adamw", 1), ("adamw", 2)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[LocalStore, list[str]]:
    """A cache with four MLP artifacts; returns (store, keys in CONFIGS order)."""
    store = LocalStore(tmp_path_factory.mktemp("pristine"))
    keys = [spmd_aot.build(make_job("mlp", optim), world_size=world, store=store).key
            for optim, world in CONFIGS]
    return store, keys


@pytest.fixture
def cache(pristine, tmp_path) -> tuple[LocalStore, list[str]]:
    src, keys = pristine
    shutil.copytree(src.root, tmp_path / "cache")
    return LocalStore(tmp_path / "cache"), keys


def _closure_bytes(store: LocalStore, keys) -> int:
    blobs = set()
    for key in keys:
        blobs |= set(artifact_blobs(store, store.get_ref(key)).values())
    return sum(store.blob_path(d).stat().st_size for d in blobs)


def _set_used(store: LocalStore, times: dict[str, float]) -> None:
    for key, t in times.items():
        touch_used(store, key)
        os.utime(store.root / "used" / key, (t, t))


def _verify_clean(store: LocalStore, capsys) -> None:
    capsys.readouterr()
    assert main(["verify", "--cache-dir", str(store.root)]) == 0, capsys.readouterr().out


# ---------------------------------------------------------------------------- parsing
def test_parse_size_and_age():
    assert parse_size("500M") == 500 << 20 and parse_size("2G") == 2 << 30
    assert parse_size("1.5GiB") == 3 << 29 and parse_size("100k") == 102400 and parse_size("0") == 0
    assert parse_age("7d") == 7 * 86400 and parse_age("12h") == 43200 and parse_age("30m") == 1800
    assert parse_age("45s") == 45 and parse_age("2w") == 14 * 86400
    for bad in ("", "12x", "-1G", "G"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_age("7 days")


def test_bad_bounds_exit_2(tmp_path, capsys):
    assert main(["gc", "--max-size", "lots", "--cache-dir", str(tmp_path)]) == 2
    assert "expected a size such as 500M" in capsys.readouterr().err


# ---------------------------------------------------------------------------- LRU and bounds
def test_size_bound_evicts_least_recently_used_first(cache, capsys):
    store, keys = cache
    now = time.time()
    # last use: keys[2] oldest, then keys[0], keys[3], keys[1] newest
    _set_used(store, {keys[2]: now - 400, keys[0]: now - 300, keys[3]: now - 200, keys[1]: now - 100})
    bound = _closure_bytes(store, [keys[3], keys[1]])
    before = cache_size(store)
    capsys.readouterr()
    assert main(["gc", "--max-size", str(bound), "--cache-dir", str(store.root)]) == 0
    out = capsys.readouterr().out  # shown by pytest only if the test fails
    after = cache_size(store)
    assert after <= bound < before, f"LRU gc: {before} -> {after} bytes, bound {bound}\n{out}"
    assert set(store.refs()) == {keys[3], keys[1]}
    evicted_lines = [line.split()[0] for line in out.splitlines() if line.split()[2:3] == ["size"]]
    assert evicted_lines == [keys[2][:12], keys[0][:12]]  # oldest first
    assert not (store.root / "used" / keys[2]).exists()
    _verify_clean(store, capsys)


def test_falls_back_to_ref_mtime_and_touch_used_counts(cache):
    store, keys = cache
    for i, key in enumerate(keys):  # built long ago, in order
        t = time.time() - 1000 + i
        os.utime(store.root / "refs" / key, (t, t))
    assert last_used(store, keys[0]) < last_used(store, keys[1])
    touch_used(store, keys[0])  # a job just loaded the oldest build
    assert last_used(store, keys[0]) > time.time() - 5
    report = collect_garbage(store, max_size=_closure_bytes(store, keys[:1]))
    assert [k for k, _, _ in report.evicted] == keys[1:]
    assert set(store.refs()) == {keys[0]}


def test_max_age_evicts_what_was_not_used_recently(cache, capsys):
    store, keys = cache
    now = time.time()
    _set_used(store, {keys[0]: now - 10 * 86400, keys[1]: now - 8 * 86400,
                      keys[2]: now - 3600, keys[3]: now})
    capsys.readouterr()
    assert main(["gc", "--max-age", "7d", "--cache-dir", str(store.root)]) == 0
    assert set(store.refs()) == {keys[2], keys[3]}
    assert "age" in capsys.readouterr().out
    _verify_clean(store, capsys)


def test_dry_run_deletes_nothing(cache, capsys):
    store, keys = cache
    blobs, refs = set(store.blobs()), store.refs()
    capsys.readouterr()
    assert main(["gc", "--max-size", "0", "--dry-run", "--cache-dir", str(store.root)]) == 0
    out = capsys.readouterr().out
    assert "would be evicted" in out and "-> 0 artifacts, 0 B" in out
    assert set(store.blobs()) == blobs and store.refs() == refs


# ---------------------------------------------------------------------------- unreferenced blobs
def test_rm_then_gc_removes_unreferenced_blobs(cache, capsys):
    store, keys = cache
    victim, keeper = keys[0], keys[2]  # sgd world 1, adamw world 1
    victim_blobs = set(artifact_blobs(store, store.get_ref(victim)).values())
    kept_blobs = set()
    for key in keys[1:]:
        kept_blobs |= set(artifact_blobs(store, store.get_ref(key)).values())
    junk = store.put(b"an orphan blob that no manifest names")
    capsys.readouterr()
    assert main(["rm", victim[:10], "--cache-dir", str(store.root)]) == 0
    assert "gc" in capsys.readouterr().out
    assert victim not in store.refs() and all(store.has(d) for d in victim_blobs)  # rm frees nothing

    # a young orphan survives a grace period
    assert main(["gc", "--grace", "1h", "--cache-dir", str(store.root)]) == 0
    assert store.has(junk) and store.has(store.get_ref(keeper))

    assert main(["gc", "--cache-dir", str(store.root)]) == 0
    out = capsys.readouterr().out
    gone = victim_blobs - kept_blobs
    assert gone and not any(store.has(d) for d in gone)
    assert all(store.has(d) for d in kept_blobs)  # shared parts stay
    assert not store.has(junk)
    assert set(store.blobs()) == kept_blobs
    assert f"removed {len(gone) + 1} blobs" in out
    _verify_clean(store, capsys)


def test_running_build_defers_blob_removal(cache, capsys):
    store, keys = cache
    junk = store.put(b"parts of a build in progress")
    build_lock = filelock.FileLock(str(store.root / "locks" / "somebuild.lock"), timeout=0)
    with build_lock:  # another writer (a different lock object: flock conflicts in-process too)
        report = collect_garbage(store, max_size=0)
        assert report.builds_running == ["somebuild"]
        assert store.has(junk)
        assert not store.refs()  # refs and manifests are still evicted
    report = collect_garbage(store)
    assert not report.builds_running and not store.has(junk) and not list(store.blobs())


# ---------------------------------------------------------------------------- reader leases
_HOLDER = textwrap.dedent("""
    import sys, types
    pkg = types.ModuleType("spmd_aot"); pkg.__path__ = [sys.argv[1]]; sys.modules["spmd_aot"] = pkg
    sys.modules["torch"] = None  # leases need no torch
    from spmd_aot.store import LocalStore
    from spmd_aot.store.leases import reading
    with reading(LocalStore(sys.argv[2]), sys.argv[3]):
        print("leased", flush=True)
        sys.stdin.readline()
    print("released", flush=True)
""")


def test_lease_held_by_another_process_blocks_eviction(cache):
    store, keys = cache
    held = store.get_ref(keys[1])
    held_blobs = set(artifact_blobs(store, held).values())
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(REPO / "spmd_aot"), str(store.root), held],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "leased"
        report = collect_garbage(store, max_size=0)
        assert report.skipped_leased == [keys[1]]
        assert set(store.refs()) == {keys[1]}
        assert set(store.blobs()) == held_blobs  # every blob of the leased artifact, nothing else
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    report = collect_garbage(store, max_size=0)
    assert [k for k, _, _ in report.evicted] == [keys[1]]
    assert not list(store.blobs()) and not store.refs()


def test_reading_an_evicted_artifact_says_gone(cache):
    store, keys = cache
    digest = store.get_ref(keys[0])
    collect_garbage(store, max_size=0)
    with pytest.raises(ArtifactGoneError, match="no longer in"):
        with reading(store, digest):
            pass


_READER = textwrap.dedent("""
    import json, sys, time
    from spmd_aot.entries import read_artifact
    from spmd_aot.store import LocalStore
    from spmd_aot.store.leases import ArtifactGoneError, reading
    store, key, seconds = LocalStore(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    loads = misses = gone = 0
    failures = []
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        digest = store.get_ref(key)
        if digest is None:  # evicted while no lease was held: a miss (a job would rebuild)
            misses += 1
            time.sleep(0.002)
            continue
        try:
            with reading(store, digest):
                read_artifact(store, digest)  # re-hashes every blob, validates every field
                time.sleep(0.003)  # a job binds the program while it holds the lease
                read_artifact(store, digest)
            loads += 1
        except ArtifactGoneError:
            gone += 1
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.002)
    print(json.dumps({"loads": loads, "misses": misses, "gone": gone, "failures": failures[:5],
                      "n_failures": len(failures)}), flush=True)
""")


def test_gc_concurrent_with_a_reader_in_another_process(pristine, tmp_path):
    """A reader process loads artifact A in a loop under leases for a few seconds while this
    process keeps refilling the cache and running gc with a bound that always wants A (the LRU)
    gone. ``tools/stress/stress_cache.py gc`` runs builders, loaders and gc together for a minute."""
    src, keys = pristine
    store = LocalStore(tmp_path / "cache")
    for key in keys:
        copy_artifact(src, store, key)
    reader_key = keys[0]
    bound = max(_closure_bytes(src, [a, b]) for a in keys for b in keys if a != b)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    reader = subprocess.Popen([sys.executable, "-c", _READER, str(store.root), reader_key, "3"],
                              stdout=subprocess.PIPE, text=True, env=env)
    rounds = skipped = evicted_reader = 0
    max_after = peak = 0
    try:
        assert reader.stdout.readline().strip() == "ready"
        while reader.poll() is None:
            for key in keys:  # refill: a rebuild or pull, under the key's build lock
                if store.get_ref(key) is None:
                    with store.lock(key):
                        copy_artifact(src, store, key)
            now = time.time()
            _set_used(store, {key: now - 100 + i for i, key in enumerate(keys)})  # reader's A is LRU
            peak = max(peak, cache_size(store))
            report = collect_garbage(store, max_size=bound)
            rounds += 1
            skipped += reader_key in report.skipped_leased
            evicted_reader += any(k == reader_key for k, _, _ in report.evicted)
            max_after = max(max_after, cache_size(store))
        result = json.loads(reader.stdout.readline())
    finally:
        if reader.poll() is None:
            reader.kill()
        reader.wait(timeout=30)
    print(f"\ngc vs reader: {rounds} gc runs; reader {result['loads']} loads, {result['misses']} misses, "
          f"{result['gone']} gone, {result['n_failures']} failures; gc skipped the leased artifact "
          f"{skipped} times and evicted it {evicted_reader} times between loads; max cache size "
          f"after gc {max_after} bytes vs bound {bound} (peak before gc {peak})")
    assert result["n_failures"] == 0, result["failures"]
    assert result["loads"] >= 20
    assert skipped >= 1  # gc really met a live lease
    assert max_after <= bound
    assert LocalStore(store.root).verify() == []


def test_manifest_stored_after_the_listing_keeps_the_parts_it_reuses(cache, monkeypatch):
    """The race the gc stress test found: a build that re-uses existing part blobs (finds them
    intact, rewrites nothing) stores its manifest and ref after gc listed the blobs and before
    it read the refs. gc must read that manifest's parts, not delete them."""
    from spmd_aot.entries import read_manifest
    from spmd_aot.format.artifact import pack_manifest

    from spmd_aot.store import eviction as gc_module

    store, keys = cache
    old = store.get_ref(keys[0])
    manifest = read_manifest(store, old)
    store.delete_ref(keys[0])  # its manifest and parts are now unreferenced
    calls = []
    real_busy = gc_module._BuildLocks.busy

    def busy(self):
        calls.append(1)
        if len(calls) == 2:  # the sweep: after the listing, before reading the refs
            manifest["stats"]["trace_seconds"] = 12.5  # a rebuild: new manifest, same parts
            store.set_ref(keys[0], store.put(pack_manifest(manifest)))
        return real_busy(self)

    monkeypatch.setattr(gc_module._BuildLocks, "busy", busy)
    collect_garbage(store)
    assert len(calls) >= 2
    new = store.get_ref(keys[0])
    assert new != old
    missing = [name for name, d in manifest["blobs"].items() if not store.has(d)]
    assert missing == [], f"gc deleted parts of a referenced manifest: {missing}"

