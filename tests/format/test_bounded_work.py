"""Bounded work for what a writer of the cache controls: the meta check of a crafted graph
(``LoadLimits.meta_work``), charged before the work is done, refused with ``LoadLimitError``.

The crafted entries (``support/costly.py``) use only the documented format. Timings of the
largest ones the default limits admit: ``python tools/stress/worst_case_load.py``.
"""

from __future__ import annotations

import pytest

from support import costly
from support.jobs import build_unsigned
from spmd_aot.errors import LoadLimitError
from spmd_aot.format import validate
from spmd_aot.entries import check_entry, read_manifest
from spmd_aot.format.limits import ENV_LOAD_LIMITS
from spmd_aot.store import LocalStore


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("bounded")
    result = build_unsigned(cache)
    store = LocalStore(cache)
    return store, result.digest, read_manifest(store, result.digest)["key"]


@pytest.fixture
def runs(monkeypatch):
    """The names of the nodes whose contract and meta kernel ran (memo misses)."""
    ran = []
    real = validate.check_node

    def counting(node, *a, **k):
        ran.append(node.name)
        return real(node, *a, **k)

    monkeypatch.setattr(validate, "check_node", counting)
    return ran


def test_distinct_scalars_are_refused_once_their_runs_pass_the_budget(built, runs, monkeypatch):
    store, digest, key = built
    monkeypatch.setenv(ENV_LOAD_LIMITS, "meta_work=5000")
    crafted = costly.store_with_nodes(store, digest, costly.scalar_chain(store, digest, 1000, distinct=True))
    with pytest.raises(LoadLimitError, match=rf"meta_work=5000 .*{ENV_LOAD_LIMITS}=meta_work=") as info:
        check_entry(store, key, crafted)
    assert "add.Scalar" in str(info.value) and "crafted_" in str(info.value)
    ran = [n for n in runs if n.startswith("crafted_")]
    # every run is charged before it happens: at most budget / cost of one run
    assert 0 < len(ran) <= 5000 // (validate.RUN_COST + validate.TENSOR_COST)


def test_the_same_calls_with_one_scalar_are_memo_hits_within_the_budget(built, runs, monkeypatch):
    store, digest, key = built
    monkeypatch.setenv(ENV_LOAD_LIMITS, "meta_work=5000")
    crafted = costly.store_with_nodes(store, digest, costly.scalar_chain(store, digest, 1000, distinct=False))
    check_entry(store, key, crafted)  # loads: 1000 memo hits cost 1000 units
    assert [n for n in runs if n.startswith("crafted_")] == ["crafted_0"]


def test_a_long_foreach_list_is_refused_before_its_meta_kernel_runs(built, runs, monkeypatch):
    store, digest, key = built
    monkeypatch.setenv(ENV_LOAD_LIMITS, "meta_work=5000")
    # 400 cheap nodes first: the decoder admits objects_per_node (32) objects per node
    padding = costly.scalar_chain(store, digest, 400, distinct=False)
    crafted = costly.store_with_nodes(store, digest, padding + costly.long_foreach(store, digest, 2000))
    with pytest.raises(LoadLimitError, match="crafted_foreach_0 .*_foreach_add.Scalar.* meta_work=5000"):
        check_entry(store, key, crafted)
    assert [n for n in runs if n.startswith("crafted_")] == ["crafted_0"]  # the padding's one run


def test_the_limit_is_the_one_the_environment_sets(built, monkeypatch):
    store, digest, key = built
    crafted = costly.store_with_nodes(store, digest, costly.scalar_chain(store, digest, 300, distinct=True))
    monkeypatch.setenv(ENV_LOAD_LIMITS, "meta_work=2000")
    with pytest.raises(LoadLimitError):
        check_entry(store, key, crafted)
    monkeypatch.setenv(ENV_LOAD_LIMITS, "meta_work=100000")
    check_entry(store, key, crafted)  # the owner of an unusual artifact raises the limit


# ---------------------------------------------------------------------------- explaining a miss
def _live_key(manifest):
    from spmd_aot.keying.key import CacheKey

    return CacheKey("0" * 64, {n: "f" * 64 for n in manifest["ingredients"]},
                    {n: {"live": 1} for n in manifest["ingredients"]})


@pytest.fixture
def reads(monkeypatch):
    """Every blob digest a store's ``get`` is asked for."""
    asked = []
    real = LocalStore.get

    def get(self, digest, *, limit=None):
        asked.append(digest)
        return real(self, digest, limit=limit)

    monkeypatch.setattr(LocalStore, "get", get)
    return asked


def test_explaining_never_reads_a_blob_larger_than_a_manifest(built, tmp_path, reads):
    from spmd_aot.keying import explain

    source, digest, _ = built
    store = LocalStore(tmp_path / "cache")
    manifest = read_manifest(source, digest)
    store.set_ref("real", store.put(source.get(digest)))
    big = store.put(bytes(explain.MAX_MANIFEST_BYTES + 1))
    for i in range(40):
        store.set_ref(f"big-{i:02d}", big)
    reads.clear()
    text = explain.explain_miss(store, _live_key(manifest))
    assert text.startswith(f"Nearest stored entry {'real'[:12]} differs in")
    assert big not in reads and reads == [digest]


def test_explaining_reads_each_manifest_once_within_the_caps(built, tmp_path, reads, monkeypatch):
    from spmd_aot.format.artifact import pack_manifest
    from spmd_aot.keying import explain

    source, digest, _ = built
    store = LocalStore(tmp_path / "cache")
    manifest = read_manifest(source, digest)
    shared = store.put(source.get(digest))
    for i in range(10):  # ten refs, one manifest: read once
        store.set_ref(f"a-{i}", shared)
    distinct = [store.put(pack_manifest(dict(manifest, stats=dict(manifest["stats"], trace_seconds=i))))
                for i in range(20)]
    for i, d in enumerate(distinct):
        store.set_ref(f"b-{i:02d}", d)
    monkeypatch.setattr(explain, "MAX_REFS", 25)
    reads.clear()
    text = explain.explain_miss(store, _live_key(manifest))
    assert text.endswith("(Compared with 25 of the 30 stored entries.)")
    assert sorted(reads) == sorted([shared] + distinct[:15])
    budget = sum(store.size(d) for d in (shared, *distinct[:2]))  # the byte budget: 3 manifests
    monkeypatch.setattr(explain, "MAX_TOTAL_BYTES", budget)
    reads.clear()
    assert "differs in" in explain.explain_miss(store, _live_key(manifest))
    assert reads == [shared, *distinct[:2]]


# ---------------------------------------------------------------------------- every reader capped
def test_show_verify_and_ls_cap_every_blob_read(built, tmp_path, monkeypatch, capsys):
    """A kernels blob of any size (here past a lowered limit) is refused unread by ``show``,
    reported by ``verify``, and no command reads any blob without a limit."""
    import shutil

    from spmd_aot.cli.app import main as cli
    from spmd_aot.format.artifact import pack_manifest

    source, digest, key = built
    cache = tmp_path / "cache"
    shutil.copytree(source.root, cache)
    store = LocalStore(cache)
    manifest = read_manifest(store, digest)
    big = store.put(bytes(3 << 20))
    crafted = dict(manifest, blobs=dict(manifest["blobs"], kernels=big))
    store.set_ref(key, store.put(pack_manifest(crafted)))
    limits = []
    real = LocalStore.get

    def get(self, d, *, limit=None):
        limits.append((d, limit))
        return real(self, d, limit=limit)

    monkeypatch.setattr(LocalStore, "get", get)
    monkeypatch.setenv(ENV_LOAD_LIMITS, "constants_bytes=1M")
    assert cli(["show", key[:12], "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "kernels:      CORRUPT" in out and "more than the 1048576 allowed" in out
    assert cli(["verify", "--cache-dir", str(cache)]) == 1
    assert cli(["ls", "--cache-dir", str(cache)]) == 0
    assert limits and all(limit is not None for _, limit in limits), [d[:12] for d, lim in limits if lim is None]
    assert all(limit <= 1 << 20 for d, limit in limits if d == big)


def test_ls_reads_each_manifest_once_however_many_refs_name_it(built, tmp_path, reads, capsys):
    from spmd_aot.cli.app import main as cli

    source, digest, _ = built
    store = LocalStore(tmp_path / "cache")
    store.set_ref("real", store.put(source.get(digest)))
    big = store.put(bytes(2 << 20))  # not a manifest: every ref to it is listed as damaged
    for i in range(40):
        store.set_ref(f"big-{i:02d}", big)
    reads.clear()
    assert cli(["ls", "--cache-dir", str(store.root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("big-") and "CORRUPT" in line for line in out) == 40
    assert reads.count(big) == 1 and reads.count(digest) == 1
