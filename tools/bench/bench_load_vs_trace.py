"""Trace+expand seconds vs load seconds for the example transformer job, in one run.

    python tools/bench/bench_load_vs_trace.py [--layers 12 24] [--world-size 2] [--repeats 3]

trace = what a cache miss costs before the first step: tracing forward + backward + AdamW
        under fake tensors, DTensor expansion, graph passes and encoding the artifact.
load  = what a hit costs: reading and re-hashing every blob, validating the manifest,
        rebuilding the graph from msgpack against the op allowlist and binding it
        to groups and device, ready to run (``Artifact.program``).
Each figure is the median of --repeats runs; the ratio is taken within this one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from spmd_aot.entries import read_artifact, store_artifact
from spmd_aot.examples.models import Transformer, train_step
from spmd_aot.keying.key import compute_key
from spmd_aot.building.pipeline import trace_to_blobs
from spmd_aot.parallel.plan import Plan
from spmd_aot.state import TrainState, initialize_optimizer_state
from spmd_aot.store import LocalStore
from spmd_aot.parallel.mesh import device_mesh, fake_world


fake_mode = FakeTensorMode()


def fake_state(layers: int, d_model: int, batch: int, seq: int, plan: Plan):
    with fake_mode:
        model = Transformer(vocab=1024, d_model=d_model, n_heads=8, n_layers=layers, max_len=seq)
        optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
        initialize_optimizer_state(optim)
        tokens = torch.randint(0, 1024, (batch, seq))
    return TrainState(model, optim, (tokens, tokens), plan)


def measure(layers: int, world: int, repeats: int, d_model: int) -> dict:
    plan = Plan(world)
    state = fake_state(layers, d_model, batch=8, seq=128, plan=plan)
    traces, loads = [], []
    with tempfile.TemporaryDirectory() as tmp, fake_world(world):
        store = LocalStore(tmp)
        key = compute_key(train_step, state, plan)
        mesh = device_mesh(plan)
        with fake_mode:
            inputs = state.graph_inputs()
        for _ in range(repeats):
            start = time.perf_counter()
            blobs = trace_to_blobs(train_step, state, plan, key, mesh, inputs)
            traces.append(time.perf_counter() - start)
        digest = store_artifact(store, key.key, blobs)
        for _ in range(repeats):
            start = time.perf_counter()
            artifact = read_artifact(store, digest)
            program = artifact.program(["0"], torch.device("cpu"))
            loads.append(time.perf_counter() - start)
        nodes = program.n_ops
    trace, load = statistics.median(traces), statistics.median(loads)
    return {"layers": layers, "nodes": nodes, "trace_s": trace, "load_s": load, "ratio": trace / load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"transformer d_model={args.d_model}, AdamW, world size {args.world_size}, "
          f"median of {args.repeats}")
    print(f"{'layers':>6} {'nodes':>7} {'trace+expand s':>15} {'load s':>8} {'load speed-up':>14}")
    for layers in args.layers:
        r = measure(layers, args.world_size, args.repeats, args.d_model)
        print(f"{r['layers']:>6} {r['nodes']:>7} {r['trace_s']:>15.3f} {r['load_s']:>8.3f} {r['ratio']:>13.1f}x",
              flush=True)


if __name__ == "__main__":
    main()
