"""Peak live tensor bytes of one train step: the loaded ``shard`` step vs eager FSDP2.

The bench transformer (d_model 128, 4 layers, context 64, AdamW), world 2 on gloo, placement
``shard`` with the default groups (one per block), against eager FSDP2 with ``fully_shard``
on every block and on the root (the same groups). Both are measured the same way, by
``spmd_aot.building.peak_memory.PeakMemory`` on the second step (the first one builds or lazily initializes):
every storage an op returns counts from its creation until it is freed, plus the step's
state and batch (and FSDP2's unsharded-parameter storages, which it resizes in place). The
build-time estimate ``stats["peak_bytes"]`` (from the graph alone) is printed beside them.

    PYTHONPATH=. python tools/bench/bench_memory.py [--layers 4] [--keep-params-after-forward]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile

VOCAB, D_MODEL, HEADS, CTX, BATCH = 256, 128, 4, 64, 8


def _setup(rank, world, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _job(layers):
    import torch

    from spmd_aot.examples.models import Transformer

    def model():
        return Transformer(VOCAB, D_MODEL, HEADS, layers, CTX)

    def optim(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-3)

    def batch(rank, step):
        g = torch.Generator().manual_seed(1000 * rank + step)
        return torch.randint(0, VOCAB, (BATCH, CTX), generator=g), torch.randint(0, VOCAB, (BATCH, CTX), generator=g)

    return model, optim, batch


def _worker(rank, world, port, layers, reshard, cache_dir, queue):
    try:
        _setup(rank, world, port)
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import spmd_aot
        from spmd_aot.entries import read_manifest
        from spmd_aot.examples.models import train_step
        from spmd_aot.building.peak_memory import PeakMemory, fsdp2_storages, state_tensors
        from spmd_aot.store import LocalStore

        make_model, make_optim, batch = _job(layers)
        torch.manual_seed(0)
        ref = make_model()
        mesh = init_device_mesh("cpu", (world,))
        for block in ref.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(ref, mesh=mesh)
        ref_optim = make_optim(ref)
        train_step(ref, ref_optim, batch(rank, 0))
        b = batch(rank, 1)
        with PeakMemory(state_tensors(ref, ref_optim, b) + fsdp2_storages(ref)) as eager:
            train_step(ref, ref_optim, b)

        torch.manual_seed(0)
        model = make_model()
        optim = make_optim(model)
        step = spmd_aot.compile(train_step, cache_dir=cache_dir, placement="shard", reshard_after_forward=reshard)
        step(model, optim, batch(rank, 0))
        b = batch(rank, 1)
        storages = [getattr(t, "_spmd_aot_storage", t) for t in state_tensors(model, optim)]
        with PeakMemory(storages + state_tensors(b)) as loaded:
            step(model, optim, b)
        stats = read_manifest(LocalStore(cache_dir), step.cache_info.digest)["stats"]
        queue.put((rank, {"eager_fsdp2": eager.peak, "eager_state": eager.baseline, "loaded": loaded.peak,
                          "loaded_state": loaded.baseline, "estimate": stats["peak_bytes"]}))
    except BaseException as exc:
        import traceback

        queue.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--keep-params-after-forward", action="store_true")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as cache:
        procs = [ctx.Process(target=_worker, args=(r, args.world, port, args.layers,
                                                   not args.keep_params_after_forward, cache, queue))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    for rank in sorted(results):
        r = results[rank]
        if isinstance(r, str):
            print(f"rank {rank} failed: {r}", file=sys.stderr)
            return 1
        mib = lambda n: f"{n / 2**20:8.3f} MiB"  # noqa: E731
        print(f"rank {rank}: loaded {mib(r['loaded'])} (estimate {mib(r['estimate'])}, state "
              f"{mib(r['loaded_state'])})  eager FSDP2 {mib(r['eager_fsdp2'])} (state {mib(r['eager_state'])})  "
              f"ratio {r['loaded'] / r['eager_fsdp2']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
