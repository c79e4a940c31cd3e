"""The CUDA path, checked end to end on a machine with a GPU: build, load, run, compare with eager.

    python tools/check_cuda.py                 # on a GPU machine: device cuda, NCCL where 2+ GPUs
    python tools/check_cuda.py --device cpu    # the same checks on CPU + gloo (how it is tested here)

This project's own machines have no GPU, so everything else verifies CPU + gloo only. When a
session is lent a GPU machine, this one script is what to run there (``PYTHONPATH=.``; it needs
no install). Each check prints one line, PASS or FAIL, with its figures:

1. **world 1**: build the example transformer + AdamW step offline for the device into a fresh
   cache, load it (``require_hit=True``: a miss fails the check), run ``--steps`` steps, and
   compare parameters, optimizer state and losses with eager on the same device. Then time the
   loaded step against eager, interleaved, synchronizing the device around each block.
2. **world 2** (NCCL needs one GPU per rank, so it runs only where there are 2+ GPUs; on CPU it
   runs with gloo): ``replicate`` against eager DDP and ``shard`` against eager FSDP2
   (``fully_shard`` per block, then the root), the same comparison on real ranks.

Exit status 0 only when every check that ran passed. The tolerance (``--tolerance``, default
1e-4 on parameters, optimizer state and losses) is the README's fp32 1e-5 with room for AdamW,
which turns rounding differences (a fused kernel against eager's loop, another GPU reduction
order) into larger steps; on CPU the differences measured 1e-6.

Run on a GPU machine: ``PYTHONPATH=. python tools/check_cuda.py`` (about a minute; it builds
into a temporary cache and leaves nothing behind).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import spmd_aot  # noqa: E402
from spmd_aot.examples.models import Transformer, train_step  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step as bench  # noqa: E402  (a sibling file: its rank launcher)

VOCAB, HEADS, SEQ, BATCH = 256, 4, 64, 8


def _model_and_optim(layers: int, d_model: int, device: str):
    torch.manual_seed(0)  # the same initial values on every rank and for every variant
    model = Transformer(vocab=VOCAB, d_model=d_model, n_heads=HEADS, n_layers=layers, max_len=SEQ)
    if device != "cpu":  # the build makes the model under fake tensors, where a no-op move fails
        model = model.to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _batch(rank: int, device: str):
    g = torch.Generator().manual_seed(1000 + rank)
    return tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(2))


def _job(layers: int, d_model: int, device: str) -> spmd_aot.Job:
    return spmd_aot.Job(step=train_step, model=lambda: _model_and_optim(layers, d_model, "cpu")[0],
                        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                        batch=lambda: _batch(0, "cpu"))


def _sync(device: str, world: int) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    if world > 1:
        dist.barrier()


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole value (a collective for DTensors: every rank calls it in the same order)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float()


def _max_difference(a_model, a_optim, b_model, b_optim) -> float:
    """Largest absolute difference over parameters and optimizer state (whole values); inf when
    a parameter's state is missing on either side (after a step, AdamW has state for each)."""
    worst = 0.0
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        worst = max(worst, (_full(p) - _full(q)).abs().max().item())
        sa, sb = a_optim.state.get(p, {}), b_optim.state.get(q, {})
        if not sa or set(sa) != set(sb):  # a state not found is a failed comparison, not a pass
            return float("inf")
        for k in sorted(sa):
            if isinstance(sa[k], torch.Tensor) and sa[k].dim() > 0:
                worst = max(worst, (_full(sa[k]) - _full(sb[k])).abs().max().item())
    return worst


def _eager(placement: str, world: int, layers: int, d_model: int, device: str):
    model, optim = _model_and_optim(layers, d_model, device)
    if world == 1:
        return model, optim, model
    if placement == "replicate":
        from torch.nn.parallel import DistributedDataParallel
        ids = [torch.cuda.current_device()] if device == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), optim, model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), model


def check(placement: str, world: int, rank: int, args, cache_dir: str) -> dict:
    """Parity after ``args.steps`` steps, then interleaved timing. Every rank returns its figures."""
    device = args.device
    batch = _batch(rank, device)
    model, optim = _model_and_optim(args.layers, args.d_model, device)
    step = spmd_aot.compile(train_step, placement=placement, cache_dir=cache_dir, require_hit=True)
    eager_fn_model, eager_optim, eager_model = _eager(placement, world, args.layers, args.d_model, device)
    losses = []
    for _ in range(args.steps):
        loaded_loss = step(model, optim, batch)
        eager_loss = train_step(eager_fn_model, eager_optim, batch)
        losses.append(abs(float(loaded_loss.detach()) - float(eager_loss.detach())))
    param_diff = _max_difference(model, optim, eager_model, eager_optim)

    variants = {"loaded": lambda: step(model, optim, batch),
                "eager": lambda: train_step(eager_fn_model, eager_optim, batch)}
    for fn in variants.values():
        for _ in range(2):
            fn()
    times = bench.timed_blocks(variants, args.blocks, args.timed_steps, lambda: _sync(device, world))
    return dict(placement=placement, world=world, hit=step.cache_info.hit, loss_diff=max(losses),
                param_diff=param_diff, loaded_ms=statistics.median(times["loaded"]),
                eager_ms=statistics.median(times["eager"]),
                ratio=bench.median_ratio(times["loaded"], times["eager"]))


def _report(row: dict, tolerance: float, eager_name: str) -> bool:
    ok = row["hit"] and row["loss_diff"] <= tolerance and row["param_diff"] <= tolerance
    print(f"{'PASS' if ok else 'FAIL'} world {row['world']} {row['placement']}: cache hit {row['hit']}, "
          f"max |loss - eager| {row['loss_diff']:.2e}, max |param/state - eager| {row['param_diff']:.2e} "
          f"(tolerance {tolerance:.0e}); loaded {row['loaded_ms']:.2f} ms, {eager_name} {row['eager_ms']:.2f} ms, "
          f"loaded/eager {row['ratio']:.3f}", flush=True)
    return ok


def _rank_main(rank, world, port, args, _settings, cache_dir, results):
    """One world-2 rank, started by ``bench_step.run_world`` (which passes ``args`` through)."""
    try:
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        rows = [check(p, world, rank, args, cache_dir) for p in ("replicate", "shard")]
        results.put((rank, "ok", rows))
    except BaseException as exc:  # report it; never leave the parent waiting
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="steps compared with eager")
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per variant")
    parser.add_argument("--timed-steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="max abs difference allowed (AdamW amplifies rounding: see README)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the world-2 ranks")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device visible: run this on a GPU machine, or with --device cpu", flush=True)
        return 1
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    print(f"# torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name(0)}, {gpus} GPU(s))" if gpus else "")
          + f"; transformer {args.layers} layers, d_model {args.d_model}, context {SEQ}, batch {BATCH}, AdamW",
          flush=True)
    all_ok = True
    with tempfile.TemporaryDirectory(prefix="check_cuda_") as cache_dir:
        job = _job(args.layers, args.d_model, args.device)
        start = time.perf_counter()
        spmd_aot.build(job, world_size=1, device=args.device, cache_dir=cache_dir)
        print(f"# built world 1 for {args.device} in {time.perf_counter() - start:.1f}s", flush=True)
        try:
            all_ok &= _report(check("replicate", 1, 0, args, cache_dir), args.tolerance, "eager")
        except Exception:
            print(f"FAIL world 1: {traceback.format_exc()}", flush=True)
            all_ok = False

        if args.device == "cuda" and gpus < 2:
            print(f"SKIP world 2: NCCL needs a GPU per rank, this machine has {gpus}", flush=True)
            return 0 if all_ok else 1
        for placement in ("replicate", "shard"):
            spmd_aot.build(job, world_size=2, placement=placement, device=args.device, cache_dir=cache_dir)
        try:  # spawned ranks (CUDA cannot be forked into), as bench_step starts them
            rows = bench.run_world(2, args, None, cache_dir, args.timeout, rank_main=_rank_main)
        except RuntimeError as exc:
            print(f"FAIL world 2: {exc}", flush=True)
            return 1
        for row in rows:
            all_ok &= _report(row, args.tolerance, "DDP" if row["placement"] == "replicate" else "FSDP2")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
