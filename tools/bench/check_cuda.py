"""The GPU acceptance run: build (or take CI's artifacts), load, parity with eager, timing; one command.

    python tools/bench/check_cuda.py                          # on a lent GPU machine (< 5 minutes on one H200)
    python tools/bench/check_cuda.py --artifacts DIR          # ... loading what CI built without a GPU
    python tools/bench/check_cuda.py --device cuda --build-artifacts DIR   # CI, GPU-less, CUDA wheel: make DIR
    python tools/bench/check_cuda.py --device cpu             # the same checks on CPU + gloo (how it is tested)

This project's own machines have no GPU. When a session is lent one (15 minutes of device time
per task, all tries together), this one script is what to run there (``PYTHONPATH=.``; it needs
no install). It prints, in order:

1. **What it found**: torch release and CUDA build, GPUs, NCCL, transformers, spmd-aot version,
   and which SDPA kernel eager picks there (fp32 and bf16, causal, with and without GQA).
   A torch release the allowlist was not verified on is named and the run continues: the cache key holds the release, so
   artifacts built on another release miss and are built here instead (said per check).
2. **World 1** (one process, no process group) for two models, the repo's example transformer LM
   (``spmd_aot.examples.models.Transformer``) and a transformers ``LlamaForCausalLM`` (random
   init, GQA, attention as transformers picks it: sdpa), each under ``replicate`` and ``shard``:
   the artifact is built for the device into a fresh cache (or found in ``--artifacts``), loaded
   with ``require_hit=True`` (a miss or a trace fails the check), trained ``--steps`` AdamW steps
   next to eager on the same device, and parameters, optimizer state and losses compared. Then
   loaded, eager and ``torch.compile(model)`` are timed interleaved (``bench_step.timed_blocks``;
   compile's first step reported apart as compile seconds).
3. **bf16 mixed precision** (world 1, the example LM; world 2 is tests/parallel/test_mixed_precision.py's):
   the same build, load, parity and timing with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, against eager
   FSDP2 with the same ``mp_policy`` (``shard``) and torch's DDP-semantics
   ``replicate(mp_policy=...)`` (``replicate``); at world 1 both sides run in a one-rank process
   group (FSDP2 needs one), which is what one H200 can run. Rows are named ``... bf16``.
4. **World 2** (NCCL needs a GPU per rank, so with 2+ GPUs; on CPU with gloo): the same for
   ``replicate`` against eager DDP and ``shard`` against eager FSDP2 (``fully_shard`` per block,
   then the root), on spawned ranks (``bench_step.run_world``).
5. **A summary table**: check, worst difference, its tolerance, PASS/FAIL/SKIP, loaded/eager,
   loaded/compile.

Parity uses the rule of the real-model corpus (``tests/support/corpus.py``): eager is run a second time
with every initial parameter perturbed by relative 1e-7, and that run's distance from eager is the
job's own rounding floor; the loaded step must be within max(1e-5, 10 x floor) per metric
(parameters, optimizer state, losses). ``--tolerance T`` replaces the rule by a fixed T.

``--budget-seconds`` (default 270) is a deadline for the whole run: a check (or its timing, or
its compile) that would start too late is skipped with the reason printed, never overrun.
Exit status 1 when any check failed (skips do not fail), else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The checkout's spmd_aot, found through a sys.path entry (as PYTHONPATH=. would): with an
# editable install alone (a finder hook, no path entry) the trace's file guards name
# spmd_aot/examples/models.py by its bare file name, which another loaded models.py (transformers
# imports charset_normalizer's) then matches, and every example-LM load misses.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
import bench_step as bench  # noqa: E402  (a sibling file: its rank launcher and timing helpers)

MODELS = ("lm", "llama")
NAMES = {"lm": "the example transformer LM (lm)", "llama": "transformers LlamaForCausalLM (llama)"}
PLACEMENTS = ("replicate", "shard")
BASE_TOL = 1e-5  # README: parameters, optimizer state and losses within 1e-5 in fp32
FLOOR_FACTOR = 10  # ... or 10x the job's own rounding floor, where AdamW amplifies rounding beyond it
PERTURBATION = 1e-7  # relative: eager against itself with this perturbation is the floor
# (layers, d_model, context, batch per rank) by device; --layers etc. override
SIZES = {"cuda": (4, 256, 128, 8), "cpu": (2, 64, 32, 4)}
MP_MODELS = ("lm",)  # the models checked again under bf16 mixed precision


def MIXED_PRECISION():  # noqa: N802  (a constant, made when first needed: torch's FSDP2 policy)
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


EAGER_NAME = {(1, "replicate"): "eager", (1, "shard"): "eager", (2, "replicate"): "DDP", (2, "shard"): "FSDP2"}


# ---------------------------------------------------------------------------- models and steps
def hf_step(model, optim, batch):
    """A transformers LM's step as users write it: ``model(input_ids=x, labels=y).loss``."""
    loss = model(**batch).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@dataclasses.dataclass(frozen=True)
class Sizes:
    layers: int
    d_model: int
    seq: int
    batch: int


def make_model(name: str, z: Sizes, perturb: bool = False):
    """Seeded: the same initial values in every process and for every variant."""
    torch.manual_seed(0)
    if name == "lm":
        from spmd_aot.examples.models import Transformer
        model = Transformer(vocab=256, d_model=z.d_model, n_heads=4, n_layers=z.layers, max_len=z.seq)
    else:
        import transformers
        transformers.logging.set_verbosity_error()
        heads = max(4, z.d_model // 32)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=1024, hidden_size=z.d_model, intermediate_size=4 * z.d_model, num_hidden_layers=z.layers,
            num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=z.d_model // heads,
            max_position_embeddings=z.seq))
    if perturb:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.abs() * PERTURBATION * (torch.randint(0, 2, p.shape, generator=g) * 2 - 1))
    return model


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def step_fn(name: str):
    if name == "lm":
        from spmd_aot.examples.models import train_step
        return train_step
    return hf_step


def make_batch(name: str, z: Sizes, rank: int, step: int, device="cpu"):
    g = torch.Generator().manual_seed(1000 * rank + step)
    vocab = 256 if name == "lm" else 1024
    x = torch.randint(0, vocab, (z.batch, z.seq), generator=g)
    if name == "lm":
        return x.to(device), torch.randint(0, vocab, (z.batch, z.seq), generator=g).to(device)
    return {"input_ids": x.to(device), "labels": x.clone().to(device)}


def job(name: str, z: Sizes):
    import spmd_aot
    return spmd_aot.Job(step=step_fn(name), model=lambda: make_model(name, z), optimizer=adamw,
                        batch=lambda: make_batch(name, z, 0, 0))


def layers_of(model):
    return model.blocks if hasattr(model, "blocks") else model.model.layers


# ---------------------------------------------------------------------------- what we found
def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
        return True
    except ImportError:
        return False


def spmd_aot_version() -> str:
    version = "?"
    try:
        with open(os.path.join(REPO, "pyproject.toml")) as f:
            version = next(line.split("=")[1].strip().strip('"') for line in f if line.startswith("version"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", ""
    return version + (f" (commit {commit}{', with local changes' if dirty else ''})" if commit else " (no git)")


def found(args) -> list[str]:
    """What this machine has, printed first (before spmd_aot is imported: a torch it cannot
    import with must still be named)."""
    lines = [f"# python {platform.python_version()}, torch {torch.__version__} "
             f"(CUDA build: {torch.version.cuda or 'no'}), {os.cpu_count()} CPU cores"]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    nccl = dist.is_available() and dist.is_nccl_available()
    nccl_version = ""
    if nccl and torch.version.cuda:
        try:
            nccl_version = " " + ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001  (a version we cannot read is not a failure)
            pass
    lines.append(f"# GPUs: {gpus}" + (f" ({', '.join(names)})" if names else "")
                 + f"; NCCL available: {'yes' + nccl_version if nccl else 'no'}")
    tf = "not installed (the Llama checks are skipped)"
    if has_transformers():
        import transformers
        tf = transformers.__version__
    lines.append(f"# transformers {tf}; spmd-aot {spmd_aot_version()}")
    from spmd_aot.format.allowlist import TORCH_RELEASES, running_release

    if running_release() not in TORCH_RELEASES:
        lines.append(f"NOTE torch {torch.__version__} is not a release spmd-aot was verified on "
                     f"({', '.join(TORCH_RELEASES)}): the cache key holds the torch release, so artifacts built "
                     "elsewhere miss and are built here; continuing where possible")
    z = args.sizes
    lines.append(sdpa_choices(args.device, z))
    lines.append(f"# device {args.device}; models: {', '.join(NAMES[m] for m in args.models)}, {z.layers} layers, "
                 f"d_model {z.d_model}, context {z.seq}, batch {z.batch}/rank, AdamW(lr=1e-3); "
                 f"{args.steps} parity steps; budget {args.budget_seconds:.0f}s")
    return lines


def sdpa_choices(device: str, z: Sizes) -> str:
    """Which attention kernel eager picks on this device (``torch._fused_sdp_choice``), for the
    checks' head shapes: a GPU-less CUDA build records math attention, and only a real device
    says what eager would have run (the SDPA backend of the target GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        return "# SDPA backend eager picks: unknown (no CUDA device visible)"
    from torch.nn.attention import SDPBackend

    heads, kv_heads = 4, 2
    picks = []
    for dtype in (torch.float32, torch.bfloat16):
        for label, n_kv, gqa in (("causal", heads, False), (f"causal GQA {heads}/{kv_heads}", kv_heads, True)):
            q = torch.randn(z.batch, heads, z.seq, z.d_model // heads, dtype=dtype, device=device)
            kv = torch.randn(z.batch, n_kv, z.seq, z.d_model // heads, dtype=dtype, device=device)
            try:
                choice = SDPBackend(torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=gqa)).name
            except Exception as exc:  # noqa: BLE001  (reported, not a failure of the run)
                choice = f"error {type(exc).__name__}"
            picks.append(f"{str(dtype).removeprefix('torch.')} {label}: {choice}")
    return (f"# SDPA backend eager picks on {device} (torch._fused_sdp_choice, head dim {z.d_model // heads}, "
            f"context {z.seq}): " + "; ".join(picks))


# ---------------------------------------------------------------------------- a deadline
class Deadline:
    def __init__(self, seconds: float):
        self.start = time.time()  # wall clock: ranks in other processes read the same one
        self.end = self.start + seconds

    def left(self) -> float:
        return self.end - time.time()


def agree(ok: bool, world: int) -> bool:
    """Rank 0's decision on every rank (a skip must be collective, or the others wait forever)."""
    if world == 1:
        return ok
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    return flag[0]


def all_ranks(ok: bool, world: int, device) -> bool:
    """True where every rank says so (for what may go wrong on one rank only)."""
    if world == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# ---------------------------------------------------------------------------- one check, on every rank
@dataclasses.dataclass
class Spec:
    model: str
    placement: str
    world: int
    allow_ops: tuple = ()
    compile: bool = False  # also time torch.compile(eager model)
    bf16: bool = False  # mixed precision: MIXED_PRECISION on both sides

    @property
    def name(self) -> str:
        return f"world {self.world} {self.model} {self.placement}" + (" bf16" if self.bf16 else "")

    @property
    def mixed_precision(self):
        return MIXED_PRECISION() if self.bf16 else None


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float()


def max_diffs(ref, got) -> dict:
    """Largest absolute differences of parameters/buffers, optimizer state and losses (whole
    values: a collective for DTensors, so every rank calls it in the same order). A missing
    optimizer state is an infinite difference, not a pass."""
    (m1, o1, l1), (m2, o2, l2) = ref, got
    params = max((_full(a) - _full(b)).abs().max().item()
                 for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    state = 0.0
    for i in s1:
        if i not in s2 or set(s1[i]) != set(s2[i]):
            state = math.inf
            continue
        for k, v in s1[i].items():
            if isinstance(v, torch.Tensor):
                state = max(state, (_full(v) - _full(s2[i][k])).abs().max().item())
    if len(s1) != len(s2) or not s1:
        state = math.inf
    loss = max(abs(a - b) for a, b in zip(l1, l2))
    return {"param": params, "state": state, "loss": loss}


def eager_model(spec: Spec, z: Sizes, device, perturb=False):
    """(module to call, the module itself, its optimizer): plain at world 1, DDP or FSDP2."""
    model = make_model(spec.model, z, perturb).to(device)
    if spec.bf16:
        return _eager_mixed_precision(spec, model, device)
    if spec.world == 1:
        return model, model, adamw(model)
    if spec.placement == "replicate":
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), model, adamw(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (spec.world,))
    for layer in layers_of(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model, adamw(model)  # the optimizer sees the DTensor parameters


def _eager_mixed_precision(spec: Spec, model, device):
    """FSDP2 (per layer, then the root) or torch's DDP-semantics ``replicate``, with the policy."""
    from torch.distributed.device_mesh import init_device_mesh
    if spec.placement == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        replicate(model, mesh=init_device_mesh(device.type, (spec.world,), mesh_dim_names=("replicate",)),
                  mp_policy=spec.mixed_precision)
        return model, model, adamw(model)
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (spec.world,))
    for layer in layers_of(model):
        fully_shard(layer, mesh=mesh, mp_policy=spec.mixed_precision)
    fully_shard(model, mesh=mesh, mp_policy=spec.mixed_precision)
    return model, model, adamw(model)


@contextlib.contextmanager
def one_rank_group(device_type: str, needed: bool):
    """A process group of this process alone (FSDP2 needs one even at world 1), when ``needed``."""
    if not needed or dist.is_initialized():
        yield
        return
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sync(device, world: int) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    if world > 1:
        dist.barrier()


def run_check(spec: Spec, rank: int, args, cache_dir: str, deadline: Deadline) -> dict:
    """Parity (eager, eager perturbed = the floor, loaded), then interleaved timing if the
    budget allows. Every rank of ``spec.world`` calls it; rank 0's figures are the row's (the
    differences are reduced to their maximum over ranks)."""
    import spmd_aot

    z, world = args.sizes, spec.world
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    fn = step_fn(spec.model)
    batches = [make_batch(spec.model, z, rank, s, device) for s in range(args.steps)]

    eager = EAGER_NAME[world, spec.placement] if not spec.bf16 else \
        {"replicate": "replicate(mp_policy)", "shard": "FSDP2(mp_policy)"}[spec.placement]
    row = dict(check=spec.name, eager=eager, allow_ops=list(spec.allow_ops))
    # eager, the floor (eager, perturbed), then the loaded step
    call, ref_model, ref_optim = eager_model(spec, z, device)
    ref = (ref_model, ref_optim, [float(fn(call, ref_optim, b).detach().float()) for b in batches])
    f_call, f_model, f_optim = eager_model(spec, z, device, perturb=True)
    floor = max_diffs(ref, (f_model, f_optim, [float(fn(f_call, f_optim, b).detach().float()) for b in batches]))
    model = make_model(spec.model, z).to(device)
    optim = adamw(model)
    step = spmd_aot.compile(fn, placement=spec.placement, cache_dir=cache_dir, require_hit=True,
                            allow_ops=spec.allow_ops, mixed_precision=spec.mixed_precision)
    losses = [float(step(model, optim, b).detach().float()) for b in batches]
    diff = max_diffs(ref, (model, optim, losses))
    if world > 1:  # the worst over ranks (losses are rank-local)
        both = torch.tensor([diff[k] for k in diff] + [floor[k] for k in floor], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        diff = dict(zip(diff, both[:3].tolist()))
        floor = dict(zip(floor, both[3:].tolist()))
    info = step.cache_info
    row.update(diff=diff, floor=floor, hit=info.hit, traces=info.traces, source=info.source, load_s=info.seconds)
    del f_call, f_model, f_optim

    # timing: loaded vs eager (vs torch.compile), interleaved, after a warm-up
    if not agree(deadline.left() > args.timing_seconds, world):
        row["timing"] = f"timing skipped: {max(0, deadline.left()):.0f}s of the budget left"
        return row
    variants = {"loaded": lambda: step(model, optim, batches[0]), "eager": lambda: fn(call, ref_optim, batches[0])}
    if spec.compile:
        if agree(deadline.left() > args.compile_seconds, world):
            c_call, _, c_optim = eager_model(spec, z, device)  # plain at world 1, DDP at world 2
            compiled = torch.compile(c_call)
            _sync(device, world)
            start = time.perf_counter()
            try:  # the first step compiles: timed apart; a compiler that fails costs the timing, not the check
                fn(compiled, c_optim, batches[0])
                error = None
            except Exception as exc:  # noqa: BLE001
                error = f"torch.compile failed: {type(exc).__name__}: {str(exc)[:300]}"
            if all_ranks(error is None, world, device):
                _sync(device, world)
                row["compile_s"] = time.perf_counter() - start
                variants["compiled"] = lambda: fn(compiled, c_optim, batches[0])
            else:
                row["timing"] = error or "torch.compile failed on another rank"
        else:
            row["timing"] = f"torch.compile skipped: {max(0, deadline.left()):.0f}s of the budget left"
    for v in variants.values():
        for _ in range(args.warmup):
            v()
    times = bench.timed_blocks(variants, args.blocks, args.timed_steps, lambda: _sync(device, world))
    row.update(loaded_ms=statistics.median(times["loaded"]), eager_ms=statistics.median(times["eager"]),
               loaded_eager=bench.median_ratio(times["loaded"], times["eager"]))
    if "compiled" in variants:
        row.update(compiled_ms=statistics.median(times["compiled"]),
                   loaded_compile=bench.median_ratio(times["loaded"], times["compiled"]))
        torch._dynamo.reset()
    return row


# ---------------------------------------------------------------------------- verdicts and printing
def tolerances(row: dict, fixed: float | None) -> dict:
    if fixed is not None:
        return {k: fixed for k in row["diff"]}
    return {k: max(BASE_TOL, FLOOR_FACTOR * row["floor"][k]) for k in row["diff"]}


def judge(row: dict, fixed: float | None) -> dict:
    """Adds status, the worst metric (largest diff / tolerance) and the reasons it failed."""
    if "error" in row:
        row["status"] = "FAIL"
        return row
    tol = tolerances(row, fixed)
    problems = []
    if not row["hit"] or row["traces"] != 0:
        problems.append(f"no cache hit (hit {row['hit']}, traces {row['traces']})")
    problems += [f"{k} diff {row['diff'][k]:.2e} > {tol[k]:.2e}" for k in row["diff"] if not row["diff"][k] <= tol[k]]
    worst = max(row["diff"], key=lambda k: row["diff"][k] / tol[k] if tol[k] > 0 else math.inf)
    row.update(status="FAIL" if problems else "PASS", worst=worst, tol=tol, problems=problems)
    return row


def print_row(row: dict) -> None:
    if row["status"] == "SKIP":
        print(f"SKIP {row['check']}: {row['reason']}", flush=True)
        return
    if "error" in row:
        print(f"FAIL {row['check']}: {row['error']}", flush=True)
        return
    d, tol = row["diff"], row["tol"]
    figures = ", ".join(f"{k} {d[k]:.2e} (tol {tol[k]:.1e}, floor {row['floor'][k]:.1e})" for k in d)
    line = (f"{row['status']} {row['check']}: cache hit {row['hit']}, traces {row['traces']}, load "
            f"{row['load_s']:.2f}s; |loaded - {row['eager']}| {figures}")
    if "loaded_ms" in row:
        line += (f"; loaded {row['loaded_ms']:.2f} ms, {row['eager']} {row['eager_ms']:.2f} ms, "
                 f"loaded/eager {row['loaded_eager']:.3f}")
    if "compiled_ms" in row:
        line += (f", torch.compile {row['compiled_ms']:.2f} ms (first step {row['compile_s']:.1f}s), "
                 f"loaded/compile {row['loaded_compile']:.3f}")
    for note in ([row["timing"]] if "timing" in row else []) + row["problems"] + row.get("notes", []):
        line += f"; {note}"
    if row["allow_ops"]:
        line += f"; opted in to {', '.join(row['allow_ops'])}"
    print(line, flush=True)


def summary(rows: list[dict]) -> str:
    header = ["check", "max diff", "tolerance", "result", "loaded/eager", "loaded/compile"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        if "worst" in r:
            cells = [f"{r['worst']} {r['diff'][r['worst']]:.1e}", f"{r['tol'][r['worst']]:.1e}"]
        else:
            cells = ["-", "-"]
        cells.append(r["status"])
        cells.append(f"{r['loaded_eager']:.3f} vs {r['eager']}" if "loaded_eager" in r else "-")
        cells.append(f"{r['loaded_compile']:.3f}" if "loaded_compile" in r else "-")
        lines.append("| " + " | ".join([r["check"]] + cells) + " |")
    return "\n".join(lines)


def skipped(spec: Spec, reason: str) -> dict:
    return dict(check=spec.name, status="SKIP", reason=reason)


# ---------------------------------------------------------------------------- building
def build_all(specs: list[Spec], args, cache_dir: str, deadline: Deadline | None, from_artifacts: bool) -> dict:
    """Build every spec's artifact (a no-op for one already in the cache). Returns spec name ->
    None (built or found) or the reason it cannot run. A graph refused for a CUDA-only op is
    built again opting in to it (and loaded with the same opt-in), so parity still runs; the
    row says which ops."""
    import spmd_aot

    problems = {}
    for spec in specs:
        if spec.model == "llama" and not has_transformers():
            problems[spec.name] = ("SKIP", "transformers is not installed")
            continue
        if deadline is not None and deadline.left() < args.check_seconds:
            problems[spec.name] = ("SKIP", f"budget: {max(0, deadline.left()):.0f}s left, not enough to build and check")
            continue
        start = time.perf_counter()
        try:
            for _ in range(8):
                try:
                    result = spmd_aot.build(job(spec.model, args.sizes), world_size=spec.world,
                                            placement=spec.placement, device=args.device, cache_dir=cache_dir,
                                            allow_ops=spec.allow_ops, mixed_precision=spec.mixed_precision)
                    break
                except spmd_aot.OpNotAllowedError as exc:
                    if not exc.op or exc.op in spec.allow_ops:
                        raise
                    print(f"# {spec.name}: the graph calls {exc.op}, not on the allowlist (a CUDA-only kernel?): "
                          "building again opted in to it", flush=True)
                    spec.allow_ops = spec.allow_ops + (exc.op,)
        except Exception as exc:  # noqa: BLE001  (one check's failure must not hide the others')
            problems[spec.name] = ("FAIL", f"build failed: {type(exc).__name__}: {exc}")
            print(f"# {spec.name}: build failed:\n{traceback.format_exc()}", flush=True)
            continue
        where = ("built here" + (" (not in --artifacts for this key)" if from_artifacts else "")) if result.traced \
            else "found in the cache" + (" (--artifacts)" if from_artifacts else "")
        print(f"# {spec.name}: {where}, {time.perf_counter() - start:.1f}s", flush=True)
    return problems


def specs_for(args, world: int) -> list[Spec]:
    plain = [Spec(m, p, world, compile=m in args.compile and p == "replicate" and (world == 1 or args.compile_world2))
             for m in args.models for p in PLACEMENTS]
    if world != 1:  # world 2 under the policy: tests/parallel/test_mixed_precision.py (gloo); here the run stays short
        return plain
    return plain + [Spec(m, p, world, bf16=True) for m in args.models if m in MP_MODELS for p in PLACEMENTS]


def unbuilt(spec: Spec, problem: tuple) -> dict:
    status, why = problem
    return skipped(spec, why) if status == "SKIP" else dict(check=spec.name, status="FAIL", error=why)


# ---------------------------------------------------------------------------- world 2 ranks
def _rank_main(rank, world, port, configs, deadline, cache_dir, results):
    """One world-2 rank, started by ``bench_step.run_world`` (``configs`` is ``(args, specs)``)."""
    args, specs = configs
    try:
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        rows = []
        for spec in specs:
            if not agree(deadline.left() > args.check_seconds, world):
                rows.append(skipped(spec, f"budget: {max(0, deadline.left()):.0f}s left"))
                continue
            rows.append(run_check(spec, rank, args, cache_dir, deadline))
        results.put((rank, "ok", rows))
    except BaseException as exc:  # report it; never leave the parent waiting
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- the run
def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--artifacts", metavar="DIR",
                        help="a cache directory CI built with --build-artifacts (copied; checks it lacks build here)")
    parser.add_argument("--build-artifacts", metavar="DIR",
                        help="only build every artifact the checks load into DIR (no GPU needed: the CUDA wheel), then exit")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated of lm, llama (default both)")
    parser.add_argument("--worlds", default="1,2", help="comma-separated of 1, 2 (2 needs 2+ GPUs on cuda)")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--seq", type=int, help="context length")
    parser.add_argument("--batch", type=int, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5, help="steps compared with eager")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before timing")
    parser.add_argument("--blocks", type=int, help="timed blocks per variant (cuda 5, cpu 3)")
    parser.add_argument("--timed-steps", type=int, help="steps per timed block (cuda 10, cpu 3)")
    parser.add_argument("--compile", help="models whose world-1 replicate check also times torch.compile(model), "
                        "comma-separated (cuda: lm,llama; cpu: lm, as inductor takes ~35s a model on 2 cores)")
    parser.add_argument("--no-compile", dest="compile", action="store_const", const="", help="time no torch.compile")
    parser.add_argument("--compile-world2", action="store_true", help="also time torch.compile of DDP at world 2")
    parser.add_argument("--tolerance", type=float,
                        help=f"a fixed max abs difference (default: max({BASE_TOL}, {FLOOR_FACTOR} x the job's floor))")
    parser.add_argument("--budget-seconds", type=float, default=270, help="deadline for the whole run")
    parser.add_argument("--check-seconds", type=float, default=None,
                        help="a check (build + parity) starts only with this much budget left (cuda 20, cpu 5)")
    parser.add_argument("--timing-seconds", type=float, default=None, help="timing starts only with this much left "
                        "(cuda 10, cpu 2)")
    parser.add_argument("--compile-seconds", type=float, default=None, help="torch.compile starts only with this much "
                        "left (cuda 60, cpu 30)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    layers, d_model, seq, batch = SIZES[args.device]
    args.sizes = Sizes(args.layers or layers, args.d_model or d_model, args.seq or seq, args.batch or batch)
    args.models = [m for m in args.models.split(",") if m]
    args.worlds = [int(w) for w in args.worlds.split(",") if w]
    if set(args.models) - set(MODELS) or set(args.worlds) - {1, 2}:
        parser.error("--models takes lm, llama; --worlds takes 1, 2")
    cuda = args.device == "cuda"
    for name, on_cuda, on_cpu in (("check_seconds", 20, 5), ("timing_seconds", 10, 2), ("compile_seconds", 60, 30),
                                  ("blocks", 5, 3), ("timed_steps", 10, 3), ("compile", "lm,llama", "lm")):
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    args.compile = [m for m in args.compile.split(",") if m]
    return args


def build_artifacts(args) -> int:
    """CI's part: every artifact the checks load, into ``args.build_artifacts`` (kept)."""
    specs = specs_for(args, 1) + specs_for(args, 2)
    problems = build_all(specs, args, args.build_artifacts, None, from_artifacts=False)
    for name, (status, why) in problems.items():
        print(f"{status} {name}: {why}", flush=True)
    rest, argv = [], list(args.argv)
    while argv:  # the same options, less --build-artifacts DIR: the sizes must match for a hit
        a = argv.pop(0)
        if a == "--build-artifacts":
            argv.pop(0)
        elif not a.startswith("--build-artifacts="):
            rest.append(a)
    print(f"# artifacts in {args.build_artifacts}: on the GPU machine (same spmd-aot code, same torch release) run "
          f"`python tools/bench/check_cuda.py {' '.join(rest + ['--artifacts', args.build_artifacts])}`", flush=True)
    return 1 if any(status == "FAIL" for status, _ in problems.values()) else 0


def main(argv=None) -> int:
    args = parse(argv)
    deadline = Deadline(args.budget_seconds)
    for line in found(args):
        print(line, flush=True)
    if args.build_artifacts:
        return build_artifacts(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device visible: run this on a GPU machine, or with --device cpu", flush=True)
        return 1
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    rows = []
    saved_inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="check_cuda_") as cache_dir:
        # a fresh inductor cache: torch.compile's first step is a cold compile, not a disk-cache hit
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
        try:
            if args.artifacts:
                shutil.copytree(args.artifacts, cache_dir, dirs_exist_ok=True)
            if 1 in args.worlds:
                rows += world_one(args, cache_dir, deadline)
            if 2 in args.worlds:
                rows += world_two(args, cache_dir, deadline, gpus)
        finally:
            if saved_inductor is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved_inductor
    tolerance = (f"fixed {args.tolerance:.0e}" if args.tolerance is not None
                 else f"max({BASE_TOL:.0e}, {FLOOR_FACTOR} x floor)")
    print(f"\n# summary ({time.time() - deadline.start:.0f}s of a {args.budget_seconds:.0f}s budget; "
          f"tolerance: {tolerance})")
    print(summary(rows), flush=True)
    count = {k: sum(r["status"] == k for r in rows) for k in ("PASS", "FAIL", "SKIP")}
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    print(f"# {count['PASS']} passed, {count['FAIL']} failed, {count['SKIP']} skipped"
          + (f": FAILED {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def world_one(args, cache_dir, deadline) -> list[dict]:
    rows = []
    specs = specs_for(args, 1)
    problems = build_all(specs, args, cache_dir, deadline, from_artifacts=bool(args.artifacts))
    for spec in specs:
        if spec.name in problems:
            row = unbuilt(spec, problems[spec.name])
        elif deadline.left() < args.check_seconds:
            row = skipped(spec, f"budget: {max(0, deadline.left()):.0f}s left")
        else:
            try:
                with one_rank_group(args.device, spec.bf16):
                    row = judge(run_check(spec, 0, args, cache_dir, deadline), args.tolerance)
            except Exception as exc:  # noqa: BLE001
                row = dict(check=spec.name, status="FAIL", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        print_row(row)
        rows.append(row)
    return rows


def world_two(args, cache_dir, deadline, gpus) -> list[dict]:
    specs = specs_for(args, 2)
    if args.device == "cuda" and gpus < 2:
        print(f"SKIP world 2: NCCL needs a GPU per rank, this machine has {gpus}", flush=True)
        return [skipped(s, f"{gpus} GPU(s)") for s in specs]
    problems = build_all(specs, args, cache_dir, deadline, from_artifacts=bool(args.artifacts))
    rows = {s.name: unbuilt(s, problems[s.name]) for s in specs if s.name in problems}
    runnable = [s for s in specs if s.name not in problems]
    if runnable:
        # the ranks watch the deadline themselves; this timeout is the backstop (a hung collective)
        timeout = max(10.0, deadline.left() + 20)
        try:  # spawned ranks (CUDA cannot be forked into), as bench_step starts them
            for row in bench.run_world(2, (args, runnable), deadline, cache_dir, timeout, rank_main=_rank_main):
                rows[row["check"]] = row if row.get("status") == "SKIP" else judge(row, args.tolerance)
        except RuntimeError as exc:
            for s in runnable:
                rows.setdefault(s.name, dict(check=s.name, status="FAIL", error=str(exc)))
    out = [rows[s.name] for s in specs]
    for row in out:
        print_row(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
