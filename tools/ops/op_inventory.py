"""Build one job for cpu and for cuda and print the operator overloads that differ between the graphs.

    python tools/ops/op_inventory.py [TARGET] [-w N] [-p replicate|shard] [--mesh-shape 2x2] [--tp-plan ...]

TARGET defaults to ``spmd_aot.examples.quickstart:job``. Building for cuda needs a CUDA-enabled
torch (no GPU: the CUDA wheel on a CPU box); each overload only in the CUDA graph is marked with
how loading treats it (``allowlist``: on the list with a contract; ``CUDA-only, unproven``: a
kernel the op fuzzer cannot run on CPU, loaded only with an opt-in, see docs/cuda.md;
``REFUSED``: not on the list). Exit status 0 unless a build fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import msgpack

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import spmd_aot  # noqa: E402
from spmd_aot.format.allowlist import allowed_ops, chosen_list  # noqa: E402
from spmd_aot.entries import read_manifest  # noqa: E402
from spmd_aot.job import load_target  # noqa: E402
from spmd_aot.store import LocalStore  # noqa: E402


def graph_ops(store: LocalStore, digest: str) -> dict[str, int]:
    """Overload name -> how many nodes call it."""
    doc = msgpack.unpackb(store.get(read_manifest(store, digest)["blobs"]["graph"]), raw=False)
    counts: dict[str, int] = {}
    for n in doc["nodes"]:
        if n["op"] == "call_function":
            counts[n["target"]] = counts.get(n["target"], 0) + 1
    return counts


def inventory(job, cache_dir: str, **options) -> tuple[dict, dict]:
    store = LocalStore(cache_dir)
    out = []
    for device in ("cpu", "cuda"):
        result = spmd_aot.build(job, device=device, cache_dir=cache_dir, **options)
        out.append(graph_ops(store, result.digest))
    return out[0], out[1]


def status(op: str) -> str:
    from spmd_aot.format.contracts import CONTRACTS

    if op in allowed_ops() and op in CONTRACTS:
        return "allowlist"
    return "REFUSED" if op not in ("operator.getitem",) else "allowlist"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", default="spmd_aot.examples.quickstart:job")
    parser.add_argument("-w", "--world-size", type=int, default=2)
    parser.add_argument("-p", "--placement", default="replicate")
    parser.add_argument("--mesh-shape", default=None, help="e.g. 2x2 (HSDP)")
    parser.add_argument("--tp-plan", default=None, help="'hf' or a plan as `spmd-aot build` takes it")
    args = parser.parse_args(argv)
    job = load_target(args.target)
    options = dict(world_size=args.world_size, placement=args.placement)
    if args.mesh_shape:
        options["mesh_shape"] = tuple(int(x) for x in args.mesh_shape.split("x"))
    if args.tp_plan:
        options["tp_plan"] = args.tp_plan
    with tempfile.TemporaryDirectory(prefix="op_inventory_") as cache_dir:
        cpu, cuda = inventory(job, cache_dir, **options)
    print(f"# {args.target} world {args.world_size} {args.placement}: {len(cpu)} overloads on cpu, "
          f"{len(cuda)} on cuda ({sum(cpu.values())} / {sum(cuda.values())} nodes)")
    print(f"# statuses against the op allowlist {chosen_list().describe()}")
    for op in sorted(set(cpu) - set(cuda)):
        print(f"- cpu only   {op} x{cpu[op]}")
    for op in sorted(set(cuda) - set(cpu)):
        print(f"+ cuda only  {op} x{cuda[op]}  [{status(op)}]")
    for op in sorted(set(cpu) & set(cuda)):
        if cpu[op] != cuda[op]:
            print(f"  both       {op} x{cpu[op]} cpu, x{cuda[op]} cuda")
    return 0


if __name__ == "__main__":
    sys.exit(main())
