"""``plan``: which configurations of a job fit on GPUs of a given memory, before any build.

Every candidate mesh for the world size (``planning/candidates.py``) with its per-rank peak, the
bytes each rank sends per step by collective kind, and whether the peak fits in the GPU's memory
less a headroom fraction (the allocator's cache and fragmentation, the CUDA context, the
communication library's buffers: none of them is a tensor the estimate counts). The job is
measured on fake tensors a few times (once per compute dtype and checkpointing choice); every
mesh is arithmetic over those measurements (``planning/memory_model.py``), so a 405B-shaped job
plans in seconds on a CPU box.
"""

from __future__ import annotations

import argparse

from ..errors import SpmdAotError
from .build import load_job
from .option_flags import given
from .report import EXIT_OK, EXIT_PROBLEMS, human_bytes, print_table

__all__ = ["cmd_plan", "add_plan_command", "DEFAULT_HEADROOM"]

#: The fraction of a GPU's memory the plan leaves to what it does not count (module doc).
DEFAULT_HEADROOM = 0.10

_EXAMPLE = """example:
  spmd-aot plan train.py:job -w 1024 --gpu-memory 80GiB --tp-plan 'layers.*.attn.wq=colwise' ...

  lists replicate (DDP), shard (FSDP) and HSDP meshes of 1024 ranks, with TP degrees 1-8 when a
  --tp-plan is given, each with and without activation checkpointing per block and in fp32 and
  bf16 compute, fitting ones first (fewest bytes communicated first). Exit status 0 when one
  fits, 1 when none does. The CHECKPOINT column's 'ac' means every block checkpointed
  (torch.utils.checkpoint in the model's code): spmd-aot keeps what the model's code does."""


def add_plan_command(sub, add_flags, add_common, positive_int) -> None:
    p = sub.add_parser("plan", help="list which meshes and options of a job fit on GPUs of a given memory",
                       description="Estimate, from fake tensors and without building, every candidate "
                                   "configuration of TARGET for WORLD_SIZE ranks: per-rank peak memory, "
                                   "bytes per collective kind per step, and whether it fits.",
                       epilog=_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("what to plan")
    p.add_argument("target", metavar="TARGET", help="'pkg.module:job' or 'path/to/file.py:job'")
    target.add_argument("-w", "--world-size", type=positive_int, required=True, metavar="N",
                        help="Number of GPUs the job will run on.")
    target.add_argument("--gpu-memory", type=_size, required=True, metavar="SIZE",
                        help="Memory of one GPU, e.g. 80GiB, 141G (binary units).")
    target.add_argument("--headroom", type=_fraction, default=DEFAULT_HEADROOM, metavar="FRACTION",
                        help=f"Fraction of the GPU's memory left to what the estimate does not count "
                             f"(allocator cache, CUDA context, NCCL buffers). Default: {DEFAULT_HEADROOM}.")
    target.add_argument("--fitting", action="store_true", help="List only the configurations that fit.")
    target.add_argument("--show", type=int, default=1, metavar="K",
                        help="Print the arithmetic of the first K rows (default 1).")
    groups = add_flags(p, "explain", groups={target.title: target})
    add_common(p, groups)
    p.set_defaults(func=cmd_plan)


def _size(text: str) -> int:
    from ..store.eviction import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.1, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {value}")
    return value


def cmd_plan(args) -> int:
    from ..options import ParallelOptions
    from ..planning.candidates import candidates, plan_fit

    fields = given(args, ParallelOptions)
    unread = sorted(set(fields) - {"placement", "mesh_shape", "tp_plan", "param_dtype", "cast_forward_inputs",
                                   "reshard_after_forward", "bucket_cap_mb"})
    if unread:
        raise SpmdAotError(f"plan does not model {', '.join(unread)} yet; plan without them "
                           "(docs/plan.md lists what the plan covers)")
    options = ParallelOptions(**fields)  # validated as a build would
    tp_plan = options.tp_plan
    dtypes = (options.param_dtype,) if "param_dtype" in fields else (None, _bf16())
    cands = candidates(args.world_size, tp=bool(tp_plan),
                       placements=(options.placement,) if "placement" in fields else ("replicate", "shard"),
                       mesh_shape=options.mesh_shape, dtypes=dtypes)
    if not cands:
        raise SpmdAotError(f"no configuration of {args.world_size} ranks matches --mesh-shape "
                           f"{options.mesh_shape} and --placement {options.placement}")
    import dataclasses

    cands = [dataclasses.replace(c, reshard_after_forward=options.reshard_after_forward,
                                 bucket_cap_mb=options.bucket_cap_mb) for c in cands]
    job = load_job(args.target)
    result = plan_fit(job, cands, tp_plan, cast_forward_inputs=options.cast_forward_inputs)
    budget = int(args.gpu_memory * (1 - args.headroom))
    rows = sorted(result.estimates, key=lambda e: (e.peak_bytes > budget, sum(e.comm.values()), e.peak_bytes))
    if args.fitting:
        rows = [e for e in rows if e.peak_bytes <= budget]
    print_table(["CONFIG", "PEAK/RANK", "FITS", "ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE", "BUILD WITH"],
                [[e.candidate.describe(), human_bytes(e.peak_bytes), "yes" if e.peak_bytes <= budget else "no",
                  *(human_bytes(e.comm.get(k, 0)) for k in ("all_gather", "reduce_scatter", "all_reduce")),
                  _flags(e.candidate)] for e in rows], right={1, 3, 4, 5})
    print(f"{len(result.estimates)} configurations of {result.param_numel:,} parameters from {result.measurements} "
          f"fake runs ({result.method}) in {result.seconds:.1f} s; fits: peak <= {human_bytes(budget)} "
          f"({human_bytes(args.gpu_memory)} less {args.headroom:g} headroom); bytes: each rank's payload per step")
    for e in rows[:max(0, args.show)]:
        print(f"{e.candidate.describe()}: peak {human_bytes(e.peak_bytes)} in the {e.phase} =")
        for name, value in e.terms.items():
            print(f"  {human_bytes(value):>10}  {name}")
    return EXIT_OK if any(e.peak_bytes <= budget for e in result.estimates) else EXIT_PROBLEMS


def _bf16():
    import torch

    return torch.bfloat16


def _flags(c) -> str:
    """The build flags of ``c`` (the TP plan's entries are the ones given to ``plan``)."""
    words = ["-p", c.placement]
    if len(c.mesh_shape) > 1 or c.tp > 1:
        words += ["--mesh-shape", "x".join(map(str, c.mesh_shape))]
    if c.tp > 1:
        words.append("--tp-plan ...")
    if c.param_dtype is not None:
        words += ["--param-dtype", {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(c.param_dtype), "fp32")]
    if c.checkpoint:
        words.append("(checkpoint blocks)")
    return " ".join(words)
