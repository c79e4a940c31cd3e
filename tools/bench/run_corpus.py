"""Run the real-model corpus (tests/support/corpus.py) and print its Markdown **Models** table: per model
and configuration, the largest parity difference from eager (with the job's own floor), build
seconds, first-call seconds on a hit, the loaded/eager step-time ratio and the seconds the case
takes on its ranks (eager twice and the loaded run); then every failure.

    python tools/bench/run_corpus.py [--models gpt2,llama] [--group-size 4]

The same builds and rank runs as ``pytest -m corpus`` (tests/models/test_corpus.py). Step ratios are
medians of steps 2-5 on each rank while other launches share the CPUs: indicative, not a benchmark.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

TESTS = pathlib.Path(__file__).resolve().parents[2] / "tests"


def _placement(config: str) -> str:
    from support import corpus

    placement, mesh, _ = corpus.CONFIGS[config]
    return f"{placement} {mesh[0]}x{mesh[1]}" if mesh else placement


def _row(name: str, config: str, built, per_rank: list | None) -> str:
    from support import corpus

    spec = corpus.MODELS.get(name)
    model = "SPMD wrapper (GPT-2 eval)" if name == "spmd" else f"{name}: {spec.about}"
    tp = "-" if not corpus.CONFIGS[config][2] else f"{'plan' if isinstance(spec.plan, dict) else 'HF plan'}, tp=2"
    build_s = f"{built.seconds_for(corpus.CONFIGS[config][0]) if built.ok else built.seconds:.1f}"
    if not built.ok:
        return f"| {model} | {_placement(config)} | {tp} | build fails | {build_s} | - | - | - |"
    run_s = f"{max(r.get('run_s', 0.0) for r in per_rank):.1f}"
    errors = [r["error"].splitlines()[0][:120] for r in per_rank if "error" in r]
    if errors:
        return f"| {model} | {_placement(config)} | {tp} | fails: {errors[0]} | {build_s} | - | - | {run_s} |"
    diff = max(v for r in per_rank for v in r["diff"].values())
    floor = max((v for r in per_rank for v in r.get("floor", {}).values()), default=None)
    mark = "" if not any(corpus.verdict(r) for r in per_rank) else " **over tolerance**"
    shown = f"{diff:.1e}" + (f" (floor {floor:.1e})" if floor is not None else "") + mark
    load = max(r["load_s"] for r in per_rank) if "load_s" in per_rank[0] else None
    ratio = statistics.median(r["ratio"] for r in per_rank) if "ratio" in per_rank[0] else None
    return (f"| {model} | {_placement(config)} | {tp} | {shown} | {build_s} | "
            f"{'-' if load is None else f'{load:.2f}'} | {'-' if ratio is None else f'{ratio:.2f}'} | {run_s} |")


def _failure(per_rank: list) -> str:
    """Each distinct problem once (with the ranks that had it), then rank 0's traceback tail."""
    from support import corpus

    seen = {}
    for rank, r in enumerate(per_rank):
        for problem in corpus.verdict(r):
            seen.setdefault(problem.splitlines()[0], []).append(rank)
    lines = [f"ranks {ranks}: {problem}" for problem, ranks in seen.items()]
    error = next((r["error"] for r in per_rank if "error" in r), "")
    return "\n".join(lines + ["", *error.splitlines()[-12:]] if error else lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated corpus names (default: all)")
    parser.add_argument("--group-size", type=int, default=4, help="models per 2-rank launch")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TESTS))
    from support import corpus

    names = args.models.split(",") if args.models else None
    with tempfile.TemporaryDirectory(prefix="spmd-aot-corpus-") as root:
        run = corpus.run_corpus(root, names, group_size=args.group_size)
    print("| model | placement | TP | max parity diff (floor) | build s | load s | loaded/eager | run s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    failures = []
    for name, config in corpus.cases(names):
        built = run.builds[name, config]
        per_rank = run.results.get((name, config))
        print(_row(name, config, built, per_rank))
        if not built.ok:
            lines = built.output.strip().splitlines()  # the error first, then where it was raised
            failures.append((name, config, "\n".join(lines[:1] + ["..."] + lines[-10:])[-2500:]))
        elif any(corpus.verdict(r) for r in per_rank):
            failures.append((name, config, _failure(per_rank)))
    print(f"\ncorpus wall time {run.seconds:.0f} s")
    for name, config, text in failures:
        print(f"\n### {name} / {config}\n```\n{text}\n```")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
