"""What a job's end must do before the interpreter tears itself down: let go of every process
group the job destroyed, so each really goes while Python is whole.

A group that lives on into interpreter finalization is destroyed mid-teardown, and a gloo
worker thread that then touches a Python object aborts the whole process ("terminate called
without an active exception", seen now and then at the end of multi-rank jobs). Three things
kept groups alive or busy there; each has its answer below.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time

# 1. torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it
# is first imported. Imported while a group is up (torch._dynamo imports it lazily, and a load
# or a trace imports torch._dynamo), those defaults keep the group and its gloo threads alive
# past ``destroy_process_group()``. Imported here, with the package and so usually before any
# group exists, the defaults are None (the default group at call time, which they mean);
# ``_unpin_destroyed_groups`` covers a package imported after ``init_process_group``.
from torch.distributed.nn import functional as _nn_functional

from ..parallel.mesh import forget_meshes  # 2. our meshes and DTensor's cached decisions hold groups

__all__: list[str] = []


def _unpin_destroyed_groups() -> None:
    """Point default arguments of ``torch.distributed.nn.functional`` that still hold a
    process group back to None once no group is up (1. at the top)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for fn in list(vars(_nn_functional).values()):
        defaults = getattr(fn, "__defaults__", None)
        if isinstance(defaults, tuple) and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def _let_collective_threads_settle(naps: int = 4) -> None:
    """3. Give gloo's worker threads a moment, with the GIL released, to finish what they were
    doing when the job ended. A worker that completes a collective drops its tensors only after
    the caller's wait has returned, and dropping a tensor Python knows takes the GIL; if that
    happens once the interpreter has begun finalizing, the thread is killed inside C++ and the
    process aborts with "terminate called without an active exception" (native backtrace:
    ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``decref_pyobject`` ->
    ``take_gil`` -> ``pthread_exit`` during ``Py_FinalizeEx``). Naps of 10 ms, only while such
    a thread exists: a bounded mitigation of a race inside torch, not a guarantee."""
    for _ in range(naps):
        if not _gloo_threads():
            return
        time.sleep(0.01)  # hands the GIL to a worker waiting for it


def _gloo_threads() -> int:
    """Live threads of gloo process groups in this process (0 where /proc cannot say)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    count = 0
    for task in tasks:
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{task}/comm") as f:
                count += "gloo" in f.read()
    return count


@atexit.register
def _release_groups_at_exit() -> None:
    """Drop every reference spmd-aot (or torch on its behalf) keeps to process groups the job
    has destroyed: our meshes, DTensor's cached decisions holding them, stale default
    arguments. Then a destroyed group really goes, while the interpreter is whole; left to
    finalization, its gloo worker threads are torn down mid-teardown and abort the process
    ("terminate called without an active exception"). Processes that end with ``os._exit``
    (forked multiprocessing workers) never get here, and never tear anything down either."""
    with contextlib.suppress(Exception):
        _let_collective_threads_settle()
    with contextlib.suppress(Exception):
        forget_meshes()
    with contextlib.suppress(Exception):
        _unpin_destroyed_groups()

