"""The rank harness (``tests/support/multiproc.py``) fails fast and says why: a rank that cannot import
the module defining its function, or that ends without reporting, fails the launch in seconds instead of
leaving the test waiting for the launch's timeout."""

from __future__ import annotations

import os
import sys
import time
import types

import pytest

from support.multiproc import run_processes, run_ranks

TIMEOUT = 120.0  # what a hang would cost; each case must end far sooner


def _exit_on_rank_1(rank, world):
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)  # no result, no traceback: as a crash in native code would end it
    dist.barrier()  # rank 0 waits on its peer, as a collective would
    return rank


def test_a_rank_that_ends_without_reporting_fails_the_launch_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit status 3\)"):
        run_ranks(_exit_on_rank_1, 2, timeout=TIMEOUT)
    assert time.monotonic() - start < 30


@pytest.fixture
def unimportable_function(monkeypatch):
    """A function whose module exists in this process only: a rank process cannot import it."""
    module = types.ModuleType("rank_harness_module_only_here")
    exec("def work(*args):\n    return args\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.work


def test_a_rank_that_cannot_import_its_function_reports_the_import_error(unimportable_function):
    start = time.monotonic()
    with pytest.raises(AssertionError, match="ModuleNotFoundError.*rank_harness_module_only_here"):
        run_ranks(unimportable_function, 2, timeout=TIMEOUT)
    [(_, status, value)] = run_processes(unimportable_function, [()], timeout=TIMEOUT)
    assert status == "error" and "ModuleNotFoundError" in value, (status, value)
    assert time.monotonic() - start < 30
