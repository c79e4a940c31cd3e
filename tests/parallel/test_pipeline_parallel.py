"""Pipeline parallelism built ahead of time, against torch.distributed.pipelining on real gloo ranks.

The oracle is torch's own pipelining: ``PipelineStage`` over each rank's stage module (the model
with the other stages' blocks deleted, torchtitan's way of making stage modules) driven by
``ScheduleGPipe`` / ``Schedule1F1B`` with the same split, micro-batches and loss; the loaded
step must give the same micro-batch losses and the same parameters after 3 AdamW steps, with
no trace on any rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.building.pipeline_build import build_pipeline
from spmd_aot.errors import SpmdAotError, UnsupportedError
from spmd_aot.parallel.pipeline_parallel import Pipeline, bubble_fraction, even_split_points, schedule_actions, timeline
from spmd_aot.runtime.pipeline_schedule import compile_pipeline
from support.multiproc import run_ranks

VOCAB, DIM, LAYERS, SEQ, BATCH, MICRO = 48, 32, 4, 8, 8, 4


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.norm2 = nn.LayerNorm(d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class LM(nn.Module):
    """A causal LM whose stage modules are itself with blocks deleted (``blocks`` is a ModuleDict,
    so FQNs keep their indices) and ``emb`` / ``head`` set to None off the first / last stage."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleDict({str(i): Block(DIM) for i in range(LAYERS)})
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


def loss_fn(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def make_batch(step: int = 0):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def make_job():
    return spmd_aot.Job(step=loss_fn, model=LM, optimizer=None, batch=make_batch)


def stage_module(model: LM, stage: int, first_of_stage: list[int]) -> LM:
    """torchtitan's stage module: the model with every block outside the stage deleted."""
    bounds = [0] + first_of_stage + [LAYERS]
    keep = set(range(bounds[stage], bounds[stage + 1]))
    for name in list(model.blocks):
        if int(name) not in keep:
            del model.blocks[name]
    if stage != 0:
        model.emb = None
    if stage != len(bounds) - 2:
        model.head = None
    return model


SPLIT = ("blocks.2",)


def _pipeline_for(schedule: str, world: int) -> tuple[Pipeline, list[int]]:
    """The pipeline a parity run uses, and the first block of each stage after the first: one
    stage per rank split before blocks.2, or under interleaved_1f1b one block per stage, two
    stages per rank (rank 0 runs stages 0 and 2)."""
    if schedule == "interleaved_1f1b":
        return Pipeline(2 * world, MICRO, schedule, ("blocks.1", "blocks.2", "blocks.3"), stages_per_rank=2), [1, 2, 3]
    return Pipeline(world, MICRO, schedule, SPLIT), [2]


def _parity_worker(rank, world, cache_dir, schedule, steps=3):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pipeline, firsts = _pipeline_for(schedule, world)
    if rank == 0:  # the offline build, right before the job: other sessions edit this working tree
        build_pipeline(make_job(), pipeline, cache_dir=cache_dir)
    dist.barrier()
    torch.manual_seed(0)
    model = LM()
    local = [s for s in range(pipeline.stages) if pipeline.rank_of(s) == rank]
    refs = [stage_module(copy.deepcopy(model), s, firsts) for s in local]
    ref_stages = [PipelineStage(ref, s, pipeline.stages, torch.device("cpu")) for ref, s in zip(refs, local)]
    if schedule == "interleaved_1f1b":
        ref_schedule = ScheduleInterleaved1F1B(ref_stages, MICRO, loss_fn=loss_fn)
    else:
        ref_schedule = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(ref_stages[0], MICRO, loss_fn=loss_fn)
    ref_params = {name: p for ref in refs for name, p in ref.named_parameters()}
    ref_optim = torch.optim.AdamW(list(ref_params.values()), lr=1e-2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = compile_pipeline(loss_fn, pipeline=pipeline, cache_dir=cache_dir, require_hit=True)
    loss_diff, returned = 0.0, []
    for i in range(steps):
        x, y = make_batch(i)
        ref_losses, losses = [], []
        if rank == 0:
            ref_schedule.step(x)
        else:
            ref_schedule.step(target=y, losses=ref_losses)
        ref_optim.step()
        ref_optim.zero_grad()
        out = step(model, optim, (x, y), losses=losses)
        returned.append(None if out is None else float(out))
        if rank == world - 1:
            loss_diff = max(loss_diff, max(abs(float(a) - float(b)) for a, b in zip(ref_losses, losses)))
            assert len(losses) == MICRO
            assert abs(float(out) - float(torch.stack(ref_losses).mean())) < 1e-5
    param_diff = max((ref_p - model.get_parameter(name)).abs().max().item() for name, ref_p in ref_params.items())
    moved = max((ref_p - LM_init(name)).abs().max().item() for name, ref_p in ref_params.items())
    info = step.cache_info
    return {"loss_diff": loss_diff, "param_diff": param_diff, "moved": moved, "hit": info.hit,
            "traces": info.traces, "returned": returned, "own": sorted(step.stage_parameters) == sorted(ref_params)}


def LM_init(name):
    torch.manual_seed(0)
    return LM().get_parameter(name).detach()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("pp_cache")
    results = {s: build_pipeline(make_job(), Pipeline(2, MICRO, s, SPLIT), cache_dir=cache) for s in ("gpipe", "1f1b")}
    return cache, results


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pp2_matches_torch_pipelining_with_zero_traces(built, schedule):
    cache, results = built
    assert schedule not in results or results[schedule].traced
    out = run_ranks(_parity_worker, 2, str(cache), schedule, timeout=600)
    for rank, r in enumerate(out):
        assert r["hit"] and r["traces"] == 0 and r["own"], r
        assert r["param_diff"] < 1e-4, (rank, r)
        assert r["moved"] > 1e-3, "the parameters must have trained for the comparison to mean anything"
    assert out[1]["loss_diff"] < 1e-4
    assert out[0]["returned"] == [None] * 3 and all(v is not None for v in out[1]["returned"])


def test_schedule_is_in_the_key_and_the_entry(built, tmp_path):
    cache, results = built
    assert results["gpipe"].key != results["1f1b"].key
    first = build_pipeline(make_job(), Pipeline(2, MICRO, "gpipe", SPLIT), cache_dir=tmp_path)
    again = build_pipeline(make_job(), Pipeline(2, MICRO, "gpipe", SPLIT), cache_dir=tmp_path)
    assert first.traced and not again.traced and again.digest == first.digest
    stats = results["1f1b"].stats
    assert stats["schedule"] == "1f1b" and stats["bubble_fraction"] == pytest.approx(1 / (MICRO + 1))
    # 1F1B holds fewer micro-batches' activations on the first stage than GPipe
    assert stats["peak_bytes"][0] < results["gpipe"].stats["peak_bytes"][0]


def test_schedules_are_torchs_action_orders():
    gpipe = schedule_actions(Pipeline(2, 4, "gpipe"))
    assert gpipe[0] == [("F", m) for m in range(4)] + [("B", m) for m in range(4)]
    one = schedule_actions(Pipeline(2, 4, "1f1b"))
    assert one[0] == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert one[1] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert bubble_fraction(Pipeline(4, 8, "1f1b")) == pytest.approx(3 / 11)
    assert timeline(Pipeline(2, 2, "gpipe")) == ["stage 0: F0 F1 .. .. B0 B1", "stage 1: .. F0 F1 B0 B1 .."]
    # interleaved: torch's own action lists (its schedule's per-rank order, idle slots dropped)
    import types

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    from spmd_aot.parallel.pipeline_parallel import rank_actions

    for stages, v, n in ((4, 2, 4), (8, 2, 8), (6, 3, 4), (4, 2, 6), (6, 2, 5)):
        pipeline, ranks = Pipeline(stages, n, "interleaved_1f1b", stages_per_rank=v), stages // v
        torch_self = types.SimpleNamespace(n_local_stages=v, pp_group_size=ranks, _n_microbatches=n,
                                           microbatches_per_round=n // max(1, n // ranks))
        for r, ours in enumerate(rank_actions(pipeline)):
            theirs = ScheduleInterleaved1F1B._calculate_single_rank_operations(torch_self, r)
            assert ours == [(a.computation_type.value[0], a.stage_index, a.microbatch_index) for a in theirs if a]
    looped = Pipeline(8, 8, "interleaved_1f1b", stages_per_rank=2)
    assert bubble_fraction(looped) < 0.6 * bubble_fraction(Pipeline(4, 8, "1f1b"))
    assert timeline(Pipeline(4, 2, "interleaved_1f1b", stages_per_rank=2))[0].startswith("rank 0: F0/0 F1/0 F0/2")
    with pytest.raises(SpmdAotError, match="interleaved_1f1b"):
        Pipeline(4, 4, "1f1b", stages_per_rank=2)


def test_even_split_balances_parameters():
    assert even_split_points(LM(), 2) == ("blocks.2",)
    with pytest.raises(SpmdAotError, match="split_points"):
        even_split_points(nn.Linear(2, 2), 2)


def test_bad_splits_are_refused_naming_the_module(tmp_path):
    with pytest.raises(UnsupportedError, match="names no module"):
        build_pipeline(make_job(), Pipeline(2, 2, "gpipe", ("blocks.9",)), cache_dir=tmp_path)
    with pytest.raises(SpmdAotError, match="split point"):
        Pipeline(3, 2, "gpipe", ("blocks.1",))
    with pytest.raises(SpmdAotError, match="micro-batches"):
        build_pipeline(make_job(), Pipeline(2, 3, "gpipe", SPLIT), cache_dir=tmp_path)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return h @ self.emb.weight.t()


def test_tied_weights_across_stages_are_refused(tmp_path):
    job = spmd_aot.Job(step=loss_fn, model=Tied, optimizer=None, batch=make_batch)
    with pytest.raises(UnsupportedError, match="emb.weight is read by stages"):
        build_pipeline(job, Pipeline(2, 2, "gpipe", ("blocks.1",)), cache_dir=tmp_path)


# ---------------------------------------------------------------------------- a transformers decoder
def llama():
    from support.corpus import _decoder

    return _decoder("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=4, use_cache=False)


def hf_loss(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def hf_batch(step: int = 0):
    from support.corpus import VOCAB as HF_VOCAB

    g = torch.Generator().manual_seed(200 + step)
    x = torch.randint(0, HF_VOCAB, (4, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def test_show_ls_and_verify_read_pipeline_entries(built, capsys):
    from spmd_aot.cli.app import main

    cache, results = built
    r = results["1f1b"]
    assert main(["show", r.key[:16], "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "pp=2 1f1b x4 micro-batches, split before blocks.2" in out
    assert "stage 0: F0 F1 F2 F3 .. .. B0 F4" not in out  # 4 micro-batches only
    assert "stage 0: F0 F1 .. B0 F2 B1 F3 B2 .. B3" in out and "stage 1: .. F0 B0 F1 B1 F2 B2 F3 B3 .." in out
    assert "bubble:       0.2" in out and "at most 2 in flight" in out and "at most 1 in flight" in out
    assert "receives add_" in out and "sends loss float32[]" in out
    assert main(["ls", "--cache-dir", str(cache)]) == 0
    assert "pp2 1f1b" in capsys.readouterr().out
    assert main(["verify", "--cache-dir", str(cache)]) == 0
    assert "0 problems" in capsys.readouterr().out


# ---------------------------------------------------------------------------- memory
def mem_batch():
    x = torch.randint(0, VOCAB, (32, 32), generator=torch.Generator().manual_seed(1))
    return x, torch.roll(x, -1, dims=1)


def _memory_worker(rank, world, cache_dir):
    """Each stage's estimate against torch's pipelining of the same schedule measured by
    ``PeakMemory`` (parameters watched, gradients unset before the step, no optimizer)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from spmd_aot.building.peak_memory import PeakMemory

    x, y = mem_batch()
    out = {}
    for schedule, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        pipeline = Pipeline(world, MICRO, schedule, SPLIT)
        if rank == 0:
            built = build_pipeline(spmd_aot.Job(step=loss_fn, model=LM, optimizer=None, batch=mem_batch), pipeline,
                                   cache_dir=cache_dir)
            estimate = built.stats["peak_bytes"]
        else:
            estimate = None
        box = [estimate]
        dist.broadcast_object_list(box, src=0)
        torch.manual_seed(0)
        ref = stage_module(LM(), rank, [2])
        schedule_ = cls(PipelineStage(ref, rank, world, torch.device("cpu")), MICRO, loss_fn=loss_fn)

        def run(schedule_=schedule_):
            schedule_.step(x) if rank == 0 else schedule_.step(target=y, losses=[])
        run()  # the first step sets up the stage's buffers
        ref.zero_grad(set_to_none=True)
        with PeakMemory(list(ref.parameters())) as measured:
            run()
        out[schedule] = (box[0][rank], measured.peak)
    return out


def test_stage_memory_estimate_matches_eager_pipelining_within_10_percent(tmp_path):
    out = run_ranks(_memory_worker, 2, str(tmp_path), timeout=600)
    for rank, by_schedule in enumerate(out):
        for schedule, (estimate, eager) in by_schedule.items():
            assert 0.9 <= estimate / eager <= 1.1, (rank, schedule, estimate, eager)
    # 1F1B keeps at most S - s micro-batches in flight, GPipe all of them
    assert out[0]["1f1b"][1] < 0.7 * out[0]["gpipe"][1]


# ---------------------------------------------------------------------------- pp x data parallel
def _pp_dp_worker(rank, world, cache_dir, schedule, placement, steps=3):
    """pp 2 x dp 2: mesh (pp, dp) in row-major order, each replica's pipeline a torch
    ``PipelineStage`` over its own pp group. ``replicate``: the stage gradients averaged over the
    stage's replicas before AdamW steps (what DDP does under pipelining); ``shard``: the stage
    module under ``fully_shard`` (each block, then the root) over the replicas, FSDP2 reducing."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import DTensor

    stages, dp = 2, world // 2
    stage, replica = divmod(rank, dp)
    pipeline = Pipeline(stages, MICRO, schedule, SPLIT, placement)
    if rank == 0:
        build_pipeline(make_job(), pipeline, world_size=world, cache_dir=cache_dir)
    mesh = init_device_mesh("cpu", (stages, dp), mesh_dim_names=("pp", "dp"))
    dist.barrier()
    torch.manual_seed(0)
    model = LM()
    ref = stage_module(copy.deepcopy(model), stage, [2])
    if placement == "shard":
        for block in ref.blocks.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(ref, mesh=mesh["dp"])
    ref_schedule = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(
        PipelineStage(ref, stage, stages, torch.device("cpu"), group=mesh.get_group("pp")), MICRO, loss_fn=loss_fn)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = compile_pipeline(loss_fn, pipeline=pipeline, cache_dir=cache_dir, require_hit=True)
    loss_diff = 0.0
    for i in range(steps):
        x, y = make_batch(i + 50 * replica)  # each replica its own batch
        ref_losses, losses = [], []
        ref_schedule.step(x) if stage == 0 else ref_schedule.step(target=y, losses=ref_losses)
        if placement == "replicate":
            for p in ref.parameters():
                p.grad.div_(dp)
                dist.all_reduce(p.grad, group=mesh.get_group("dp"))
        ref_optim.step()
        ref_optim.zero_grad()
        step(model, optim, (x, y), losses=losses)
        if losses:
            loss_diff = max(loss_diff, max(abs(float(a) - float(b)) for a, b in zip(ref_losses, losses)))

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t
    param_diff = max((whole(ref_p) - whole(model.get_parameter(name))).abs().max().item()
                     for name, ref_p in ref.named_parameters())
    own = [model.get_parameter(n) for n in step.stage_parameters]
    sharded = all(isinstance(p, DTensor) and p.to_local().shape[0] == -(-p.shape[0] // dp) for p in own)
    mine = torch.cat([whole(p).detach().reshape(-1) for p in own])
    others = [torch.empty_like(mine) for _ in range(dp)]
    dist.all_gather(others, mine, group=mesh.get_group("dp"))
    return {"loss_diff": loss_diff, "param_diff": param_diff, "traces": step.cache_info.traces,
            "hit": step.cache_info.hit, "replicas_equal": all(torch.equal(o, others[0]) for o in others),
            "sharded": sharded}


@pytest.mark.parametrize("placement", ["replicate", "shard"])
def test_pp2_x_dp2_matches_torch_pipelining_over_ddp_and_fsdp2(tmp_path, placement):
    out = run_ranks(_pp_dp_worker, 4, str(tmp_path), "1f1b", placement, timeout=600)
    for rank, r in enumerate(out):
        assert r["hit"] and r["traces"] == 0 and r["replicas_equal"], (rank, r)
        assert r["param_diff"] < 1e-4 and r["loss_diff"] < 1e-4, (rank, r)
        assert r["sharded"] == (placement == "shard"), (rank, r)


def test_world_size_must_be_a_multiple_of_the_stages(tmp_path):
    with pytest.raises(SpmdAotError, match="multiple of 2"):
        build_pipeline(make_job(), Pipeline(2, MICRO, "gpipe", SPLIT), world_size=3, cache_dir=tmp_path)


def test_a_rank_reads_only_its_stage_and_a_changed_stage_graph_is_refused(built, tmp_path):
    import shutil

    from spmd_aot.entries.pipeline_artifact import check_pipeline_entry, read_pipeline_manifest, read_stage
    from spmd_aot.errors import CorruptArtifactError
    from spmd_aot.store import open_store

    cache, results = built
    store = open_store(cache)
    digest = results["gpipe"].digest
    manifest = read_pipeline_manifest(store, digest)

    class Counting:
        def __init__(self):
            self.read = []

        def get(self, d, limit=None):
            self.read.append(d)
            return store.get(d, limit=limit)

    counting = Counting()
    loaded = read_stage(counting, manifest, 1, torch.device("cpu"))
    stage1 = {d for name, d in manifest["blobs"].items() if name.startswith("stage1.")}
    stage0_only = {d for name, d in manifest["blobs"].items() if name.startswith("stage0.")} - stage1
    assert set(counting.read) <= stage1 and not set(counting.read) & stage0_only
    assert loaded.ports["outputs"][0]["name"] == "loss"

    copy_dir = tmp_path / "copy"
    shutil.copytree(cache, copy_dir)
    target = manifest["blobs"]["stage1.backward"]
    path = next(p for p in copy_dir.rglob("*") if p.is_file() and (p.parent.name + p.name) == target)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptArtifactError):
        check_pipeline_entry(open_store(copy_dir), digest)


def _miss_worker(rank, world, cache_dir):
    """No entry: rank 0 traces every stage at the first call and stores the entry, every rank
    loads its stage from it; a second compiled step then hits."""
    torch.manual_seed(0)
    model = LM()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pipeline = Pipeline(world, MICRO, "gpipe", SPLIT)
    first = compile_pipeline(loss_fn, pipeline=pipeline, cache_dir=cache_dir)
    losses = []
    first(model, optim, make_batch(0), losses=losses)
    second = compile_pipeline(loss_fn, pipeline=pipeline, cache_dir=cache_dir)
    second(model, optim, make_batch(1))
    return {"first": (first.cache_info.hit, first.cache_info.traces, first.cache_info.source),
            "second": (second.cache_info.hit, second.cache_info.traces), "losses": [float(v) for v in losses]}


def test_a_miss_is_traced_by_rank_0_and_stored(tmp_path):
    out = run_ranks(_miss_worker, 2, str(tmp_path), timeout=600)
    assert out[0]["first"] == (False, 1, "trace") and out[1]["first"] == (False, 0, "trace")
    assert out[0]["second"] == (True, 0) and out[1]["second"] == (True, 0)
    assert len(out[1]["losses"]) == MICRO and out[0]["losses"] == []


def test_key_holds_the_split_the_micro_batches_the_placement_and_the_loss():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spmd_aot.building.pipeline_build import pipeline_plan
    from spmd_aot.keying.pipeline_key import pipeline_key
    from spmd_aot.tracing.fake_factories import fake_factories

    with fake_factories(FakeTensorMode()):
        model, batch = LM(), make_batch()

    def key(pipeline, world=2, loss=loss_fn):
        plan = pipeline_plan(pipeline, world, "cpu", pipeline.split_points or ("blocks.2",))
        return pipeline_key(model, loss, batch, pipeline, plan)

    base = key(Pipeline(2, 4, "gpipe", SPLIT))
    assert key(Pipeline(2, 4, "gpipe", SPLIT)).key == base.key
    for changed, ingredient in ((key(Pipeline(2, 4, "gpipe", ("blocks.1",))), "pipeline"),
                                (key(Pipeline(2, 2, "gpipe", SPLIT)), "pipeline"),
                                (key(Pipeline(2, 4, "1f1b", SPLIT)), "pipeline"),
                                (key(Pipeline(2, 4, "gpipe", SPLIT, "shard"), world=4), "pipeline"),
                                (key(Pipeline(2, 4, "gpipe", SPLIT), world=4), "parallel"),
                                (key(Pipeline(2, 4, "gpipe", SPLIT, "replicate", 2, {"blocks.*.fc": "colwise"}),
                                     world=4), "pipeline"),
                                (key(Pipeline(2, 4, "gpipe", SPLIT), loss=hf_loss), "loss_code")):
        assert changed.key != base.key
        assert changed.ingredients[ingredient] != base.ingredients[ingredient]


# ---------------------------------------------------------------------------- pp x dp_shard x tp
HEADS = 4


class TPBlock(nn.Module):
    """A block tensor parallel can split: q, k, v and fc colwise, o and out rowwise; the local
    head count read from the local tensor (``view(b, t, -1, head_dim)``). The key has no bias:
    its gradient is exactly zero (softmax is shift invariant), and AdamW would turn two
    implementations' rounding noise in it into lr-sized steps."""

    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=name != "k") for name in "qkvo")
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.norm2 = nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm(x)

        def heads(z):
            return z.view(b, t, -1, d // HEADS).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TPLM(LM):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): TPBlock(DIM) for i in range(LAYERS)})


TP_PLAN = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise", "blocks.*.o": "rowwise",
           "blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}


def _pp_dp_tp_worker(rank, world, cache_dir, placement="shard", prebuilt=True, hf=False, steps=3):
    """pp 2 x dp 2 x tp 2 (world 8, mesh (pp, dp, tp) row-major; world 4: pp 2 x tp 2). The
    oracle is torch's pipelining over stage modules under ``parallelize_module`` (the TP mesh,
    ColwiseParallel / RowwiseParallel as TP_PLAN says) then, under ``shard``, ``fully_shard``
    (each block, then the root, over the replicas): torchtitan's PP x FSDP x TP; under
    ``replicate`` the stage gradients averaged over the replicas (DDP). ``prebuilt=False``: no
    entry, rank 0 traces at the first call."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    stages, tp = 2, 2
    dp = world // (stages * tp)
    stage, replica = rank // (dp * tp), rank // tp % dp
    pipeline = Pipeline(stages, MICRO, "1f1b", SPLIT, placement, tp, TP_PLAN)
    if rank == 0 and prebuilt:
        build_pipeline(spmd_aot.Job(step=loss_fn, model=TPLM, optimizer=None, batch=make_batch), pipeline,
                       world_size=world, cache_dir=cache_dir)
    shape, names = ((stages, dp, tp), ("pp", "dp", "tp")) if dp > 1 else ((stages, tp), ("pp", "tp"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dist.barrier()
    torch.manual_seed(0)
    model = TPLM()
    ref = stage_module(copy.deepcopy(model), stage, [2])
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for name in ref.blocks:
        parallelize_module(ref.blocks[name], mesh["tp"], {m: styles[s]() for m, s in
                                                          ((p.split(".")[-1], s) for p, s in TP_PLAN.items())})
        if placement == "shard":
            fully_shard(ref.blocks[name], mesh=mesh["dp"])
    if placement == "shard":
        fully_shard(ref, mesh=mesh["dp"])
    ref_schedule = Schedule1F1B(PipelineStage(ref, stage, stages, torch.device("cpu"), group=mesh.get_group("pp")),
                                MICRO, loss_fn=loss_fn)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = compile_pipeline(loss_fn, pipeline=pipeline, cache_dir=cache_dir, require_hit=prebuilt)
    loss_diff = 0.0
    for i in range(steps):
        x, y = make_batch(i + 50 * replica)  # each replica its own batch; its TP ranks the same one
        ref_losses, losses = [], []
        ref_schedule.step(x) if stage == 0 else ref_schedule.step(target=y, losses=ref_losses)
        if placement == "replicate" and dp > 1:
            for p in ref.parameters():
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(local.div_(dp), group=mesh.get_group("dp"))
        ref_optim.step()
        ref_optim.zero_grad()
        step(model, optim, (x, y), losses=losses)
        if losses:
            loss_diff = max(loss_diff, max(abs(float(a) - float(b)) for a, b in zip(ref_losses, losses)))

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t
    diffs = {name: (whole(ref_p) - whole(model.get_parameter(name))).abs().max().item()
             for name, ref_p in ref.named_parameters()}
    param_diff = max(diffs.values())
    own = {n: model.get_parameter(n) for n in step.stage_parameters}
    placements = {n: [repr(pl) for pl in p.placements] for n, p in own.items() if isinstance(p, DTensor)}
    # laid out as torch lays out the stage module under parallelize_module then fully_shard
    as_torch = all(isinstance(own[n], DTensor) == isinstance(ref_p, DTensor) and
                   (not isinstance(ref_p, DTensor) or tuple(own[n].placements) == tuple(ref_p.placements))
                   for n, ref_p in ref.named_parameters())
    return {"loss_diff": loss_diff, "param_diff": param_diff, "traces": step.cache_info.traces,
            "hit": step.cache_info.hit, "placements": placements, "own": len(own), "as_torch": as_torch,
            "diffs": {n: d for n, d in diffs.items() if d > 1e-5},
            "hf": _hf_tp_part(rank, cache_dir, placement, dp, tp) if hf else None}


HF_TP_PLAN = {**{f"model.layers.*.self_attn.{m}": "colwise" for m in ("q_proj", "k_proj", "v_proj")},
              "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
              "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}


def _hf_tp_part(rank, cache_dir, placement, dp, tp, steps=3, micro=2):
    """The transformers Llama (4 layers, GQA: one key/value head per TP rank) under the same mesh,
    against the unsplit model under eager autograd over every replica's batch, micro-batch by
    micro-batch (each micro-batch's loss divided by micro-batches x replicas): what pipelining
    with averaged replicas computes."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    pipeline = Pipeline(2, micro, "1f1b", (), placement, tp, HF_TP_PLAN)
    if rank == 0:
        build_pipeline(spmd_aot.Job(step=hf_loss, model=llama, optimizer=None, batch=hf_batch), pipeline,
                       world_size=dist.get_world_size(), cache_dir=cache_dir)
    dist.barrier()
    torch.manual_seed(0)
    model = llama()
    ref = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    step = compile_pipeline(hf_loss, pipeline=pipeline, cache_dir=cache_dir, require_hit=True)
    for i in range(steps):
        for r in range(dp):
            x, y = hf_batch(i + 50 * r)
            for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
                (hf_loss(ref(xm), ym) / (micro * dp)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        step(model, optim, hf_batch(i + 50 * (rank // tp % dp)))

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t
    diff = max((ref.get_parameter(n) - whole(model.get_parameter(n))).abs().max().item()
               for n in step.stage_parameters)
    return {"param_diff": diff, "hit": step.cache_info.hit, "traces": step.cache_info.traces,
            "own": step.stage_parameters}


def test_pp2_x_dp_shard2_x_tp2_matches_torch_pipelining_over_fsdp2_and_tp(tmp_path):
    """Our LM against torch's pipelining over parallelize_module + fully_shard stage modules, and a
    transformers Llama against its unsplit eager self, in one world-8 launch."""
    out = run_ranks(_pp_dp_tp_worker, 8, str(tmp_path), "shard", True, True, timeout=900)
    for rank, r in enumerate(out):
        assert r["hit"] and r["traces"] == 0, (rank, r)
        assert r["hf"]["hit"] and r["hf"]["traces"] == 0 and r["hf"]["param_diff"] < 1e-4, (rank, r["hf"])
        assert r["param_diff"] < 1e-4 and r["loss_diff"] < 1e-4, (rank, r)
        assert len(r["placements"]) == r["own"] and r["as_torch"], (rank, r)  # DTensors placed as torch's
    names = out[0]["hf"]["own"] + out[4]["hf"]["own"]  # an even split: every parameter on one stage
    assert len(names) == len(set(names)) == len(list(llama().parameters()))
    assert "model.embed_tokens.weight" in out[0]["hf"]["own"] and "lm_head.weight" in out[4]["hf"]["own"]
    q, o, norm = (out[0]["placements"][f"blocks.0.{m}.weight"] for m in ("q", "o", "norm"))
    assert q[1] == "Shard(dim=0)" and "StridedShard" in q[0], q  # colwise, then its shards over the replicas
    assert o == ["Shard(dim=0)", "Shard(dim=1)"] and norm == ["Shard(dim=0)"], (o, norm)  # norm: FSDP2 alone


# ---------------------------------------------------------------------------- options and the CLI
def test_parallel_options_the_cli_and_build_drive_the_same_pipeline(built, capsys):
    from spmd_aot.cli.app import main
    from spmd_aot.runtime.pipeline_schedule import PipelineStep

    cache, results = built
    flags = ["--pipeline-stages", "2", "--microbatches", str(MICRO), "--schedule", "1f1b", "--split-point", "blocks.2"]
    assert main(["build", f"{__file__}:make_job", "-w", "2", *flags, "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert results["1f1b"].key[:12] in out and "cached" in out and "pp=2 1f1b x4" in out
    options = spmd_aot.ParallelOptions(pipeline_stages=2, microbatches=MICRO, schedule="1f1b", split_points=SPLIT)
    again = spmd_aot.build(make_job(), parallel=options, world_size=2, cache_dir=cache)
    assert again.key == results["1f1b"].key and not again.traced
    step = spmd_aot.compile(loss_fn, parallel=options, cache_dir=cache)
    assert isinstance(step, PipelineStep) and step.pipeline == Pipeline(2, MICRO, "1f1b", SPLIT)
    # the per-stage mesh gives TP and the replicas: pp 2 x (dp_shard 2 x tp 2)
    tp = spmd_aot.ParallelOptions(pipeline_stages=2, placement="shard", mesh_shape=(2, 2), tp_plan=TP_PLAN)
    assert tp.pipeline(8) == Pipeline(2, 1, "gpipe", (), "shard", 2, TP_PLAN)
    with pytest.raises(SpmdAotError, match="world size is 4"):
        tp.pipeline(4)
    with pytest.raises(SpmdAotError, match="without pipeline_stages"):
        spmd_aot.ParallelOptions(microbatches=4)
    with pytest.raises(SpmdAotError, match="does not combine with context_parallel"):
        spmd_aot.ParallelOptions(pipeline_stages=2, context_parallel=True, mesh_shape=(2,))
    with pytest.raises(SpmdAotError, match="kernels"):
        spmd_aot.build(make_job(), parallel=options, world_size=2, cache_dir=cache, kernels=True)
    with pytest.raises(SpmdAotError, match="spmd_aot.compile"):  # a whole-step wrapper would ignore the pipeline
        spmd_aot.SPMD(LM(), parallel=options)
