"""Run a function on N real processes joined by a gloo process group on 127.0.0.1."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if world > 0:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world)
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # report, never hang the parent
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if world > 0 and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 240.0, expect_errors: bool = False):
    """``fn(rank, world, *args)`` on ``world`` processes; returns results by rank.

    ``world=0`` runs one process with no process group (a plain single-process job).
    With ``expect_errors`` returns ``(status, value)`` pairs instead of raising.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    n = max(world, 1)
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, args, queue)) for r in range(n)]
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
        results = {}
        import queue as queue_mod
        for _ in range(n):
            try:
                rank, status, value = queue.get(timeout=timeout)
            except queue_mod.Empty:
                raise TimeoutError(f"ranks did not finish in {timeout}s (got {sorted(results)})") from None
            results[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    ordered = [results[r] for r in range(n)]
    if expect_errors:
        return ordered
    errors = [f"rank {r}: {v}" for r, (s, v) in enumerate(ordered) if s != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [v for _, v in ordered]
