"""Run a function on N real processes joined by a gloo process group on 127.0.0.1.

Rank processes are forked from one server process that imported torch and spmd_aot once per
test session (multiprocessing's "forkserver" start method with a preload list): each rank is
still a fresh, separate process with its own process group, but starting one costs a fork, not
a 3-second torch import. The server is a clean interpreter (it only imported modules, never
ran an op or started a thread), so what a rank sees is what a freshly started one sees. What a
spawned rank would inherit from its caller, a forked one is handed (``Inherited``): the
caller's environment and its stdout/stderr at launch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
import time
import traceback

# What ranks import anyway (and what a first trace imports lazily), imported once in the server.
# transformers (the `test` extra; skipped by the server when it is not installed): the ranks of the
# corpus and of the context, expert, pipeline and TP-style tests build its models, and its import
# (transformers.modeling_utils, ~2 s of CPU) would otherwise be paid again by every one of them.
PRELOAD = ["spmd_aot", "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.nn.parallel", "torch._dynamo", "torch.testing._internal.distributed.fake_pg",
           "safetensors.torch", "spmd_aot.runtime.step", "spmd_aot.building.builder", "support.jobs", "support.features",
           "transformers.modeling_utils"]

_server_lock = threading.Lock()  # launches start from several threads; the server once
_server_started = False


@contextlib.contextmanager
def _server_surroundings():
    """What the server starts with: one OpenMP thread (no thread pool to fork) and /dev/null as
    stdout/stderr (its processes write where ``Inherited`` points them)."""
    saved_env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        for fd, saved in zip((1, 2), saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        os.close(devnull)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env


def preloaded_context():
    """A multiprocessing context whose processes fork from a server that has torch imported.

    Give its processes an ``Inherited`` and have them ``adopt()`` it first: otherwise they run
    with the server's environment (as it was when the server started) and write to /dev/null.
    """
    global _server_started
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with _server_lock:
        if not _server_started:
            with _server_surroundings():
                forkserver.ensure_running()
            _server_started = True
    return ctx


class Inherited:
    """The caller's environment and stdout/stderr, for a process started from ``preloaded_context``.

    Create it in the caller and pass it in the process's arguments: pickled for the child, it
    carries duplicates of the caller's file descriptors 1 and 2 (under pytest, the running
    test's capture: a passing test stays quiet, a failing one shows its ranks' output).
    """

    def __init__(self):
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self._stdio = None

    def __reduce__(self):
        from multiprocessing.reduction import DupFd  # handed over by the server, as the process's own

        return _rebuild_inherited, (self.env, DupFd(1), DupFd(2))

    def adopt(self) -> None:
        """In the child: take the caller's environment and stdout/stderr."""
        os.environ.clear()
        os.environ.update(self.env)
        for target, dup in zip((1, 2), self._stdio):
            fd = dup.detach()
            os.dup2(fd, target)
            os.close(fd)


def _rebuild_inherited(env, out, err) -> Inherited:
    inherited = Inherited.__new__(Inherited)
    inherited.env, inherited._stdio = env, (out, err)
    return inherited


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _packed(fn, args) -> bytes:
    """``fn`` and its arguments pickled in the caller, unpickled by the process once it has adopted
    the caller's stdout/stderr: a module the process cannot import (the file that defines ``fn``
    off its path, a syntax error) is then reported as the process's error, with its traceback,
    instead of a traceback written to the server's /dev/null and a launch waiting for its timeout."""
    return pickle.dumps((fn, tuple(args)))


def _worker(packed, rank, world, port, queue, inherited):
    inherited.adopt()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(packed)
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


def _gather(procs, queue, timeout: float) -> dict:
    """Each rank's ``(status, value)`` from the queue. A rank that ended without reporting (killed by a
    signal, ``os._exit``, a crash in torch) fails the launch at once, by name and exit status, rather than
    leaving its peers waiting for it until ``timeout``."""
    import queue as queue_mod

    results: dict = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            rank, status, value = queue.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            results[rank] = (status, value)
            continue
        except queue_mod.Empty:
            pass
        gone = {r: p.exitcode for r, p in enumerate(procs) if r not in results and p.exitcode is not None}
        if gone:
            with contextlib.suppress(queue_mod.Empty):  # what they put before exiting is in the pipe
                while len(results) < len(procs):
                    rank, status, value = queue.get(timeout=1.0)
                    results[rank] = (status, value)
            gone = {r: code for r, code in gone.items() if r not in results}
            if gone:
                raise RuntimeError("rank process ended without reporting a result: " + ", ".join(
                    f"rank {r} (exit status {code})" for r, code in sorted(gone.items()))
                    + f"; the others reported {sorted(results)} (its own output, if any, is in the test's"
                    " captured stderr)")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"ranks did not finish in {timeout}s (got {sorted(results)})")
    return results


def run_ranks(fn, world: int, *args, timeout: float = 240.0, expect_errors: bool = False):
    """``fn(rank, world, *args)`` on ``world`` processes; returns results by rank.

    ``world=0`` runs one process with no process group (a plain single-process job).
    With ``expect_errors`` returns ``(status, value)`` pairs instead of raising. A rank process that
    ends without reporting raises ``RuntimeError`` at once, whatever ``expect_errors`` says.
    """
    ctx = preloaded_context()
    queue = ctx.Queue()
    port = free_port()
    n = max(world, 1)
    inherited = Inherited()
    packed = _packed(fn, args)
    procs = [ctx.Process(target=_worker, args=(packed, r, world, port, queue, inherited))
             for r in range(n)]
    try:
        for p in procs:
            p.start()
        results = _gather(procs, queue, timeout)
    except BaseException:
        for p in procs:  # peers of a rank that failed the launch wait on it: end them now
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    ordered = [results[r] for r in range(n)]
    if expect_errors:
        return ordered
    errors = [f"rank {r}: {v}" for r, (s, v) in enumerate(ordered) if s != "ok"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [v for _, v in ordered]


def start_ranks(fn, world: int, *args, timeout: float = 240.0):
    """``run_ranks`` in a background thread; returns a ``concurrent.futures.Future`` of its result.

    The caller keeps the CPUs busy meanwhile: builds the next artifacts, or starts another
    launch (while one launch's rank 0 traces, its peers wait and a CPU would idle).
    """
    from concurrent.futures import ThreadPoolExecutor

    preloaded_context()  # the server starts here, in the caller's thread, not in the launch's
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(run_ranks, fn, world, *args, timeout=timeout)
    finally:
        pool.shutdown(wait=False)  # the thread ends with the launch


def run_launches(*launches, timeout: float = 240.0) -> list:
    """Several independent launches at the same time, each ``(fn, world, *args)`` with its own
    processes, port and process group; their results in order (a failure raises once all ended)."""
    futures = [start_ranks(fn, world, *args, timeout=timeout) for fn, world, *args in launches]
    for f in futures:
        f.exception()  # wait for every launch before raising any launch's error
    return [f.result() for f in futures]


def _call(packed, conn, inherited):
    inherited.adopt()
    import torch

    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(packed)
        conn.send(("ok", fn(*args)))
    except BaseException as exc:  # report, never leave the parent guessing
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_processes(fn, arg_lists, *, parallel: int = 4, timeout: float = 240.0):
    """``fn(*args)`` in one fresh process per ``args`` (no process group), ``parallel`` at a time.

    Returns ``[(exitcode, status, value)]`` in order: status "ok" with fn's return value,
    "error" with the traceback, or "died" (value None) when the process ended without
    answering (killed by a signal: exitcode is minus its number).
    """
    ctx = preloaded_context()
    inherited = Inherited()
    out = []
    for start in range(0, len(arg_lists), parallel):
        running = []
        try:
            for args in arg_lists[start:start + parallel]:
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_call, args=(_packed(fn, args), send, inherited))
                proc.start()
                send.close()  # the child holds the only write end: its death reads as EOF
                running.append((proc, recv))
            deadline = time.monotonic() + timeout
            for proc, recv in running:
                if not recv.poll(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish in {timeout}s")
                try:
                    status, value = recv.recv()
                except EOFError:
                    status, value = "died", None
                proc.join(timeout=10)
                out.append((proc.exitcode, status, value))
        finally:
            for proc, recv in running:
                recv.close()
                if proc.is_alive():
                    proc.kill()
                proc.join()
    return out
