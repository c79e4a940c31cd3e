"""Fuzz the artifact loaders with as many mutated manifests and graph docs as you like.

    PYTHONPATH=. python tools/fuzz/fuzz_artifacts.py [--manifests 5000] [--graphs 5000] [--seed N]

The suite (tests/format/test_integrity.py) runs a few hundred to a thousand rounds of each fuzzer from
fixed seeds; this runs its very fuzzers (same mutators, same feeds) on a fresh build of the
small MLP job at world size 2, from a random seed unless one is given. Every mutated input must
be accepted or refused with an ``SpmdAotError``; anything else is a loader bug: the first few
are printed with their inputs, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "format")]  # support.*, test_integrity


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifests", type=int, default=5000, help="mutated manifests (default %(default)s)")
    parser.add_argument("--graphs", type=int, default=5000, help="mutated graph docs (default %(default)s)")
    parser.add_argument("--seed", type=int, help="first seed (default: random); the graph fuzzer uses seed + 1")
    args = parser.parse_args(argv)

    import spmd_aot
    import test_integrity
    from support.jobs import make_job
    from spmd_aot.store import LocalStore

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"fuzz: seed {seed} (rerun: --seed {seed})", flush=True)
    failed = False
    with tempfile.TemporaryDirectory(prefix="spmd-aot-fuzz-") as tmp:
        store = LocalStore(tmp)
        digest = spmd_aot.build(make_job("mlp", "sgd"), world_size=2, store=store).digest
        for name, fuzz, rounds, s in (("manifest", test_integrity.fuzz_manifests, args.manifests, seed),
                                      ("graph", test_integrity.fuzz_graphs, args.graphs, seed + 1)):
            start = time.perf_counter()
            tally = fuzz(store, digest, rounds, s)
            print(f"{name} fuzz: {tally.tried} tried, {tally.refused} refused, {tally.accepted} accepted, "
                  f"{len(tally.foreign)} foreign exceptions (must be 0), {time.perf_counter() - start:.0f} s")
            for line in tally.foreign[:5]:
                print(f"  {line}")
            failed |= bool(tally.foreign)
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
