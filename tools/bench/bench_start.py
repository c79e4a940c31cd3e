"""Start-up and steady step of a cache hit against eager and torch.compile, in one run.

    python tools/bench/bench_start.py                       # 12 layers, d_model 128, context 64, batch 2, AdamW
    python tools/bench/bench_start.py --with-torch-compile  # + torch.compile(model) with warm caches
    python tools/bench/bench_start.py --quick               # a smoke run (CI): 1 layer, 1 repeat

World 1, one OpenMP thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), the example
transformer LM + ``AdamW(lr=1e-3)`` and ``train_step`` of ``spmd_aot.examples.models``.
The artifact is built first (``spmd_aot.build``), then each variant runs in FRESH processes
(``--repeats`` timed runs after one untimed warm-up run that fills the OS file cache, the
per-user records of passed load checks and prepared programs, and torch.compile's caches; the
variants take turns). Columns:

  first call       the first ``step(model, optim, batch)`` of the process: for spmd-aot the
                   key, lookup, load and bind plus one step; for torch.compile its compile
  ready            spmd-aot only: ``step.cache_info.seconds``, the first call less its step
  start to first   from before the process was spawned to its first step done (interpreter,
                   imports, model construction included)
  over eager's     median over rounds of (start to first - eager's in the same round)
  own work over    median over rounds of (setup + first call - eager's), setup being the
  eager's          variant's own part before its first call (for spmd-aot: ``import spmd_aot``
                   and ``spmd_aot.compile``); the children run the same code up to there, so
                   this is "over eager's" without the noise of the shared process start
  steady step      ms per step, every variant in ONE process, timed in interleaved blocks
                   (``bench_step.timed_blocks``); the ratio is taken block by block

Rows: eager; spmd-aot hit (interpreted ``Program``); spmd-aot hit + kernels (the entry built
with ``kernels=True``, loaded from this run's own, trusted cache); with ``--with-torch-compile``,
torch.compile(model); aot_compile whole step (forward, backward and AdamW as one Inductor
artifact, ``torch.compile(..., fullgraph=True).aot_compile`` saved by this process, loaded by
``torch.compiler.load_compiled_function``); export + AOTInductor (loss and gradients in a
``.pt2`` package, ``aoti_load_package``, AdamW eager on its gradients). How the last two are
built, and why their step is written as it is: ``bench_start_compiled.py``. The rows that
compile with Inductor before the runs (tens of seconds each) are left out of ``--quick``.
The children share this run's Inductor cache, so an aot_compile artifact finds its C++ kernels
built (a ``.pt2`` package holds its own).

Parity: every child, after its timed first step, runs to ``PARITY_STEPS`` steps and compares
the parameters with eager ``train_step``'s on fresh copies; over ``PARITY_LIMIT`` the run fails.
Figures are medians; on a shared machine take the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bar_chart import write_svg  # siblings of this script
from bench_start_compiled import AOT_COMPILE, AOTI

VOCAB, HEADS = 256, 4
KERNELS_SKIPPED = "n/a (not in --quick)"
COMPILED_SKIPPED = "n/a (not in --quick: compiled by Inductor before the runs)"
VARIANTS = ("eager", "spmd-aot hit", "spmd-aot hit + kernels", "torch.compile (warm caches)", AOT_COMPILE, AOTI)
PARITY_STEPS, PARITY_LIMIT = 3, 1e-4
_OWN_ENV = ("XDG_STATE_HOME", "TORCHINDUCTOR_CACHE_DIR", "SPMD_AOT_TRUST_CACHE")


def _config(args) -> dict:
    return dict(layers=args.layers, d_model=args.d_model, seq=args.seq, batch=args.batch)


def _models():
    """``spmd_aot/examples/models.py`` loaded by its path: an eager process imports torch and
    the model's file, not the spmd_aot package. Registered in ``sys.modules`` under its own name,
    once: Dynamo's ahead-of-time capture imports the model's module by name to read its globals."""
    import importlib.util

    if "bench_start_models" in sys.modules:
        return sys.modules["bench_start_models"]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "spmd_aot", "examples", "models.py")
    spec = importlib.util.spec_from_file_location("bench_start_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _objects(cfg: dict):
    """Model, optimizer and batch, identical in every process and variant."""
    import torch

    torch.manual_seed(0)
    model = _models().Transformer(vocab=VOCAB, d_model=cfg["d_model"], n_heads=HEADS, n_layers=cfg["layers"],
                        max_len=cfg["seq"])
    g = torch.Generator().manual_seed(1000)
    batch = (torch.randint(0, VOCAB, (cfg["batch"], cfg["seq"]), generator=g),
             torch.randint(0, VOCAB, (cfg["batch"], cfg["seq"]), generator=g))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch


def kernels_supported() -> bool:
    """Whether this spmd_aot has the kernel path (Inductor kernels stored in the artifact): a
    ``kernels`` keyword of ``compile``, or a field of its ``RunOptions``."""
    import dataclasses

    import spmd_aot  # the parent process only

    if "kernels" in inspect.signature(spmd_aot.compile).parameters:
        return True
    options = getattr(spmd_aot, "RunOptions", None)
    return options is not None and "kernels" in {f.name for f in dataclasses.fields(options)}


def _step_for(variant: str, cfg: dict, cache_dir: str, model):
    """The callable ``step(model, optim, batch)`` of one variant."""
    import torch

    if variant == "eager":
        return _models().train_step
    if variant == "torch.compile (warm caches)":
        compiled, train_step = torch.compile(model), _models().train_step
        return lambda _model, optim, batch: train_step(compiled, optim, batch)
    if variant in (AOT_COMPILE, AOTI):
        import bench_start_compiled

        return bench_start_compiled.step_for(variant, _compiled_dir(cache_dir))
    import spmd_aot
    from spmd_aot.examples.models import train_step

    if variant == "spmd-aot hit":
        return spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True)
    if variant == "spmd-aot hit + kernels":
        return spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True, kernels=True)
    raise ValueError(variant)


def _compiled_dir(cache_dir: str) -> str:
    """Where the parent saves the aot_compile and AOTInductor artifacts: beside the cache."""
    return os.path.join(os.path.dirname(cache_dir), "compiled")


def parity(step, model, optim, batch, cfg: dict) -> float:
    """Max |parameter - eager's| once ``step`` has run ``PARITY_STEPS`` steps (one done already),
    eager being ``train_step`` on fresh copies: the variant computed what eager does."""
    for _ in range(PARITY_STEPS - 1):
        step(model, optim, batch)
    eager, eager_optim, eager_batch = _objects(cfg)
    for _ in range(PARITY_STEPS):
        _models().train_step(eager, eager_optim, eager_batch)
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), eager.parameters()))


#: What a load's phases are timed by (module, attribute, phase): ``--fresh-node`` reports them.
#: Wrapped in the child before its first call; modules are imported where the load imports them
#: anyway, except ``validate`` (the meta check), which is timed inside ``Artifact._check``.
_PHASES = (("spmd_aot.entries.read", "read_artifact", "read and verify blobs"),
           ("spmd_aot.runtime.step", "read_artifact", "read and verify blobs"),
           ("spmd_aot.entries.artifact.Artifact", "_check", "decode + meta check (imports included)"),
           ("spmd_aot.entries.artifact", "decode_graph", "graph decode"),
           ("spmd_aot.entries.program_blob", "program", "program from the signed part"),
           ("spmd_aot.runtime.prepared", "load", "prepared record read"),
           ("spmd_aot.runtime.prepared", "save", "prepared record write"),
           ("spmd_aot.entries.verified", "remember", "load-check record write"),
           ("spmd_aot.interpreter.program.Program", "__init__", "program build (fold, plan)"),
           ("spmd_aot.runtime.step", "initialize_optimizer_state", "optimizer state (zeros)"),
           ("spmd_aot.runtime.step", "compute_key", "cache key"),
           ("spmd_aot.runtime.step.CompiledStep", "_lookup", "lookup (ref, manifest, guards)"),
           ("spmd_aot.keying.guards", "check", "guards check (after load)"))


def _time_phases() -> dict[str, float]:
    """CPU seconds of the loading thread (``time.thread_time``: what a busy machine's other work
    does not add) per phase (``_PHASES``) of this process's load, filled as it runs."""
    import importlib

    spent: dict[str, float] = {}

    def timed(fn, phase):
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] = spent.get(phase, 0.0) + time.thread_time() - start
        return wrapper

    for where, name, phase in _PHASES:
        if where.endswith((".Artifact", ".Program", ".CompiledStep")):  # a method: patched on its class
            mod, cls = where.rsplit(".", 1)
            owner = getattr(importlib.import_module(mod), cls)
        else:
            owner = importlib.import_module(where)
        setattr(owner, name, timed(getattr(owner, name), phase))
    return spent


def _time_ready_cpu() -> dict[str, float]:
    """The CPU seconds of the loading thread for a hit's key, lookup, load and bind (the span
    ``cache_info.seconds`` measures in wall time), filled by the first call: on a machine that
    others load, wall time measures them too."""
    from spmd_aot.runtime.step import CompiledStep

    spent: dict[str, float] = {}
    prepare = CompiledStep._prepare

    def timed(self, *args):
        start = time.thread_time()
        try:
            return prepare(self, *args)
        finally:
            spent["s"] = spent.get("s", 0.0) + time.thread_time() - start
    CompiledStep._prepare = timed
    return spent


def child(variant: str, cfg: dict, cache_dir: str, spawned_at: float) -> dict:
    """One fresh process's start-up: runs in the child, prints a JSON line."""
    import torch

    torch.set_num_threads(1)
    model, optim, batch = _objects(cfg)
    timing = variant.startswith("spmd-aot") and os.environ.get("BENCH_START_PHASES")  # --fresh-node
    phases, ready_cpu = (_time_phases(), _time_ready_cpu()) if timing else ({}, {})
    start = time.perf_counter()
    step = _step_for(variant, cfg, cache_dir, model)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    step(model, optim, batch)
    first = time.perf_counter() - start
    start_to_first = time.time() - spawned_at
    info = getattr(step, "cache_info", None)
    if info is not None and not info.hit:
        raise SystemExit(f"{variant}: expected a cache hit")
    return {"first_s": first, "ready_s": info.seconds if info is not None else None, "setup_s": setup,
            "ready_cpu_s": ready_cpu.get("s"),
            "start_to_first_s": start_to_first, "phases": dict(phases),
            "validate_imported": "spmd_aot.format.validate" in sys.modules,
            "parity": parity(step, model, optim, batch, cfg)}


def fresh_runs(variants: list[str], cfg: dict, cache_dir: str, repeats: int, env: dict,
               warmup: int = 1) -> dict[str, list[dict]]:
    """Per variant, ``repeats`` timed fresh processes after ``warmup`` untimed ones; the
    variants take turns, so a shared machine's load changes reach them alike."""
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(repeats + warmup):
        for variant in variants:
            spawned_at = time.time()
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant,
                                  "--cache-dir", cache_dir, "--spawned-at", repr(spawned_at),
                                  "--config", json.dumps(cfg)], env=env, capture_output=True, text=True,
                                 timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"{variant} process failed:\n{out.stdout}\n{out.stderr}")
            if i >= warmup:
                runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def steady(variants: list[str], cfg: dict, cache_dir: str, blocks: int, steps: int) -> dict:
    """ms per step of each variant, interleaved in this one process; with eager's ratio."""
    import torch

    from bench_step import median_ratio, timed_blocks  # a sibling of this script

    torch.set_num_threads(1)
    calls = {}
    for variant in variants:
        model, optim, batch = _objects(cfg)
        step = _step_for(variant, cfg, cache_dir, model)
        calls[variant] = (lambda s=step, m=model, o=optim, b=batch: s(m, o, b))
        for _ in range(2):
            calls[variant]()  # warm-up: binds, loads or compiles
    times = timed_blocks(calls, blocks, steps, sync=lambda: None)
    return {v: (statistics.median(t), median_ratio(t, times["eager"])) for v, t in times.items()}


def build_compiled(cfg: dict, cache_dir: str) -> float:
    """Save the aot_compile whole step and the AOTInductor package (untimed by the rows); seconds.
    One thread, as the children run: the saved step's guards check torch's thread count."""
    import torch

    import bench_start_compiled

    torch.set_num_threads(1)
    os.makedirs(_compiled_dir(cache_dir), exist_ok=True)
    return bench_start_compiled.build(lambda: _objects(cfg), _compiled_dir(cache_dir))


def build(cfg: dict, cache_dir: str, kernels: bool = False) -> float:
    """Build the artifact (with ``kernels``, the entry with compiled kernels too); seconds."""
    import torch

    import spmd_aot
    from spmd_aot.examples.models import train_step

    job = spmd_aot.Job(step=train_step, model=lambda: _objects(cfg)[0],
                       optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                       batch=lambda: _objects(cfg)[2])
    seconds = spmd_aot.build(job, world_size=1, cache_dir=cache_dir).seconds
    if kernels:
        seconds += spmd_aot.build(job, world_size=1, cache_dir=cache_dir, kernels=True).seconds
    return seconds


def _skipped(variant: str) -> str:
    if variant == "spmd-aot hit + kernels":
        return KERNELS_SKIPPED
    return COMPILED_SKIPPED if variant in (AOT_COMPILE, AOTI) else "n/a (not measured)"


def check_parity(starts: dict) -> list[str]:
    """One line per variant: its worst parameter difference from eager; over the limit fails."""
    lines = []
    for variant, runs in starts.items():
        worst = max(r["parity"] for r in runs)
        lines.append(f"# parity, {variant}: max |param - eager| after {PARITY_STEPS} steps {worst:.1e} "
                     f"(limit {PARITY_LIMIT:.0e})")
        if not worst <= PARITY_LIMIT:
            raise RuntimeError("\n".join(lines) + f"\n{variant} does not compute what eager does")
    return lines


def table(cfg: dict, starts: dict, steady_ms: dict) -> str:
    lines = [f"# {cfg['layers']} layers, d_model {cfg['d_model']}, context {cfg['seq']}, batch {cfg['batch']}, "
             "AdamW, world 1, one OpenMP thread; medians",
             "| | first call | ready (spmd-aot) | process start to first step | over eager's | own work over "
             "eager's | steady step | vs eager |",
             "|---|---|---|---|---|---|---|---|"]
    eager = starts.get("eager")
    for variant in VARIANTS:
        runs = starts.get(variant)
        if runs is None:
            lines.append(f"| {variant} | {_skipped(variant)} | | | | | | |")
            continue
        first = statistics.median(r["first_s"] for r in runs)
        ready = [r["ready_s"] for r in runs if r["ready_s"] is not None]
        total = statistics.median(r["start_to_first_s"] for r in runs)
        over = own = "-"
        if eager is not None and variant != "eager":
            over, own = f"{over_eager(runs, eager):+.3f} s", f"{own_work_over_eager(runs, eager):+.3f} s"
        ms, ratio = steady_ms.get(variant, (float("nan"), float("nan")))
        lines.append(f"| {variant} | {first:.3f} s | {f'{statistics.median(ready):.3f} s' if ready else '-'} | "
                     f"{total:.2f} s | {over} | {own} | {ms:.1f} ms | {ratio:.2f} |")
    return "\n".join(lines)


def over_eager(runs: list[dict], eager: list[dict]) -> float:
    """Median over rounds of (this variant's process start to first step - eager's in the same
    round): the variants take turns, so each difference is taken under the same machine load,
    steadier than the difference of two medians of ~2 s each."""
    return statistics.median(r["start_to_first_s"] - e["start_to_first_s"] for r, e in zip(runs, eager))


def plot(path: str, cfg: dict, starts: dict, steady_ms: dict) -> None:
    """First call and steady step of every measured row, in ms (log scale when they span >20x)."""
    rows = [v for v in VARIANTS if v in starts]
    series = {"first call": [1e3 * statistics.median(r["first_s"] for r in starts[v]) for v in rows],
              "steady step": [steady_ms[v][0] for v in rows]}
    write_svg(path, rows, series, f"{cfg['layers']}-layer LM, world 1: first call and steady step",
              y_label="ms", notes=[f"{steady_ms[v][1]:.2f}x" for v in rows])


def own_work_over_eager(runs: list[dict], eager: list[dict]) -> float:
    """Median over rounds of (this variant's setup + first call - eager's): a child process runs
    eager's code up to ``_step_for`` (interpreter, torch, the model), so this is the part of
    ``over_eager`` the variant causes, without the +-0.3 s the shared part varies by here."""
    return statistics.median((r["setup_s"] + r["first_s"]) - (e["setup_s"] + e["first_s"])
                             for r, e in zip(runs, eager))


FRESH_ROWS = ("unsigned, first load on a fresh node", "unsigned, repeat load",
              "signed, first load on a fresh node", "signed, repeat load")


def fresh_node(cfg: dict, repeats: int, tmp: str, env: dict) -> dict[str, list[dict]]:
    """First loads as a cluster job's nodes pay them, beside repeat loads, signed and unsigned.

    Two caches hold the same build, one built with a signing key (its entry carries the checked
    program, ``entries/program_blob.py``). A "first load" child gets a new, empty
    ``XDG_STATE_HOME`` (no record of passed checks, no prepared program: a node that never ran
    the job); a "repeat load" child shares one state folder that an untimed load filled. Every
    child is a fresh interpreter (imports cold in the process; the OS file cache is warm, as
    after the job's first rank on a node). The four rows take turns, one round per repeat,
    after one untimed round."""
    import shutil

    key = "bench-start-signing-key"
    caches = {"unsigned": os.path.join(tmp, "cache-unsigned"), "signed": os.path.join(tmp, "cache-signed")}
    os.environ.pop("SPMD_AOT_SIGNING_KEY", None)
    print(f"# built the unsigned entry in {build(cfg, caches['unsigned']):.1f} s", flush=True)
    os.environ["SPMD_AOT_SIGNING_KEY"] = key
    try:
        print(f"# built the signed entry in {build(cfg, caches['signed']):.1f} s", flush=True)
    finally:
        os.environ.pop("SPMD_AOT_SIGNING_KEY", None)
    runs: dict[str, list[dict]] = {row: [] for row in FRESH_ROWS}
    for i in range(repeats + 1):
        for row in FRESH_ROWS:
            kind = row.split(",")[0]
            state = (os.path.join(tmp, f"state-{kind}-{i}-fresh") if "first" in row
                     else os.path.join(tmp, f"state-{kind}-repeat"))
            child_env = dict(env, XDG_STATE_HOME=state, BENCH_START_PHASES="1")
            if kind == "signed":
                child_env["SPMD_AOT_SIGNING_KEY"] = key
            spawned_at = time.time()
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "spmd-aot hit",
                                  "--cache-dir", caches[kind], "--spawned-at", repr(spawned_at),
                                  "--config", json.dumps(cfg)], env=child_env, capture_output=True, text=True,
                                 timeout=900)
            if out.returncode != 0:
                raise RuntimeError(f"{row} process failed:\n{out.stdout}\n{out.stderr}")
            if "first" in row:
                shutil.rmtree(state, ignore_errors=True)
            if i:  # round 0 is untimed: OS file cache, and the repeat rows' state
                runs[row].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def fresh_table(cfg: dict, runs: dict[str, list[dict]]) -> str:
    """Ready time (key, lookup, load, bind: ``cache_info.seconds``) and first call per row, and
    where a row's ready time goes (median seconds per phase, nested phases indented)."""
    lines = [f"# {cfg['layers']} layers, d_model {cfg['d_model']}, context {cfg['seq']}, batch {cfg['batch']}, "
             f"AdamW, world 1, one OpenMP thread; medians of {len(next(iter(runs.values())))} fresh processes per "
             "row, rows interleaved",
             "| | ready | ready, best | ready, CPU ms (best) | first call | compile() + first call | "
             "meta checker imported |", "|---|---|---|---|---|---|---|"]
    for row, rs in runs.items():
        cpu = [1e3 * r["ready_cpu_s"] for r in rs]
        lines.append(f"| {row} | {statistics.median(r['ready_s'] for r in rs):.3f} s | "
                     f"{min(r['ready_s'] for r in rs):.3f} s | {statistics.median(cpu):.1f} ({min(cpu):.1f}) | "
                     f"{statistics.median(r['first_s'] for r in rs):.3f} s | "
                     f"{statistics.median(r['setup_s'] + r['first_s'] for r in rs):.3f} s | "
                     f"{'yes' if any(r['validate_imported'] for r in rs) else 'no'} |")
    lines.append("")
    phases = [phase for _, _, phase in _PHASES]
    phases = list(dict.fromkeys(phases))
    lines.append("| phase (CPU ms of the loading thread, median) | " + " | ".join(runs) + " |")
    lines.append("|---|" + "---|" * len(runs))
    for phase in phases:
        cells = [f"{1e3 * statistics.median(r['phases'].get(phase, 0.0) for r in rs):.1f}" for rs in runs.values()]
        if any(c != "0.0" for c in cells):
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed fresh processes per variant")
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--with-torch-compile", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 layer, d_model 16, 1 repeat without a warm-up process, 2 blocks of 1 step")
    p.add_argument("--fresh-node", action="store_true",
                   help="only first loads on a fresh node (empty per-user state) against repeat loads, "
                        "signed and unsigned, with where the time goes")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--plot", default=os.path.join(tempfile.gettempdir(), "bench_start.svg"),
                   help="bar chart of first call and steady step per row (SVG)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, json.loads(args.config), args.cache_dir, args.spawned_at)))
        return 0
    if args.quick:
        args.layers, args.d_model, args.seq, args.repeats, args.blocks, args.steps = 1, 16, 8, 1, 2, 1
    cfg = _config(args)
    # the kernel row and the two compiled rows compile with Inductor first (tens of seconds
    # each): not in a --quick smoke run
    with_kernels = kernels_supported() and not args.quick
    variants = ["eager", "spmd-aot hit"] + (["spmd-aot hit + kernels"] if with_kernels else [])
    variants += ["torch.compile (warm caches)"] if args.with_torch_compile else []
    variants += [] if args.quick else [AOT_COMPILE, AOTI]
    saved = {k: os.environ.get(k) for k in _OWN_ENV}
    with tempfile.TemporaryDirectory(prefix="bench_start_") as tmp:
        cache_dir = os.path.join(tmp, "cache")
        # this run's own per-user state (records of passed load checks, prepared programs) and Inductor cache
        # and its own cache, trusted: compiled kernels load only from a trusted cache or a signed entry
        own = dict(XDG_STATE_HOME=os.path.join(tmp, "state"), TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   SPMD_AOT_TRUST_CACHE="1")
        env = dict(os.environ, OMP_NUM_THREADS="1", **own)
        # bytecode cached as an installed package has it (pip compiles it at install; torch's is),
        # in this run's own folder: a PYTHONDONTWRITEBYTECODE environment would otherwise make
        # every fresh process compile spmd_aot's source, a cost no installed user pays
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        try:
            os.environ.update(own)
            if args.fresh_node:
                runs = fresh_node(cfg, args.repeats, tmp, env)
                print(fresh_table(cfg, runs))
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"config": cfg, "fresh_node": runs}, f, indent=1)
                return 0
            print(f"# built the artifact in {build(cfg, cache_dir, with_kernels):.1f} s", flush=True)
            if AOT_COMPILE in variants:
                print(f"# saved the aot_compile step and the AOTInductor package in "
                      f"{build_compiled(cfg, cache_dir):.1f} s", flush=True)
            starts = fresh_runs(variants, cfg, cache_dir, args.repeats, env, warmup=0 if args.quick else 1)
            steady_ms = steady(variants, cfg, cache_dir, args.blocks, args.steps)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    print("\n".join(check_parity(starts)))
    print(table(cfg, starts, steady_ms))
    plot(args.plot, cfg, starts, steady_ms)
    print(f"# plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "starts": starts, "steady": steady_ms}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
