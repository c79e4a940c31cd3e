"""``spmd-aot plan``: the candidate table, what fits, the arithmetic printed, and its errors."""

from __future__ import annotations

import pytest

from spmd_aot.cli.app import main

JOB = '''
import torch, torch.nn.functional as F
from torch import nn
import spmd_aot

D = 64

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(D), nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.out = nn.Embedding(128, D), nn.Linear(D, 128)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, idx):
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.out(x)

def step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss

job = spmd_aot.Job(step=step, model=Net, optimizer=lambda m: torch.optim.AdamW(m.parameters()),
                   batch=lambda: (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32))))
'''
TP = ["--tp-plan", "blocks.*.up=colwise", "--tp-plan", "blocks.*.down=rowwise"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "plan_job.py"
    path.write_text(JOB)
    return f"{path}:job"


def _table(out: str) -> dict[str, list[str]]:
    """CONFIG -> the row's other cells (cells are separated by two or more spaces)."""
    import re

    lines = out.splitlines()
    rows = {}
    for line in lines[1:]:
        if " configurations of " in line:
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


def test_lists_every_mesh_with_peak_bytes_and_fit(target, capsys):
    assert main(["plan", target, "-w", "8", "--gpu-memory", "1GiB", *TP]) == 0
    out = capsys.readouterr().out
    rows = _table(out)
    for config in ("replicate 8", "shard 8", "shard 8 bf16 ac", "shard 4 x tp 2", "replicate 2 x tp 4", "tp 8 bf16"):
        assert config in rows, (config, sorted(rows))
        assert rows[config][1] == "yes"
    assert len(rows) == 2 * 2 * (2 + 2 + 2 + 1)  # dtypes x checkpointing x (meshes at tp 1, 2, 4; tp 8 alone)
    assert rows["shard 8"][2] != "0 B" and rows["replicate 8"][2] == "0 B"  # all_gather only when sharded
    assert "-p shard --mesh-shape 4x2 --tp-plan ..." in rows["shard 4 x tp 2"][-1]
    assert "configurations of" in out and "peak" in out and "activations" in out  # the arithmetic of row 1


def test_exit_1_when_nothing_fits(target, capsys):
    assert main(["plan", target, "-w", "2", "--gpu-memory", "1KiB", "--param-dtype", "bf16"]) == 1
    rows = _table(capsys.readouterr().out)
    assert rows and all(cells[1] == "no" for cells in rows.values())


def test_fixed_mesh_and_headroom(target, capsys):
    assert main(["plan", target, "-w", "8", "--gpu-memory", "1GiB", "-p", "shard", "--mesh-shape", "2x4",
                 "--param-dtype", "bf16"]) == 0
    rows = _table(capsys.readouterr().out)
    assert sorted(rows) == ["hsdp 2x4 bf16", "hsdp 2x4 bf16 ac"]
    peak = rows["hsdp 2x4 bf16"][0]
    value, unit = peak.split()
    size = f"{float(value) * 1.05:.3f}{unit.replace('iB', '')}"  # a GPU 5% larger than the peak
    assert main(["plan", target, "-w", "8", "--gpu-memory", size, "-p", "shard", "--mesh-shape", "2x4",
                 "--param-dtype", "bf16", "--headroom", "0"]) == 0
    assert _table(capsys.readouterr().out)["hsdp 2x4 bf16"][1] == "yes"
    assert main(["plan", target, "-w", "8", "--gpu-memory", size, "-p", "shard", "--mesh-shape", "2x4",
                 "--param-dtype", "bf16", "--headroom", "0.2", "--fitting"]) == 0
    rows = _table(capsys.readouterr().out)
    assert "hsdp 2x4 bf16" not in rows and "hsdp 2x4 bf16 ac" in rows  # less 20% it no longer fits: not listed


@pytest.mark.parametrize("argv,message", [
    (["--gpu-memory", "lots"], "expected a size"),
    (["--gpu-memory", "1GiB", "--headroom", "1.5"], "fraction in [0, 1)"),
    (["--gpu-memory", "1GiB", "--context-parallel", "--mesh-shape", "4x2"], "does not model context_parallel"),
])
def test_errors_exit_2(target, capsys, argv, message):
    assert main(["plan", target, "-w", "8", *argv]) == 2
    assert message in capsys.readouterr().err
