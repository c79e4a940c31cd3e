"""Step time of the loaded pipeline-parallel step vs torch.distributed.pipelining, on real gloo ranks.

    python tools/bench/bench_pipeline.py                       # world 2, d_model 128, 4 layers: GPipe, 1F1B, interleaved
    python tools/bench/bench_pipeline.py --quick               # a smoke run of a few steps

Both variants train the same causal LM (blocks in an ``nn.ModuleDict``, so a stage module is the
model with the other stages' blocks deleted, torchtitan's way) with AdamW, split before the
middle block (interleaved 1F1B: 4 stages of one block, 2 per rank), the step's batch cut into
micro-batches:

  loaded  ``spmd_aot.compile_pipeline(loss_fn, pipeline=..., require_hit=True)`` on the entry
          ``spmd_aot.build_pipeline`` stored first (no tracing at job start)
  eager   torch's ``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
          ``ScheduleInterleaved1F1B`` over each rank's stage modules, then ``optim.step()``

Each variant is warmed up, then timed in interleaved blocks framed by barriers; ms/step is rank
0's median over blocks, the ratio the median over blocks of loaded / eager within a block.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab=512, d=128, layers=4, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleDict({str(i): Block(d, heads) for i in range(layers)})
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


def loss_fn(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


ARGS = {}


def make_model():
    return LM(d=ARGS["d_model"], layers=ARGS["layers"])


def make_batch():
    x = torch.randint(0, 512, (ARGS["batch"], ARGS["context"]), generator=torch.Generator().manual_seed(0))
    return x, torch.roll(x, -1, dims=1)


def _rank(rank, world, port, cache, args, queue):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    import spmd_aot

    ARGS.update(args)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    layers = args["layers"]
    rows = []
    x, y = make_batch()
    for schedule, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B),
                          ("interleaved_1f1b", ScheduleInterleaved1F1B)):
        if schedule == "interleaved_1f1b":  # 2 stages per rank, the blocks split evenly over 2 * world stages
            stages, v = 2 * world, 2
        else:
            stages, v = world, 1
        firsts = [layers * s // stages for s in range(1, stages)]
        pipeline = spmd_aot.Pipeline(stages, args["micro"], schedule, tuple(f"blocks.{i}" for i in firsts),
                                     stages_per_rank=v)
        if rank == 0:
            spmd_aot.build_pipeline(spmd_aot.Job(step=loss_fn, model=make_model, optimizer=None, batch=make_batch),
                                    pipeline, cache_dir=cache)
        dist.barrier()
        torch.manual_seed(0)
        model = make_model()
        step = spmd_aot.compile_pipeline(loss_fn, pipeline=pipeline, cache_dir=cache, require_hit=True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        bounds = [0, *firsts, layers]
        refs, ref_stages = [], []
        for s in (s for s in range(stages) if pipeline.rank_of(s) == rank):
            torch.manual_seed(0)
            ref = make_model()
            for name in list(ref.blocks):
                if not bounds[s] <= int(name) < bounds[s + 1]:
                    del ref.blocks[name]
            ref.emb = ref.emb if s == 0 else None
            ref.head = ref.head if s == stages - 1 else None
            refs.append(ref)
            ref_stages.append(PipelineStage(ref, s, stages, torch.device("cpu")))
        sched = cls(ref_stages if v > 1 else ref_stages[0], args["micro"], loss_fn=loss_fn)
        ref_optim = torch.optim.AdamW([p for ref in refs for p in ref.parameters()], lr=1e-3)

        def eager(sched=sched, ref_optim=ref_optim):
            sched.step(x) if rank == 0 else sched.step(target=y, losses=[])
            ref_optim.step()
            ref_optim.zero_grad()

        def loaded(step=step, model=model, optim=optim):
            step(model, optim, (x, y))
        variants = {"loaded": loaded, "eager": eager}
        for fn in variants.values():  # warm-up
            for _ in range(2):
                fn()
        times = {k: [] for k in variants}
        for block in range(args["blocks"]):
            order = list(variants) if block % 2 == 0 else list(reversed(variants))
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args["steps"]):
                    variants[name]()
                dist.barrier()
                times[name].append((time.perf_counter() - start) / args["steps"] * 1e3)
        ratio = statistics.median(a / b for a, b in zip(times["loaded"], times["eager"]))
        rows.append((schedule, statistics.median(times["loaded"]), statistics.median(times["eager"]), ratio))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv=None) -> int:
    import multiprocessing as mp
    import socket

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    args = {"layers": a.layers, "d_model": a.d_model, "context": a.context, "batch": a.batch, "micro": a.micro,
            "steps": 2 if a.quick else a.steps, "blocks": 2 if a.quick else a.blocks}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as cache:
        procs = [ctx.Process(target=_rank, args=(r, 2, port, cache, args, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        rows = queue.get(timeout=1800)
        for proc in procs:
            proc.join()
    print(f"# world 2 (pp 2), d_model {a.d_model}, {a.layers} layers, context {a.context}, batch {a.batch}, "
          f"{a.micro} micro-batches, AdamW")
    print("| schedule | loaded ms/step | torch pipelining ms/step | loaded / torch |")
    print("| --- | ---: | ---: | ---: |")
    for schedule, loaded, eager, ratio in rows:
        print(f"| {schedule} | {loaded:.1f} | {eager:.1f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
