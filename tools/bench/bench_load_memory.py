"""Memory and time to load a large graph blob: decode (streaming, within the load limits) and
the meta-tensor check, for graphs of N nodes (a chain of adds). Each size is read from a file
by a fresh process, so the peak RSS growth measured is the load's own.

    PYTHONPATH=. python tools/bench/bench_load_memory.py [--nodes 100000 --nodes 1000000]

Prints blob bytes, seconds and peak RSS growth over the process's RSS with the blob read (what
loading adds) for each stage, and that growth / blob size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time


def _graph(n: int) -> bytes:
    import msgpack

    nodes = [{"op": "placeholder", "name": "x", "target": "x", "args": [], "kwargs": {}}]
    prev = "x"
    for i in range(n):
        nodes.append({"op": "call_function", "name": f"add_{i}", "target": "aten::add.Tensor",
                      "args": [{"~node": prev}, {"~node": "x"}], "kwargs": {}})
        prev = f"add_{i}"
    nodes.append({"op": "output", "name": "output", "target": "output", "args": [{"~list": [{"~node": prev}]}],
                  "kwargs": {}})
    return msgpack.packb({"format": 1, "nodes": nodes}, use_bin_type=True)


def _rss() -> int:
    """Peak resident set size so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(path: str) -> dict:
    import torch

    from spmd_aot.entries.gc_pause import paused as _gc_paused
    from spmd_aot.format.serialize import decode_graph
    from spmd_aot.format.validate import check_graph

    with open(path, "rb") as f:
        blob = f.read()
    n = blob.count(b"aten::add.Tensor")
    torch.empty(1, device="meta") + 1  # load torch's lazily initialised parts before measuring
    base = _current_rss()  # the blob is already in memory: growth is what loading adds
    with _gc_paused():  # as a job's load runs them
        t0 = time.perf_counter()
        nodes = decode_graph(blob, groups=[], device=torch.device("cpu"))
        t1 = time.perf_counter()
        after_decode = _rss()
        check_graph(nodes, {}, [{"local_shape": [16], "dtype": "float32"}], device_type="cpu")
        t2 = time.perf_counter()
    return {"nodes": n, "blob_bytes": len(blob), "decode_s": round(t1 - t0, 2), "check_s": round(t2 - t1, 2),
            "decode_rss_growth": after_decode - base, "total_rss_growth": _rss() - base}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, action="append")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    for n in args.nodes or [100_000, 1_000_000]:
        with tempfile.NamedTemporaryFile(suffix=".msgpack") as f:
            f.write(_graph(n))
            f.flush()
            out = subprocess.run([sys.executable, __file__, "--child", f.name], capture_output=True, text=True,
                                 check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        mib = 1 << 20
        print(f"{r['nodes']:>9} nodes  blob {r['blob_bytes'] / mib:7.1f} MiB  decode {r['decode_s']:6.2f} s  "
              f"meta check {r['check_s']:6.2f} s  RSS growth decode {r['decode_rss_growth'] / mib:7.1f} MiB "
              f"total {r['total_rss_growth'] / mib:7.1f} MiB  ({r['total_rss_growth'] / r['blob_bytes']:.1f}x blob)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
