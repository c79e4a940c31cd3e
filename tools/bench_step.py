"""Per-step time of a compiled (loaded) step vs the same eager step, measured in one run.

    python tools/bench_step.py [--layers 6] [--d-model 64] [--steps 30]

Single process (world size 1), CPU, the example transformer with AdamW. The compiled step runs
a loaded artifact (``Program``); the eager step is the user's function. The ratio is what a CPU
job pays (or saves) per step for never retracing; on CUDA, kernel time dominates both.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import spmd_aot
from spmd_aot.examples.models import Transformer, train_step


def _ms_per_step(fn, model, optim, batch, steps: int) -> float:
    for _ in range(3):
        fn(model, optim, batch)
    start = time.perf_counter()
    for _ in range(steps):
        fn(model, optim, batch)
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    def objects():
        torch.manual_seed(0)
        model = Transformer(vocab=256, d_model=args.d_model, n_heads=4, n_layers=args.layers, max_len=16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    batch = (torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16)))
    with tempfile.TemporaryDirectory() as cache:
        step = spmd_aot.compile(train_step, cache_dir=cache)
        compiled = _ms_per_step(step, *objects(), batch, args.steps)
        eager = _ms_per_step(train_step, *objects(), batch, args.steps)
        ops = step._bound.program.n_ops
    print(f"transformer layers={args.layers} d_model={args.d_model}, AdamW, world 1, CPU, {args.steps} steps")
    print(f"compiled {compiled:.2f} ms/step ({ops} ops)   eager {eager:.2f} ms/step   "
          f"compiled/eager {compiled / eager:.2f}")


if __name__ == "__main__":
    main()
