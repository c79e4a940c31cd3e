"""Model factories as users write them run on fake tensors: they change dtype (``.to(torch.bfloat16)``,
``.double()``, ``.half()``) and initialize with value-reading code (``trunc_normal_``), and a
bf16 model built that way trains like eager DDP."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_aot
from spmd_aot.entries import read_manifest
from spmd_aot.store import LocalStore
from support.multiproc import run_ranks

STEPS = 3


def step(model, optim, batch):
    x, y = batch
    loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def mlp(dtype=None, convert=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.LayerNorm(16), nn.Linear(16, 4))
    if dtype is not None:
        model = model.to(dtype)
    if convert is not None:
        model = getattr(model, convert)()
    return model


def trunc_normal_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    for p in model.parameters():
        nn.init.trunc_normal_(p, std=0.02)  # loops on ``mask.any()``: reads values
    return model


def batch(dtype=torch.float32, rank=0, s=0):
    g = torch.Generator().manual_seed(100 * rank + s)
    return torch.randn(4, 8, generator=g).to(dtype), torch.randint(0, 4, (4,), generator=g)


def job(model, dtype=torch.float32):
    return spmd_aot.Job(step=step, model=model, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                        batch=lambda: batch(dtype))


def _input_dtypes(cache, digest) -> set:
    import msgpack

    store = LocalStore(cache)
    layout = msgpack.unpackb(store.get(read_manifest(store, digest)["blobs"]["layout"]), raw=False)
    return {e["dtype"] for e in layout["inputs"] if e.get("kind") == "param"}


@pytest.mark.parametrize("placement", ["replicate", "shard"])
@pytest.mark.parametrize("dtype,convert,expect", [
    (torch.bfloat16, None, "bfloat16"), (None, "double", "float64"), (None, "half", "float16")])
def test_factory_that_changes_dtype_builds(tmp_path, placement, dtype, convert, expect):
    batch_dtype = {"bfloat16": torch.bfloat16, "float64": torch.float64, "float16": torch.float16}[expect]
    result = spmd_aot.build(job(lambda: mlp(dtype, convert), batch_dtype), world_size=2, placement=placement,
                            cache_dir=tmp_path)
    assert result.traced
    assert _input_dtypes(tmp_path, result.digest) == {expect}


def test_factory_whose_init_reads_values_builds(tmp_path):
    result = spmd_aot.build(job(trunc_normal_mlp), world_size=2, cache_dir=tmp_path)
    assert result.traced and result.stats["nodes"] > 0


def _bf16_worker(rank, world, cache):
    from torch.nn.parallel import DistributedDataParallel

    ref = mlp(torch.bfloat16)
    ddp = DistributedDataParallel(ref)
    ref_optim = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ref_losses = [step(ddp, ref_optim, batch(torch.bfloat16, rank, s)).item() for s in range(STEPS)]

    model = mlp(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = spmd_aot.compile(step, cache_dir=cache, require_hit=True)
    losses = [compiled(model, optim, batch(torch.bfloat16, rank, s)).item() for s in range(STEPS)]
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(ref.state_dict().values(), model.state_dict().values()))
    return {"traces": compiled.cache_info.traces, "dtypes": {str(p.dtype) for p in model.parameters()},
            "param": diff, "loss": max(abs(a - b) for a, b in zip(ref_losses, losses))}


def test_bf16_parameters_train_like_eager_ddp(tmp_path):
    spmd_aot.build(job(lambda: mlp(torch.bfloat16), torch.bfloat16), world_size=2, cache_dir=tmp_path)
    for r in run_ranks(_bf16_worker, 2, str(tmp_path)):
        assert r["traces"] == 0 and r["dtypes"] == {"torch.bfloat16"}
        # bf16 keeps 8 bits of mantissa: one rounding step of a weight near 1 is 2**-8
        assert r["param"] <= 2 ** -8, r
        assert r["loss"] <= 1e-2, r
