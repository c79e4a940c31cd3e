"""Stress the artifact cache with racing and crashing builders; prints figures, exit 1 on a violation.

    python tools/stress/stress_cache.py race  [--workers 16] [--rounds 20]
    python tools/stress/stress_cache.py crash [--builds 50] [--seed N] [--parallel 2]
    python tools/stress/stress_cache.py gc    [--seconds 60] [--builders 2] [--loaders 2]

race:  a pool of N worker processes (started once: one torch import each) builds the same
       small MLP job (world size 2) into a fresh cache dir per round, all released by one
       barrier. Every round must trace exactly once, give every worker the same manifest
       digest, and raise nothing.
crash: builder processes are SIGKILLed at random write stages (``spmd_aot.store.faults``; the
       blob stages at a random occurrence, so the manifest's or a later part's write can be
       the one cut). Half the caches already hold another entry. After each kill every ref
       must serve an artifact that reads fully; then a normal build must succeed and load,
       leave no temp files, and ``LocalStore.verify()`` must report nothing.
gc:    one process runs ``collect_garbage`` (evicting everything older than 0.5 s, and down
       to a small size) in a loop while builder processes rebuild a few configurations and
       loader processes load them: as a job does (``spmd_aot.compile`` at world size 1, which
       traces on a miss) and as a raw reader (lease, then check every part is there). There
       must be 0 parts missing under a lease and 0 errors surfaced to users.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = pathlib.Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def make_job():
    import torch

    import spmd_aot
    from spmd_aot.examples.models import MLP, train_step

    return spmd_aot.Job(step=train_step, model=lambda: MLP(32, 64, 10),
                        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                        batch=lambda: (torch.randn(4, 32), torch.randint(0, 10, (4,))))


# ---------------------------------------------------------------------------- race
def _race_worker(index, tasks, results, barrier):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        import spmd_aot

        job = make_job()
    except BaseException as exc:  # report instead of leaving the parent waiting
        results.put((index, "ready", f"{type(exc).__name__}: {exc}"))
        return
    results.put((index, "ready", None))
    while (task := tasks.get()) is not None:
        round_no, cache_dir = task
        try:
            barrier.wait(timeout=300)
            r = spmd_aot.build(job, world_size=2, cache_dir=cache_dir)
            results.put((index, round_no, (r.traced, r.digest, None)))
        except BaseException as exc:
            results.put((index, round_no, (None, None, f"{type(exc).__name__}: {exc}")))


def race_rounds(workers: int, rounds: int, root: pathlib.Path, timeout: float = 300.0, context=None):
    """Run the race; returns one list per round of ``(traced, digest, error)`` per worker.

    ``context``: the multiprocessing context that starts the workers (default: spawn; the
    tests pass one that forks them from a server with torch already imported).
    """
    import multiprocessing as mp
    import queue as queue_mod

    ctx = context or mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(workers)
    tasks = [ctx.Queue() for _ in range(workers)]
    procs = [ctx.Process(target=_race_worker, args=(i, tasks[i], results, barrier), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    try:
        for _ in range(workers):
            index, tag, error = results.get(timeout=timeout)
            if error:
                raise RuntimeError(f"race worker {index} failed to start: {error}")
        out = []
        for round_no in range(rounds):
            cache_dir = root / f"round{round_no:03d}"
            for q in tasks:
                q.put((round_no, str(cache_dir)))
            got = {}
            while len(got) < workers:
                try:
                    index, tag, value = results.get(timeout=timeout)
                except queue_mod.Empty:
                    raise TimeoutError(f"round {round_no}: only {len(got)} of {workers} workers "
                                       f"answered in {timeout:g} s") from None
                assert tag == round_no, (tag, round_no)
                got[index] = value
            out.append([got[i] for i in range(workers)])
        return out
    finally:
        for q in tasks:
            q.put(None)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def summarize_race(results) -> dict:
    return {
        "rounds": len(results),
        "traces_per_round": [sum(1 for traced, _, _ in r if traced) for r in results],
        "digests_per_round": [len({d for _, d, e in r if e is None}) for r in results],
        "errors": [e for r in results for _, _, e in r if e is not None],
    }


def cmd_race(args) -> int:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spmd-aot-race-") as tmp:
        results = race_rounds(args.workers, args.rounds, pathlib.Path(tmp))
    s = summarize_race(results)
    print(f"race: {args.workers} workers x {args.rounds} rounds, one fresh cache dir per round, "
          f"{time.perf_counter() - start:.1f} s")
    print(f"rounds:                     {s['rounds']}")
    print(f"traces per round:           {s['traces_per_round']} (must be 1 each)")
    print(f"distinct digests per round: {s['digests_per_round']} (must be 1 each)")
    print(f"errors:                     {len(s['errors'])} (must be 0)")
    for e in s["errors"][:5]:
        print(f"  {e}")
    ok = (s["rounds"] == args.rounds and set(s["traces_per_round"]) == {1}
          and set(s["digests_per_round"]) == {1} and not s["errors"])
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


# ---------------------------------------------------------------------------- crash
def _pick_stage(rng: random.Random, blob_writes: int) -> str:
    """A stage, uniformly; for blob stages, one of the ``blob_writes`` blob writes, uniformly."""
    from spmd_aot.store.faults import STAGES

    stage = rng.choice(STAGES)
    return f"{stage}:{rng.randint(1, blob_writes)}" if stage.startswith("blob.") else stage


def run_builder(cache: pathlib.Path, world_size: int, crash_at: str | None, timeout: float = 300.0):
    from spmd_aot.store.faults import ENV_CRASH_AT

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(ENV_CRASH_AT, None)
    if crash_at:
        env[ENV_CRASH_AT] = crash_at
    return subprocess.run([sys.executable, __file__, "_build", str(cache), str(world_size)], env=env,
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def check_refs(store) -> tuple[int, list[str]]:
    """(refs, problems): every ref must name an artifact that reads fully and decodes."""
    import torch

    from spmd_aot.entries import read_artifact
    from spmd_aot.errors import SpmdAotError

    problems = []
    refs = store.refs()
    for key, digest in refs.items():
        try:
            art = read_artifact(store, digest)
            art.program([str(i) for i in range(len(art.plan.mesh_shape))], torch.device("cpu"))
            if art.manifest["key"] != key:
                problems.append(f"ref {key[:12]} -> manifest of key {art.manifest['key'][:12]}")
        except SpmdAotError as exc:
            problems.append(f"ref {key[:12]}: {exc}")
    return len(refs), problems


def cmd_crash(args) -> int:
    import spmd_aot
    from spmd_aot.store import LocalStore

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    print(f"crash: {args.builds} builds killed at random stages, seed {seed} "
          f"(rerun: --seed {seed})", flush=True)
    from spmd_aot.entries import read_manifest

    start = time.perf_counter()
    job = make_job()
    with tempfile.TemporaryDirectory(prefix="spmd-aot-crash-") as tmp:
        tmp = pathlib.Path(tmp)
        other = tmp / "other"  # a cache already holding another entry (world size 4)
        spmd_aot.build(job, world_size=4, cache_dir=other)
        reference = spmd_aot.build(job, world_size=2, cache_dir=tmp / "reference")
        parts = set(read_manifest(LocalStore(tmp / "reference"), reference.digest)["blobs"].values())
        # Blobs a build writes: its parts not already stored (put skips those), then the manifest.
        fresh_writes = len(parts) + 1
        shared_writes = len(parts - set(LocalStore(other).blobs())) + 1
        plans = []
        for i in range(args.builds):
            cache = tmp / f"build{i:03d}"
            prefilled = rng.random() < 0.5
            if prefilled:
                shutil.copytree(other, cache)
            plans.append((cache, _pick_stage(rng, shared_writes if prefilled else fresh_writes)))
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            procs = list(pool.map(lambda p: run_builder(p[0], 2, p[1]), plans))

        killed, not_killed, invalid, rebuild_failures, verify_problems, tmp_left = 0, [], [], [], [], 0
        by_stage = collections.Counter()
        for (cache, stage), proc in zip(plans, procs):
            if proc.returncode == -signal.SIGKILL:
                killed += 1
                by_stage[stage.split(":")[0]] += 1
            else:
                not_killed.append(f"{stage}: rc {proc.returncode} {proc.stderr[-300:]}")
            store = LocalStore(cache, lock_timeout=30.0)
            _, problems = check_refs(store)
            invalid += [f"{cache.name} after kill at {stage}: {p}" for p in problems]
            try:
                result = spmd_aot.build(job, world_size=2, store=store)
                _, problems = check_refs(store)
                if store.get_ref(result.key) != result.digest:
                    problems.append("the rebuilt key has no ref to the build's digest")
                rebuild_failures += [f"{cache.name} ({stage}): {p}" for p in problems]
            except spmd_aot.SpmdAotError as exc:
                rebuild_failures.append(f"{cache.name} ({stage}): {type(exc).__name__}: {exc}")
            verify_problems += [f"{cache.name} ({stage}): {p}" for p in store.verify()]
            tmp_left += len(list((cache / "tmp").iterdir()))
    print(f"builds killed:                {killed} of {args.builds}")
    print(f"kills by stage:               {dict(sorted(by_stage.items()))}")
    print(f"invalid entries served:       {len(invalid)} (must be 0)")
    print(f"rebuild/load failures:        {len(rebuild_failures)} (must be 0)")
    print(f"verify problems after:        {len(verify_problems)} (must be 0)")
    print(f"temp files left after rebuild: {tmp_left} (must be 0)")
    print(f"seconds:                      {time.perf_counter() - start:.1f}")
    for line in (not_killed + invalid + rebuild_failures + [str(p) for p in verify_problems])[:10]:
        print(f"  {line}")
    ok = killed == args.builds and not invalid and not rebuild_failures and not verify_problems \
        and tmp_left == 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def cmd_build(args) -> int:
    """Internal: one plain build (the process the crash mode kills)."""
    import torch

    torch.set_num_threads(1)
    import spmd_aot

    r = spmd_aot.build(make_job(), world_size=args.world_size, cache_dir=args.cache_dir)
    print("BUILT", r.digest, r.traced)
    return 0


# ---------------------------------------------------------------------------- gc
def _sizes():
    return [2, 4, 6, 8]  # batch sizes: one key each


def _gc_job(batch: int):
    import torch

    import spmd_aot
    from spmd_aot.examples.models import MLP, train_step

    return spmd_aot.Job(step=train_step, model=lambda: MLP(16, 32, 5),
                        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                        batch=lambda: (torch.randn(batch, 16), torch.randint(0, 5, (batch,))))


def _gc_worker(role: str, index: int, cache: str, deadline: float, out) -> None:
    import torch

    torch.set_num_threads(1)
    import spmd_aot
    from spmd_aot.entries import read_manifest
    from spmd_aot.store import LocalStore
    from spmd_aot.store.eviction import collect_garbage
    from spmd_aot.store.leases import ArtifactGoneError, reading

    store = LocalStore(cache)
    rng = random.Random(index)
    counts = collections.Counter()
    errors: list[str] = []
    while time.time() < deadline:
        try:
            if role == "gc":
                report = collect_garbage(store, max_age=0.5, max_size=64 << 10)
                counts["gc runs"] += 1
                counts["evicted"] += len(report.evicted)
                time.sleep(0.05)
            elif role == "builder":
                spmd_aot.build(_gc_job(rng.choice(_sizes())), world_size=1, store=store)
                counts["builds"] += 1
            elif role == "job":
                batch = rng.choice(_sizes())
                job = _gc_job(batch)
                torch.manual_seed(0)
                model = job.model()
                step = spmd_aot.compile(job.step, store=store)
                step(model, job.optimizer(model), job.batch())
                counts["job hits" if step.cache_info.hit else "job traces"] += 1
            else:  # raw reader: the lease invariant itself
                refs = list(store.refs().values())
                if not refs:
                    time.sleep(0.01)
                    continue
                digest = rng.choice(refs)
                try:
                    with reading(store, digest):
                        parts = read_manifest(store, digest)["blobs"].values()
                        missing = [d for d in parts if not store.has(d)]
                        counts["leased reads"] += 1
                        if missing:
                            counts["parts missing under a lease"] += 1
                except ArtifactGoneError:
                    counts["gone before the lease (fine)"] += 1
        except Exception as exc:  # surfaced to a user
            errors.append(f"{role}: {type(exc).__name__}: {str(exc)[:200]}")
    out.put((role, dict(counts), errors))


def cmd_gc(args) -> int:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    cache = tempfile.mkdtemp(prefix="spmd_aot_gc_stress_")
    out = ctx.Queue()
    roles = ["gc"] + ["builder"] * args.builders + ["job"] * args.loaders + ["reader"] * args.loaders
    deadline = time.time() + 30 + args.seconds  # ~30 s for the workers to import torch
    procs = [ctx.Process(target=_gc_worker, args=(role, i, cache, deadline, out)) for i, role in enumerate(roles)]
    for p in procs:
        p.start()
    results = [out.get(timeout=args.seconds + 600) for _ in procs]
    for p in procs:
        p.join()
    totals = collections.Counter()
    errors = []
    for _role, counts, errs in results:
        totals.update(counts)
        errors += errs
    print(f"gc stress for {args.seconds} s: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
    print(f"errors surfaced to users: {len(errors)}")
    for e in errors[:20]:
        print("  " + e)
    shutil.rmtree(cache, ignore_errors=True)
    bad = errors or totals["parts missing under a lease"]
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    race = sub.add_parser("race", help="N processes racing on one key, per round")
    race.add_argument("--workers", type=int, default=16)
    race.add_argument("--rounds", type=int, default=20)
    race.set_defaults(fn=cmd_race)
    crash = sub.add_parser("crash", help="builders SIGKILLed at random write stages")
    crash.add_argument("--builds", type=int, default=50)
    crash.add_argument("--seed", type=int, default=None)
    crash.add_argument("--parallel", type=int, default=2, help="builder processes at a time")
    crash.set_defaults(fn=cmd_crash)
    gc = sub.add_parser("gc", help="gc, builders and loaders together")
    gc.add_argument("--seconds", type=float, default=60)
    gc.add_argument("--builders", type=int, default=2)
    gc.add_argument("--loaders", type=int, default=2)
    gc.set_defaults(fn=cmd_gc)
    build = sub.add_parser("_build")
    build.add_argument("cache_dir")
    build.add_argument("world_size", type=int)
    build.set_defaults(fn=cmd_build)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
