"""Time the checks a load runs on the costliest graphs the load limits admit.

    PYTHONPATH=. python tools/stress/worst_case_load.py [--nodes N] [--tensors N]

Builds the small MLP job (world size 2), then writes crafted entries of its key (only the
documented format, as a writer of the cache without a signing key could) and times
``check_entry`` (what a load and ``spmd-aot verify`` run: read and hash every blob, decode the
graph, run it on meta tensors) on each:

* ``distinct``: the graph grown to ``--nodes`` nodes (default: the ``nodes`` load limit) with
  ``add.Scalar`` calls whose scalars all differ, so the meta check's memo never hits;
* ``memo``: the same with one scalar, every call a memo hit;
* ``foreach``: one foreach op over a list of ``--tensors`` tensors (default: the ``items`` limit),
  in a graph just large enough for the decoder's object limit to admit the list.

Each line says whether the entry loaded or how it was refused, and how long that took (wall
and CPU time: on a busy machine the CPU time is what the check costs).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def main(argv=None) -> int:
    from spmd_aot.format.limits import load_limits

    limits = load_limits()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=limits.nodes, help="graph nodes (default %(default)s)")
    parser.add_argument("--tensors", type=int, default=limits.items, help="foreach list length (default %(default)s)")
    parser.add_argument("--cases", default="distinct,memo,foreach", help="comma-separated (default %(default)s)")
    args = parser.parse_args(argv)

    import spmd_aot
    from support import costly
    from support.jobs import make_job
    from spmd_aot.errors import SpmdAotError
    from spmd_aot.entries import check_entry, read_manifest
    from spmd_aot.store import LocalStore

    with tempfile.TemporaryDirectory(prefix="spmd-aot-worst-") as tmp:
        store = LocalStore(tmp)
        digest = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, store=store).digest
        key = read_manifest(store, digest)["key"]
        extra = args.nodes - costly.base_nodes(store, digest)
        cases = {"distinct": lambda: costly.scalar_chain(store, digest, extra, distinct=True),
                 "memo": lambda: costly.scalar_chain(store, digest, extra, distinct=False),
                 # one foreach node, in a graph just large enough for the decoder to admit its list
                 "foreach": lambda: costly.scalar_chain(store, digest, max(
                     1, 6 * args.tensors // limits.objects_per_node - costly.base_nodes(store, digest)),
                     distinct=False) + costly.long_foreach(store, digest, args.tensors)}
        for name in args.cases.split(","):
            crafted = costly.store_with_nodes(store, digest, cases[name]())
            start, cpu = time.perf_counter(), time.process_time()
            try:
                check_entry(store, key, crafted)
                outcome = "loads"
            except SpmdAotError as exc:
                outcome = f"refused: {type(exc).__name__}: {str(exc)[:150]}"
            size = f"list of {args.tensors}" if name == "foreach" else f"{args.nodes} nodes"
            print(f"{name:9s} {size}: {time.perf_counter() - start:6.2f} s "
                  f"({time.process_time() - cpu:.2f} s of CPU), {outcome}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
