"""Races: builder processes released together on one key trace once and agree on the digest.

A pool of 4 worker processes (forked from the tests' torch-preloaded server) runs 3 rounds;
in each round every worker waits on one barrier, then calls ``spmd_aot.build`` on the same
small MLP job (world size 2) into that round's fresh cache dir. ``tools/stress/stress_cache.py race``
runs the same code at 16 workers x 20 rounds (the suite keeps to a few, to stay quick on 2 CPUs).
"""

from __future__ import annotations


import pytest

import stress_cache  # a tool: pytest puts tools/ on sys.path (pyproject.toml)

from support.multiproc import preloaded_context  # noqa: E402
from spmd_aot.store import LocalStore  # noqa: E402

WORKERS, ROUNDS = 4, 3


@pytest.fixture(scope="module")
def race(tmp_path_factory):
    root = tmp_path_factory.mktemp("race")
    return root, stress_cache.race_rounds(WORKERS, ROUNDS, root, timeout=120, context=preloaded_context())


def test_every_round_traces_once_and_agrees(race):
    root, results = race
    summary = stress_cache.summarize_race(results)
    assert summary["errors"] == []
    assert summary["rounds"] == ROUNDS
    assert all(len(r) == WORKERS for r in results)
    assert summary["traces_per_round"] == [1] * ROUNDS
    assert summary["digests_per_round"] == [1] * ROUNDS


def test_each_round_left_one_consistent_entry(race):
    root, results = race
    for round_no, result in enumerate(results):
        store = LocalStore(root / f"round{round_no:03d}")
        digest = result[0][1]
        assert list(store.refs().values()) == [digest]
        n_refs, problems = stress_cache.check_refs(store)
        assert (n_refs, problems) == (1, [])
        assert store.verify() == []
        assert list((store.root / "tmp").iterdir()) == []
        assert len(list(store.blobs())) == 6  # 5 parts + 1 manifest: the losers wrote nothing


def test_summary_catches_a_double_trace():
    """The check itself can fail: two traces or two digests in a round are reported."""
    bad = [[(True, "a" * 64, None), (True, "b" * 64, None), (False, "a" * 64, None)]]
    s = stress_cache.summarize_race(bad)
    assert s["traces_per_round"] == [2] and s["digests_per_round"] == [2]
