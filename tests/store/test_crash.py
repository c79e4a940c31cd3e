"""Crash safety: builders SIGKILLed at every stage of a cache write leave a usable cache.

Each case runs a real builder process (``spmd_aot.build`` of a small MLP job at world size
2, forked from the tests' torch-preloaded server: ``multiproc.run_processes``) with
``SPMD_AOT_CRASH_AT`` set, so it kills itself with SIGKILL at that stage (see
``spmd_aot.store.faults``). ``tools/stress/stress_cache.py crash`` kills builders at random stages, many
times over. After each kill: every ref names an artifact that reads fully (or the
key has no ref), the next build takes the lock at once and succeeds with the same parts as a
clean build, the dead writer's temp files are gone and ``LocalStore.verify()`` is clean.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

import spmd_aot
from support.jobs import make_job
from support.multiproc import run_processes
from spmd_aot.store import faults
from spmd_aot.entries import read_artifact, read_manifest
from spmd_aot.errors import LockTimeoutError
from spmd_aot.store import LocalStore

REPO = pathlib.Path(__file__).resolve().parents[2]

# Every stage once, plus later occurrences of the blob stages: the 6th blob written is the
# manifest, so "blob.partial:6" dies half-way through writing the manifest.
CASES = list(faults.STAGES) + ["blob.partial:6", "blob.before_rename:6", "blob.after_rename:3"]
# Stages at which the ref is already in place when the builder dies.
REF_WRITTEN = {"ref.after_rename", "artifact.ref_set"}


def build_mlp(cache: str, crash_at: str) -> str:
    """The builder (run in its own process): ``spmd-aot build`` of the MLP job, told to die at a stage."""
    os.environ[faults.ENV_CRASH_AT] = crash_at
    r = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, cache_dir=cache)
    return f"BUILT {r.digest} {r.traced}"


def check_refs_serve_whole_artifacts(store: LocalStore) -> int:
    """(a): every ref's artifact reads fully; returns how many refs there are."""
    refs = store.refs()
    for key, digest in refs.items():
        art = read_artifact(store, digest)  # raises on any missing or damaged blob
        art.program(["0"], torch.device("cpu"))
        assert art.manifest["key"] == key
    return len(refs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A clean build: its key and part digests, which every rebuild must reproduce."""
    cache = tmp_path_factory.mktemp("reference")
    result = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, cache_dir=cache)
    return result.key, read_manifest(LocalStore(cache), result.digest)["blobs"]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Run every crash case (4 builders at a time); returns {case: (cache dir, (exitcode, status, output))}."""
    root = tmp_path_factory.mktemp("crashes")
    caches = {case: root / case.replace(":", "_") for case in CASES}
    ends = run_processes(build_mlp, [(str(caches[case]), case) for case in CASES], parallel=4, timeout=120)
    return {case: (caches[case], end) for case, end in zip(CASES, ends)}


def test_stages_are_documented():
    assert len(set(faults.STAGES)) == len(faults.STAGES) >= 9
    for prefix in ("blob.", "ref.", "artifact.", "lock."):
        assert any(s.startswith(prefix) for s in faults.STAGES)


@pytest.mark.parametrize("case", CASES)
def test_builder_killed_at_stage_leaves_a_usable_cache(case, crashed, reference):
    cache, (exitcode, status, output) = crashed[case]
    assert exitcode == -signal.SIGKILL, f"builder was not killed at {case}: exit code {exitcode}, {status}: {output}"
    assert status == "died" and output is None  # it never got to report a finished build
    store = LocalStore(cache, lock_timeout=5.0)  # a lock left held would fail the rebuild fast
    key, parts = reference

    # (a) nothing half-written is served: a ref exists only once everything it names does.
    n_refs = check_refs_serve_whole_artifacts(store)
    assert n_refs == (1 if case in REF_WRITTEN else 0), f"{case}: {store.refs()}"
    if case in ("blob.partial", "blob.before_rename", "ref.partial", "ref.before_rename"):
        assert list((cache / "tmp").iterdir()), f"{case}: expected the killed writer's temp file"

    # (b) the next build is not blocked by the dead builder's lock and succeeds.
    start = time.monotonic()
    result = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, store=store)
    assert time.monotonic() - start < 30
    assert result.key == key
    assert result.traced == (n_refs == 0)
    art = read_artifact(store, result.digest)
    assert art.manifest["blobs"] == parts  # the same graph as a clean build
    assert art.program(["0"], torch.device("cpu")).n_ops > 0
    assert store.get_ref(key) == result.digest

    # (c) the build's lock cleaned the dead writer's temp files; the store is consistent.
    assert list((cache / "tmp").iterdir()) == []
    assert store.verify() == []
    assert check_refs_serve_whole_artifacts(store) == 1


# ---------------------------------------------------------------- locks and temp files

_PKG_STUB = f"""
import sys, types
pkg = types.ModuleType("spmd_aot"); pkg.__path__ = [{str(REPO / "spmd_aot")!r}]
sys.modules["spmd_aot"] = pkg
sys.modules["torch"] = None
from spmd_aot.store import LocalStore
"""

_HOLD_LOCK = _PKG_STUB + """
import time
with LocalStore(sys.argv[1]).lock("build-key", timeout=10):
    print("HELD", flush=True)
    time.sleep(60)
"""


def test_lock_of_sigkilled_holder_is_free_and_timeout_names_the_lock(tmp_path):
    root = tmp_path / "cache"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(root)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        store = LocalStore(root)
        lock_file = root / "locks" / "build-key.lock"
        with pytest.raises(LockTimeoutError) as info:
            with store.lock("build-key", timeout=0.3):
                pytest.fail("took a lock another live process holds")
        assert str(lock_file) in str(info.value)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert lock_file.exists()  # the file stays; the OS dropped the dead holder's flock
    start = time.monotonic()
    with store.lock("build-key", timeout=2.0) as path:
        assert path == lock_file
    assert time.monotonic() - start < 1.0


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_clean_tmp_removes_dead_writers_files_only(tmp_path):
    store = LocalStore(tmp_path / "cache")
    tmp = store.root / "tmp"
    dead = _dead_pid()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        names = {
            "dead_blob": f"0123456789abcdef.{dead}.140.abcdef0123456789.tmp",
            "dead_ref": f"my.key.with.dots.{dead}.7.0011223344556677.tmp",
            "live_other": f"0123456789abcdef.{sleeper.pid}.1.aa.tmp",
            "live_self": f"0123456789abcdef.{os.getpid()}.1.bb.tmp",
            "unparsable": "garbage-name.tmp",
            "pid_zero": "x.0.1.cc.tmp",
            "pid_unicode_digit": "x.\u00b2.1.cc.tmp",
            "pid_huge": f"x.{10**30}.1.cc.tmp",
        }
        for name in names.values():
            (tmp / name).write_bytes(b"partial")
        assert store.clean_tmp() == 0  # default: age only, and everything is fresh
        with store.lock("k"):  # the builder path cleans dead writers' files, whatever their age
            pass
        left = {p.name for p in tmp.iterdir()}
        kept = ("live_other", "live_self", "unparsable", "pid_zero", "pid_unicode_digit", "pid_huge")
        assert left == {names[k] for k in kept}
        old = time.time() - 7200
        os.utime(tmp / names["unparsable"], (old, old))
        assert store.clean_tmp() == 1
        sleeper.kill()
        sleeper.wait()  # reaped: now dead
        assert store.clean_tmp(dead_writers=True) == 1
        assert {p.name for p in tmp.iterdir()} == {names[k] for k in kept[1:] if k != "unparsable"}
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_zombie_writer_counts_as_dead(tmp_path):
    store = LocalStore(tmp_path / "cache")
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while pathlib.Path(f"/proc/{zombie.pid}/stat").read_bytes().rsplit(b")", 1)[-1].split()[0] != b"Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        (store.root / "tmp" / f"ab.{zombie.pid}.1.cd.tmp").write_bytes(b"x")
        assert store.clean_tmp(dead_writers=True) == 1
    finally:
        zombie.wait()


def test_write_survives_its_temp_file_being_cleaned_away(tmp_path, monkeypatch):
    """A cleaner on another host may take our pid for a dead one: the write is redone."""
    import spmd_aot.store.local as local

    store = LocalStore(tmp_path / "cache")
    calls = []

    def sweep_tmp(stage):
        if stage == "blob.before_rename" and not calls:
            calls.append(stage)
            for p in (store.root / "tmp").iterdir():
                p.unlink()

    monkeypatch.setattr(local, "crash_point", sweep_tmp)
    digest = store.put(b"payload" * 1000)
    assert calls and store.get(digest) == b"payload" * 1000
    assert list((store.root / "tmp").iterdir()) == []
