"""Build time of an entry with compiled kernels (``--kernels``) as the model deepens.

The kernels are compiled one library per distinct segment of the step (a repeated block once),
so their build time should not grow with depth. Each depth builds in a fresh process with an empty
spmd-aot cache (Inductor's probes of the CPU, kept in Inductor's own cache directory, are the only
state shared between runs), then runs 3 steps with the kernels and 3 with the interpreted graph of
the same entry from the same start (no signing key: ``trust_cache`` alone decides which runs), and
prints the largest parameter difference.

    python tools/bench/bench_kernel_build.py --layers 4,12,24

Columns: build wall seconds and CPU seconds (the process and its C++ compilers), the kernel
compile's own seconds, libraries and calls in the kernels blob, |Δparam| kernels vs interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(layers: int, d_model: int, cache_dir: str) -> dict:
    import torch

    sys.path.insert(0, HERE)
    import bench_start

    import spmd_aot
    from spmd_aot.entries import read_manifest
    from spmd_aot.examples.models import train_step
    from spmd_aot.format.kernels_blob import unpack
    from spmd_aot.store import open_store

    cfg = dict(layers=layers, d_model=d_model, seq=64, batch=2)
    job = spmd_aot.Job(step=train_step, model=lambda: bench_start._objects(cfg)[0],
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                       batch=lambda: bench_start._objects(cfg)[2])
    wall, before = time.perf_counter(), os.times()
    result = spmd_aot.build(job, world_size=1, cache_dir=cache_dir, kernels=True)
    after = os.times()
    wall = time.perf_counter() - wall
    cpu = sum(after[:4]) - sum(before[:4])
    store = open_store(cache_dir)
    doc = unpack(store.get(read_manifest(store, result.digest)["blobs"]["kernels"]), "kernels")
    params = {}
    for trust in (True, False):
        model, optim, batch = bench_start._objects(cfg)
        step = spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True, kernels=True, trust_cache=trust)
        for _ in range(3):
            step(model, optim, batch)
        params[trust] = [p.detach().clone() for p in model.parameters()]
    diff = max(float((a - b).abs().max()) for a, b in zip(params[True], params[False]))
    return {"layers": layers, "wall": wall, "cpu": cpu, "kernel_seconds": result.stats.get("kernel_seconds"),
            "libraries": len(doc["libraries"]), "calls": len(doc["calls"]), "diff": diff}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,12,24")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.d_model, args.cache_dir)))
        return 0
    print(f"# {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print("| layers | build wall s | build CPU s | kernel compile s | libraries | calls | |Δparam| vs interpreter |")
    print("|---|---|---|---|---|---|---|")
    for layers in [int(x) for x in args.layers.split(",")]:
        with tempfile.TemporaryDirectory(prefix="bench-kernel-build-") as cache_dir:
            out = subprocess.run([sys.executable, __file__, "--child", str(layers), "--d-model", str(args.d_model),
                                  "--cache-dir", cache_dir], capture_output=True, text=True,
                                 env={k: v for k, v in os.environ.items() if k != "SPMD_AOT_SIGNING_KEY"})
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {r['layers']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['kernel_seconds']:.1f} | {r['libraries']} | "
              f"{r['calls']} | {r['diff']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
