"""Tests for the object-storage backend against a real moto S3 server in its own process:
S3Store, LayeredStore (read-through / write-through), open_store, push/pull, corruption, locks."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import spmd_aot  # noqa: E402
from spmd_aot.cli.app import main  # noqa: E402
from spmd_aot.errors import CorruptArtifactError, LockTimeoutError, SpmdAotError  # noqa: E402
from spmd_aot.store import LayeredStore, LocalStore, S3Store, open_location, open_store  # noqa: E402
from spmd_aot.store.transfer import artifact_blobs  # noqa: E402
from support.store_contract import check_store_contract  # noqa: E402

from support.jobs import fresh_objects, make_batch, make_job  # noqa: E402
from support.multiproc import free_port, run_ranks  # noqa: E402

BUCKET = "spmd-aot-test"
_ENV = {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server in a separate process on a free port; the environment points at it
    (spawned ranks inherit it)."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    patch = pytest.MonkeyPatch()
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto server did not start (exit status {server.poll()})")
            time.sleep(0.1)
        for name, value in _ENV.items():
            patch.setenv(name, value)
        patch.setenv("SPMD_AOT_S3_ENDPOINT", endpoint)
        patch.delenv("AWS_ENDPOINT_URL", raising=False)
        patch.delenv("AWS_PROFILE", raising=False)
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        patch.undo()
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def client(s3_endpoint):
    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> LocalStore:
    """A local cache with the MLP/SGD job built for 2 ranks (the build machine)."""
    store = LocalStore(tmp_path_factory.mktemp("build-cache"))
    spmd_aot.build(make_job("mlp", "sgd"), world_size=2, store=store)
    return store


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


def _objects(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", []))


# ---------------------------------------------------------------------------- S3Store
def test_s3_store_blobs_and_refs(s3_endpoint, client):
    store = S3Store(_url("basics/nested/"))
    assert store.url == _url("basics/nested") and store.endpoint_url == s3_endpoint
    data = b"hello s3"
    digest = store.put(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.put(data) == digest  # idempotent (ETag check, no second upload needed)
    assert store.get(digest) == data and store.has(digest) and store.size(digest) == len(data)
    empty = store.put(b"")
    assert store.get(empty) == b""
    assert list(store.blobs()) == sorted([digest, empty])
    store.set_ref("k1", digest)
    assert store.get_ref("k1") == digest and store.get_ref("nope") is None
    assert store.refs() == {"k1": digest}
    assert _objects(client, "basics/nested") == sorted([f"objects/{digest}", f"objects/{empty}", "refs/k1"])
    with pytest.raises(SpmdAotError, match="invalid store key"):
        store.set_ref("../escape", digest)
    with pytest.raises(CorruptArtifactError, match=f"blob {'ab' * 32} missing at s3://"):
        store.get("ab" * 32)
    store.delete_ref("k1")
    store.delete(digest)
    store.delete(digest)  # absent: no error
    assert store.refs() == {} and not store.has(digest)
    assert store.verify() == []


def test_s3_stores_meet_the_store_contract(s3_endpoint, tmp_path):
    check_store_contract(S3Store(_url("contract"), lock_poll=0.05))
    check_store_contract(open_store(_url("contract-layered"), local_cache=tmp_path / "local"))


def test_missing_bucket_is_a_clear_error(s3_endpoint):
    with pytest.raises(SpmdAotError, match="bucket 'no-such-bucket-spmd' does not exist"):
        S3Store("s3://no-such-bucket-spmd/x").refs()


def test_open_store(s3_endpoint, tmp_path, monkeypatch):
    assert isinstance(open_store(tmp_path / "a"), LocalStore)
    store = open_store(_url("open"), local_cache=tmp_path / "local")
    assert isinstance(store, LayeredStore) and store.local.root == tmp_path / "local"
    assert store.location == _url("open")  # what --cache-dir says to reach it: the bucket
    assert isinstance(open_location(_url("open")), S3Store)  # push --to / pull --from: the bucket itself
    monkeypatch.setenv("SPMD_AOT_CACHE_DIR", _url("env"))
    monkeypatch.setenv("SPMD_AOT_LOCAL_CACHE", str(tmp_path / "envlocal"))
    store = open_store()
    assert isinstance(store, LayeredStore) and store.remote.url == _url("env")
    assert store.local.root == tmp_path / "envlocal"


# ---------------------------------------------------------------------------- round trip
def _job_worker(rank, world, url, local_cache):
    import spmd_aot.building.pipeline
    import spmd_aot.tracing.trace
    from spmd_aot.examples.models import train_step

    def refuse(*args, **kwargs):
        raise AssertionError("the tracer was called: the artifact should come from S3")

    spmd_aot.building.pipeline.trace_step = refuse
    spmd_aot.tracing.trace.make_fx = refuse
    model, optim = fresh_objects("mlp", "sgd")
    step = spmd_aot.compile(train_step, store=open_store(url, local_cache=local_cache), require_hit=True)
    losses = [step(model, optim, make_batch("mlp", rank, s)).item() for s in range(3)]
    return step.cache_info.hit, step.cache_info.source, step.cache_info.digest, losses


def test_push_then_two_rank_job_from_an_empty_cache_hits(built, client, tmp_path, capsys):
    url = _url("roundtrip")
    (key, digest), = built.refs().items()
    capsys.readouterr()
    assert main(["push", "--to", url, "--cache-dir", str(built.root)]) == 0
    out = capsys.readouterr().out
    assert "pushed 1 artifact to s3://" in out and "6 of 6 blobs copied" in out
    blobs = set(artifact_blobs(built, digest).values())
    assert _objects(client, "roundtrip") == sorted([f"objects/{d}" for d in blobs] + [f"refs/{key}"])
    assert main(["push", key[:8], "--to", url, "--cache-dir", str(built.root)]) == 0
    assert "0 of 6 blobs copied" in capsys.readouterr().out  # already there, intact

    local = tmp_path / "job-host-cache"  # empty: a fresh job host
    start = time.perf_counter()
    results = run_ranks(_job_worker, 2, url, str(local))
    seconds = time.perf_counter() - start
    assert [r[:3] for r in results] == [(True, "cache", digest)] * 2
    assert results[0][3] != results[1][3]  # each rank its own batch
    print(f"\nS3 round trip: build -> push -> empty cache -> 2 gloo ranks: hit on both ranks "
          f"(source=cache, digest {digest[:12]}), losses {results[0][3]}, {seconds:.1f} s")
    # read-through left a complete local copy: later starts need no network
    copied = LocalStore(local)
    assert copied.refs() == {key: digest} and set(copied.blobs()) == blobs
    assert main(["verify", "--cache-dir", str(local)]) == 0


def test_cli_pull_into_an_empty_cache(built, s3_endpoint, tmp_path, capsys):
    url = _url("pull")
    assert main(["push", "--to", url, "--cache-dir", str(built.root)]) == 0
    dest = tmp_path / "dest"
    capsys.readouterr()
    assert main(["pull", "--from", url, "--cache-dir", str(dest)]) == 0
    assert "pulled 1 artifact from s3://" in capsys.readouterr().out
    assert LocalStore(dest).refs() == built.refs()
    assert main(["verify", "--cache-dir", str(dest)]) == 0
    capsys.readouterr()
    assert main(["ls", "--cache-dir", url]) == 0  # the bucket can be listed like a cache
    assert "1 artifact in s3://" in capsys.readouterr().out
    (key, digest), = built.refs().items()
    assert main(["show", key[:8], "--cache-dir", url]) == 0
    out = capsys.readouterr().out
    assert digest in out and "MISSING" not in out


def test_build_writes_through_to_s3(s3_endpoint, tmp_path):
    store = open_store(_url("writethrough"), local_cache=tmp_path / "local")
    store.set_ref("k", store.put(b"part"))
    assert store.local.get_ref("k") == store.remote.get_ref("k") == hashlib.sha256(b"part").hexdigest()
    assert store.remote.get(store.remote.get_ref("k")) == b"part"


# ---------------------------------------------------------------------------- corruption
def test_corrupted_object_in_s3_is_detected(built, client, tmp_path, capsys):
    url = _url("corrupt")
    (key, digest), = built.refs().items()
    assert main(["push", "--to", url, "--cache-dir", str(built.root)]) == 0
    graph = artifact_blobs(built, digest)["graph"]
    object_key = f"corrupt/objects/{graph}"
    raw = bytearray(client.get_object(Bucket=BUCKET, Key=object_key)["Body"].read())
    raw[len(raw) // 2] ^= 0x01
    client.put_object(Bucket=BUCKET, Key=object_key, Body=bytes(raw))
    object_url = f"s3://{BUCKET}/{object_key}"

    with pytest.raises(CorruptArtifactError, match=f"blob {object_url} is corrupt: expected sha256 {graph}"):
        S3Store(url).get(graph)
    capsys.readouterr()
    assert main(["verify", "--cache-dir", url]) == 1
    assert object_url in capsys.readouterr().out

    # a damaged ref in the bucket is listed as such (Store.ref_keys), and reported once by verify
    client.put_object(Bucket=BUCKET, Key="corrupt/refs/garbage", Body=b"not a digest")
    assert main(["ls", "--cache-dir", url]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if "CORRUPT" in line][0].startswith("garbage")
    assert main(["verify", "--cache-dir", url]) == 1
    assert sum("refs/garbage" in line for line in capsys.readouterr().out.splitlines()) == 1
    client.delete_object(Bucket=BUCKET, Key="corrupt/refs/garbage")
    dest = tmp_path / "dest"
    assert main(["pull", "--from", url, "--cache-dir", str(dest)]) == 2
    assert object_url in capsys.readouterr().err
    assert LocalStore(dest).refs() == {} and not LocalStore(dest).has(graph)  # nothing bad kept
    layered = open_store(url, local_cache=tmp_path / "layered")
    with pytest.raises(CorruptArtifactError, match=object_url):
        layered.get_ref(key)
    assert layered.local.refs() == {}

    # pushing a good copy again repairs it (its ETag no longer matches the bytes)
    assert main(["push", "--to", url, "--cache-dir", str(built.root)]) == 0
    assert "1 of 6 blobs copied" in capsys.readouterr().out
    assert main(["pull", "--from", url, "--cache-dir", str(dest)]) == 0
    assert main(["verify", "--cache-dir", str(dest)]) == 0


# ---------------------------------------------------------------------------- locks
def test_lock_is_exclusive_refreshed_and_taken_over_when_stale(s3_endpoint, client):
    holder = S3Store(_url("locks"), lock_stale_after=1.5, lock_poll=0.1)
    other = S3Store(_url("locks"), lock_stale_after=1.5, lock_poll=0.1)
    with holder.lock("build-key") as where:
        assert where == _url("locks/locks/build-key.lock")
        start = time.monotonic()
        with pytest.raises(LockTimeoutError, match="could not take lock"):
            with other.lock("build-key", timeout=2.5):  # outlives lock_stale_after: heartbeat works
                pass
        assert time.monotonic() - start >= 2.5
    with other.lock("build-key", timeout=1):  # released on exit
        pass
    assert _objects(client, "locks") == []

    # a holder that died without releasing: the lock is taken over once stale
    client.put_object(Bucket=BUCKET, Key="locks/locks/dead.lock", Body=b'{"pid": 1}')
    start = time.monotonic()
    with other.lock("dead", timeout=10):
        waited = time.monotonic() - start
    assert 1.0 <= waited < 8


def test_concurrent_lockers_never_overlap(s3_endpoint):
    inside, overlaps = [], []

    def worker():
        store = S3Store(_url("locks2"), lock_poll=0.05)
        for _ in range(3):
            with store.lock("k", timeout=30):
                inside.append(1)
                if len(inside) > 1:
                    overlaps.append(1)
                time.sleep(0.02)
                inside.pop()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []
