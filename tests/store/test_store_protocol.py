"""The store interface (spmd_aot.store.protocol), the shared naming rules, and the URL-scheme
registry: every backend passes one conformance check, and a backend added by one registry line
(memory://) works through open_store, the CLI and spmd_aot.compile end to end."""

from __future__ import annotations

import hashlib
import itertools

import pytest

import spmd_aot
from support.jobs import MLP_JOB_FILE, eager_ddp, fresh_objects, make_batch, max_diffs
from spmd_aot.cli.app import main
from spmd_aot.errors import CorruptArtifactError, SpmdAotError
from spmd_aot.examples.models import train_step
from spmd_aot.store import LayeredStore, LocalStore, MemoryStore, open_location, open_store
from spmd_aot.store.registry import SCHEMES, register_scheme
from support.store_contract import check_store_contract

_names = itertools.count()


def _memory_url(what: str) -> str:
    """A memory:// store no other test uses (they live as long as the process)."""
    return f"memory://{what}-{next(_names)}"


# ---------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("backend", ["local", "memory", "layered"])
def test_every_backend_meets_the_store_contract(backend, tmp_path):
    store = {
        "local": lambda: LocalStore(tmp_path / "cache"),
        "memory": lambda: open_store(_memory_url("contract")),
        "layered": lambda: LayeredStore(LocalStore(tmp_path / "front"), open_store(_memory_url("back"))),
    }[backend]()
    check_store_contract(store)


def test_memory_store_verifies_what_it_was_given():
    good, bad = b"good", b"tampered"
    digest = hashlib.sha256(good).hexdigest()
    store = MemoryStore({digest: bad}, root="<blobs received from rank 0>")
    with pytest.raises(CorruptArtifactError, match=f"blob {digest} in <blobs received from rank 0> is corrupt"):
        store.get(digest)
    assert [p.reason for p in store.verify()] == [f"content hashes to {hashlib.sha256(bad).hexdigest()}"]
    assert store.location is None  # anonymous: no cache_dir reaches it
    assert store.put(good) == digest and store.get(digest) == good  # a put repairs it


# ---------------------------------------------------------------------------- registry
def test_open_store_by_scheme(tmp_path, monkeypatch):
    monkeypatch.delenv("SPMD_AOT_CACHE_DIR", raising=False)
    local = open_store(tmp_path / "a")
    assert isinstance(local, LocalStore) and local.location == str(tmp_path / "a")
    url = _memory_url("shared")
    first = open_store(url)
    assert isinstance(first, MemoryStore) and first.location == first.root == url
    assert open_store(url) is first and open_location(url) is first  # one store per name, per process
    monkeypatch.setenv("SPMD_AOT_CACHE_DIR", url)
    assert open_store() is first
    with pytest.raises(SpmdAotError, match=r"unknown store URL scheme 's4' in 's4://b/p'; known: memory://, s3://"):
        open_store("s4://b/p")
    with pytest.raises(SpmdAotError, match="expected memory://NAME"):
        open_store("memory://../up")
    assert not (tmp_path / "s4:").exists()


def test_a_registered_scheme_with_a_local_cache_gets_a_layered_store(tmp_path, monkeypatch):
    """One register_scheme call: a backend marked local_cache is fronted by a local cache for
    jobs (open_store) and opened bare for push/pull (open_location), like s3://."""
    opened = []

    def open_counting(url):
        opened.append(url)
        return MemoryStore(name=url.split("://", 1)[1])

    monkeypatch.setitem(SCHEMES, "testobj", SCHEMES["memory"])  # restored after the test
    register_scheme("testobj", open_counting, local_cache=True)
    store = open_store("testobj://bucket", local_cache=tmp_path / "front")
    assert isinstance(store, LayeredStore) and store.local.root == tmp_path / "front"
    assert isinstance(open_location("testobj://bucket"), MemoryStore)
    assert opened == ["testobj://bucket", "testobj://bucket"]
    digest = store.put(b"through")
    assert store.remote.get(digest) == store.local.get(digest) == b"through"  # written through


# ---------------------------------------------------------------------------- end to end
def test_memory_backend_through_the_cli_and_compile(tmp_path, monkeypatch, capsys):
    """memory:// (one file + one registry line) works wherever a cache location is accepted:
    `spmd-aot build/ls/verify/push/pull --cache-dir memory://...`, $SPMD_AOT_CACHE_DIR, and
    spmd_aot.compile(cache_dir="memory://...") at world 1, matching eager training."""
    job_file = tmp_path / "mlp_job.py"
    job_file.write_text(MLP_JOB_FILE)
    url = _memory_url("e2e")
    assert main(["build", f"{job_file}:job", "--world-size", "1", "--cache-dir", url]) == 0
    (key, digest), = open_store(url).refs().items()
    capsys.readouterr()

    assert main(["ls", "--cache-dir", url]) == 0
    out = capsys.readouterr().out
    assert f"1 artifact in {url}" in out and key[:12] in out and "CORRUPT" not in out
    monkeypatch.setenv("SPMD_AOT_CACHE_DIR", url)  # the environment names it too
    assert main(["verify"]) == 0
    assert "1 artifacts checked, 0 problems" in capsys.readouterr().out
    monkeypatch.delenv("SPMD_AOT_CACHE_DIR")

    disk, copy = tmp_path / "disk", _memory_url("copy")
    assert main(["pull", "--from", url, "--cache-dir", str(disk)]) == 0
    assert LocalStore(disk).refs() == {key: digest}
    assert main(["push", "--to", copy, "--cache-dir", str(disk)]) == 0
    assert "6 of 6 blobs copied" in capsys.readouterr().out
    assert main(["push", "--to", copy, "--cache-dir", str(disk)]) == 0
    assert "0 of 6 blobs copied" in capsys.readouterr().out  # HOLDS: already there, intact
    assert open_store(copy).refs() == {key: digest} and open_store(copy).verify() == []

    model, optim = fresh_objects("mlp", "sgd")
    step = spmd_aot.compile(train_step, cache_dir=copy, require_hit=True)
    losses = [step(model, optim, make_batch("mlp", 0, s)).detach() for s in range(3)]
    assert (step.cache_info.hit, step.cache_info.digest) == (True, digest)
    diffs = max_diffs(*eager_ddp("mlp", "sgd", 0, 1, 3), model, optim, losses)
    assert max(diffs.values()) < 1e-5, diffs
