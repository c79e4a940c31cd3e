"""The README's main job: build an example transformer for world sizes 1, 2 and 4 into a local
cache, then launch a 2-rank gloo training run that loads its step from that cache.

    python -m spmd_aot.examples.quickstart [--cache-dir cache] [--steps 20]

``job`` is also a build TARGET: ``spmd-aot build spmd_aot.examples.quickstart:job --world-size 8``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

import spmd_aot
from spmd_aot.examples.models import Transformer, train_step

VOCAB, SEQ, BATCH = 256, 32, 8
#: How the step is spread: the build and the job pass the same options (docs/options.md).
PARALLEL = spmd_aot.ParallelOptions("replicate")


def make_model() -> Transformer:
    return Transformer(vocab=VOCAB, d_model=128, n_heads=4, n_layers=4, max_len=SEQ)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def make_batch(rank: int = 0, step: int = 0):
    """Counting sequences from random starts: learnable, so the loss visibly falls."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    starts = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def job() -> spmd_aot.Job:
    return spmd_aot.Job(step=train_step, model=make_model, optimizer=make_optimizer,
                        batch=make_batch)


def build_all(cache_dir: str, world_sizes=(1, 2, 4)) -> None:
    for world in world_sizes:
        r = spmd_aot.build(job(), parallel=PARALLEL, run=spmd_aot.RunOptions(cache_dir=cache_dir), world_size=world)
        print(f"build  {r.plan.describe():32s} key {r.key[:12]}  {'built' if r.traced else 'cached':6s} "
              f"{r.stats['nodes']} nodes, {r.stats['collectives']} collectives, {r.seconds:.2f}s", flush=True)


def train(cache_dir: str, steps: int) -> None:
    """One rank of the training run (started by torchrun)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    step = spmd_aot.compile(train_step, parallel=PARALLEL, run=spmd_aot.RunOptions(cache_dir=cache_dir))
    model = make_model()
    optim = make_optimizer(model)
    for s in range(steps):
        loss = step(model, optim, make_batch(rank, s))
        if s == 0 and rank == 0:
            info = step.cache_info
            print(f"rank 0: cache {'hit' if info.hit else 'MISS'} (source {info.source}), key {info.key[:12]}, "
                  f"first call {info.seconds:.2f}s; tracing this step costs {info.trace_seconds:.2f}s, "
                  f"so start-up saved {max(info.trace_seconds - info.seconds, 0):.2f}s", flush=True)
        if rank == 0 and (s % 5 == 4 or s == steps - 1):
            print(f"rank 0: step {s + 1:3d}  local loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default="cache")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--train-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train_rank:
        train(args.cache_dir, args.steps)
        return 0
    start = time.perf_counter()
    build_all(args.cache_dir)
    print(f"built in {time.perf_counter() - start:.1f}s; launching 2 ranks (gloo, 127.0.0.1)", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "spmd_aot.examples.quickstart", "--train-rank", "--cache-dir", os.path.abspath(args.cache_dir),
           "--steps", str(args.steps)]
    # torchrun's own import of torch warns when numpy is absent (spmd-aot never needs numpy)
    quiet = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                   "ignore:Failed to initialize NumPy:UserWarning"]))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS=quiet)
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
