"""Run two-rank parity jobs (eager DDP reference and a loaded step in the same processes, both
placements) again and again, each run in fresh processes, and count crashes.

    PYTHONPATH=. python tools/stress/stress_ranks.py [--runs 100] [--steps 3]
    PYTHONPATH=. python tools/stress/stress_ranks.py --builds 24 [--runs 10]

``--builds N``: instead of parity runs, each run makes N sequential offline builds (every
feature configuration in turn) in one process (a "double free or corruption" was seen once
after a dozen).

``--plain-ranks``: instead, each run starts two plain ``python -c`` ranks (no multiprocessing)
that join a gloo group, miss an empty cache (rank 0 traces; rank 1, with a cache of its own,
gets the bytes over gloo), train three steps, destroy the group and exit normally: the path on
which "terminate called without an active exception" was seen once at interpreter exit.

Every run gets ``PYTHONFAULTHANDLER=1`` (a Python traceback on SIGSEGV/SIGABRT) and glibc's
``MALLOC_CHECK_=3`` (abort on heap corruption). A run counts as a crash when it exits non-zero
or prints "terminate called", "double free", "corrupted" or "Fatal Python error"; the first
crash output of each kind is printed. Used to chase intermittent aborts (issue: "terminate
called without an active exception" on rank 0 in about 1 of 25 runs).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
SIGNS = ("terminate called", "double free", "corrupted", "Fatal Python error", "Segmentation fault")


def _parity(rank, world, cache_dir, steps):
    from support import jobs

    out = {}
    for placement in ("replicate", "shard"):
        _, _, ref_losses = jobs.eager_ddp("mlp", "sgd", rank, world, steps)
        _, _, losses, _ = jobs.compiled_run("mlp", "sgd", rank, world, steps, f"{cache_dir}/{placement}",
                                            placement=placement)
        out[placement] = max(abs(a.item() - b.item()) for a, b in zip(ref_losses, losses))
    return out


def child(steps: int) -> int:
    sys.path.insert(0, str(REPO / "tests"))
    from support.multiproc import run_ranks

    with tempfile.TemporaryDirectory() as cache:
        result = run_ranks(_parity, 2, cache, steps, timeout=300)
    print("RESULT", result)
    return 0


def child_builds(n: int) -> int:
    sys.path.insert(0, str(REPO / "tests"))
    import spmd_aot
    from support.features import FEATURES, VARIANTS

    configs = [(f, v) for f in FEATURES for v in ("replicate", "shard", "shard_keep_1d_whole")]
    with tempfile.TemporaryDirectory() as cache:
        for i in range(n):
            feature, variant = configs[i % len(configs)]
            model, optim, step, batch, _ = FEATURES[feature]
            job = spmd_aot.Job(step=step, model=model, optimizer=optim, batch=lambda b=batch: b(0, 0))
            spmd_aot.build(job, world_size=2, cache_dir=f"{cache}/{i}", **VARIANTS[variant][0])
    print("RESULT", n, "builds")
    return 0


_PLAIN_RANK = """
import sys
import spmd_aot
import torch
import torch.distributed as dist
from support.jobs import fresh_objects, make_batch
from spmd_aot.examples.models import train_step

rank, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
model, optim = fresh_objects("mlp", "sgd")
step = spmd_aot.compile(train_step, cache_dir=cache)
losses = [step(model, optim, make_batch("mlp", rank, s)).item() for s in range(3)]
print("RESULT", step.cache_info.source, losses)
dist.destroy_process_group()
"""


def _allow_core_dumps() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_plain_ranks(env: dict, core_dir: str | None = None) -> subprocess.CompletedProcess:
    """Two ``python -c`` ranks; one CompletedProcess whose text holds both ranks' output.
    With ``core_dir`` each rank runs in its own directory there with core dumps on, and the
    native backtrace of any core (gdb) is appended to the text."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.multiproc import free_port

    port = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        cwds = [tempfile.mkdtemp(dir=core_dir) if core_dir else None for _ in range(2)]
        procs = [subprocess.Popen([sys.executable, "-c", _PLAIN_RANK, str(rank), port, f"{tmp}/cache{rank}"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  cwd=cwds[rank], preexec_fn=_allow_core_dumps if core_dir else None)
                 for rank in range(2)]
        outs = []
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                out += "\n[timed out]"
            outs.append((proc.returncode, f"=== rank {rank} (exit {proc.returncode})\n{out}"))
    for rank, cwd in enumerate(cwds):
        cores = sorted(pathlib.Path(cwd).glob("core*")) if cwd else []
        if cores:
            bt = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt 30", sys.executable, str(cores[0])],
                                capture_output=True, text=True, timeout=300)
            outs.append((0, f"=== rank {rank} core {cores[0]}\n{bt.stdout[-12000:]}"))
        elif cwd:
            import shutil

            shutil.rmtree(cwd, ignore_errors=True)
    rc = next((code for code, _ in outs if code), 0)
    if rc == 0 and sum("RESULT" in text for _, text in outs) < 2:
        rc = 1  # a rank that exits 0 without its result also counts
    return subprocess.CompletedProcess([], rc, "".join(text for _, text in outs), "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--builds", type=int, default=0, help="sequential offline builds per run instead")
    parser.add_argument("--plain-ranks", action="store_true", help="two python -c ranks per run instead")
    parser.add_argument("--core-dir", help="--plain-ranks: keep core dumps here and print their gdb backtraces")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_builds(args.builds) if args.builds else child(args.steps)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "MALLOC_CHECK_": "3",
           "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    crashes, kinds, start = 0, collections.Counter(), time.time()
    for run in range(1, args.runs + 1):
        if args.plain_ranks:
            proc = run_plain_ranks(env, args.core_dir)
        else:
            proc = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps),
                                   "--builds", str(args.builds)], env=env,
                                  capture_output=True, text=True, timeout=900)
        text = proc.stdout + proc.stderr
        signs = [s for s in SIGNS if s in text]
        if proc.returncode != 0 or signs:
            crashes += 1
            kind = signs[0] if signs else f"exit {proc.returncode}"
            if kinds[kind] == 0:
                print(f"--- run {run}: {kind}\n{text[-16000:]}")
            kinds[kind] += 1
        print(f"run {run}: {'crash' if proc.returncode or signs else 'ok'} "
              f"({time.time() - start:.0f} s, {crashes} crashes so far)", flush=True)
    print(f"{args.runs} runs, {crashes} crashes: {dict(kinds)}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
