"""Bounded work for what a writer of the cache controls: the meta check of a crafted graph
(``LoadLimits.meta_work``), charged before the work is done, refused with ``LoadLimitError``.

The crafted entries (``support/costly.py``) use only the documented format. Timings of the
largest ones the default limits admit: ``python tools/worst_case_load.py``.
"""

from __future__ import annotations

import pytest

from support import costly
from support.jobs import build_unsigned
from spmd_aot.errors import LoadLimitError
from spmd_aot.format import validate
from spmd_aot.format.artifact import check_entry, read_manifest
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
