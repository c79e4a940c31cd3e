"""Tests for ``spmd-aot explain``: the key computed without tracing matches the build's key, and
a miss names the ingredient that differs from the nearest stored artifact."""

from __future__ import annotations

import time

import pytest

from spmd_aot.cli.app import main
from spmd_aot.store import LocalStore

JOB_FILE = '''\
import torch

import spmd_aot
from spmd_aot.examples.models import MLP, train_step


def _job(batch_size):
    return spmd_aot.Job(
        step=train_step,
        model=lambda: MLP(32, 64, 10),
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        batch=lambda: (torch.randn(batch_size, 32), torch.randint(0, 10, (batch_size,))),
    )


job = _job(4)
job_b8 = _job(8)
'''


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(job file, cache) with the job built for world size 2."""
    job_file = tmp_path_factory.mktemp("job") / "explain_job.py"
    job_file.write_text(JOB_FILE)
    cache = tmp_path_factory.mktemp("cache")
    assert main(["build", f"{job_file}:job", "-w", "2", "--cache-dir", str(cache)]) == 0
    return job_file, cache


def _explain(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["explain", *map(str, argv)])
    return rc, capsys.readouterr().out


def test_hit_after_build_with_the_builds_key(built, capsys):
    job_file, cache = built
    start = time.perf_counter()
    rc, out = _explain(capsys, f"{job_file}:job", "-w", 2, "--cache-dir", cache)
    seconds = time.perf_counter() - start
    assert rc == 0, out
    assert out.startswith("hit: world=2 mesh=2 replicate cpu")
    (key, digest), = LocalStore(cache).refs().items()
    assert f"key     {key}" in out and f"digest  {digest}" in out
    print(f"explain (hit) took {seconds:.2f} s")


def test_other_world_size_is_a_miss_naming_parallel(built, capsys):
    job_file, cache = built
    refs_before = LocalStore(cache).refs()
    rc, out = _explain(capsys, f"{job_file}:job", "--world-size", 4, "--cache-dir", cache)
    assert rc == 1
    assert out.startswith("miss: world=4 mesh=4 replicate cpu")
    assert "differs in: parallel (" in out
    assert "world_size: stored 2, live 4" in out
    assert "spmd-aot build" in out and "--world-size 4" in out
    assert LocalStore(cache).refs() == refs_before  # explain never traces or stores


def test_other_batch_size_is_a_miss_naming_batch(built, capsys):
    job_file, cache = built
    rc, out = _explain(capsys, f"{job_file}:job_b8", "-w", 2, "--cache-dir", cache)
    assert rc == 1
    assert "differs in: batch (" in out
    assert "parallel" not in out


def test_missing_cache_is_a_miss_and_creates_nothing(built, tmp_path, capsys):
    job_file, _ = built
    rc, out = _explain(capsys, f"{job_file}:job", "-w", 2, "--cache-dir", tmp_path / "nope")
    assert rc == 1 and "does not exist" in out
    assert not (tmp_path / "nope").exists()


def test_bad_target_exits_2(tmp_path, capsys):
    assert main(["explain", "no_such_module_xyz:job", "-w", "2", "--cache-dir", str(tmp_path)]) == 2
    assert "error: TARGET" in capsys.readouterr().err


# A job whose step and model live in the job file, so edits to that file change the key.
EDITABLE = '''\
import torch

import spmd_aot


def helper():
    return {helper!r}


class Net(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.fc(x))


def step(model, optim, batch):
    loss = model(batch).sum(){step_extra}
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def job(p={p}):
    return spmd_aot.Job(step=step, model=lambda: Net(p),
                        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        batch=lambda: torch.randn(2, 8))
'''


@pytest.mark.parametrize("edit, expect", [
    (dict(helper="changed"), "step_code (the file defining step changed (step itself did not"),
    (dict(helper="changed"), "model_code (at [0]: the code of Net changed"),
    (dict(step_extra=" * 1.0"), "step_code (the code of step changed)"),
    (dict(p=0.25), 'module_structure (at drop.p: stored "0.5", live "0.25")'),
], ids=["helper-beside-the-step", "helper-beside-the-model", "the-step-itself", "a-module-attribute"])
def test_miss_names_the_changed_code_or_attribute(edit, expect, tmp_path, capsys):
    values = dict(helper="original", step_extra="", p=0.5)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "editable_job.py").write_text(EDITABLE.format(**values))
    (tmp_path / "b" / "editable_job.py").write_text(EDITABLE.format(**{**values, **edit}))
    cache = tmp_path / "cache"
    assert main(["build", f"{tmp_path / 'a' / 'editable_job.py'}:job", "-w", "1", "--cache-dir", str(cache)]) == 0
    rc, out = _explain(capsys, f"{tmp_path / 'b' / 'editable_job.py'}:job", "-w", 1, "--cache-dir", cache)
    assert rc == 1
    assert expect in out, out
