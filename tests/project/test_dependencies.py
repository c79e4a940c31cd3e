"""A fresh machine has only what pyproject.toml declares: the package imports nothing else, and
a multi-rank job runs without numpy (torch's optional companion, which spmd-aot never needs)."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "spmd_aot"

# distribution name in pyproject -> the top-level modules it provides
PROVIDES = {"torch": {"torch"}, "safetensors": {"safetensors"}, "msgpack": {"msgpack"},
            "filelock": {"filelock"}, "boto3": {"boto3", "botocore"}}


def _declared() -> tuple[set[str], set[str]]:
    """(modules of the required dependencies, modules of the optional ones but the test extra)."""
    text = (REPO / "pyproject.toml").read_text()

    def names(block: str) -> set[str]:
        dists = {re.split(r"[\s<>=!~\[;]", d, maxsplit=1)[0].lower() for d in re.findall(r'"([^"]+)"', block)}
        return set().union(*(PROVIDES.get(d, {d}) for d in dists))

    required = names(re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1))
    extras = re.search(r"^\[project\.optional-dependencies\](.*?)^\[", text, re.S | re.M).group(1)
    optional = set().union(*(names(block) for name, block in re.findall(r"^(\w+) = \[(.*?)\]", extras, re.M)
                             if name != "test"))
    return required, optional


def _imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported inside functions) of one file."""
    tree = ast.parse(path.read_text(), str(path))
    top, lazy = set(), set()

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                names = {a.name.split(".")[0] for a in child.names}
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                names = {child.module.split(".")[0]}
            else:
                visit(child, nested)
                continue
            (lazy if in_function else top).update(names)

    visit(tree, False)
    return top, lazy


def test_the_package_imports_only_declared_dependencies():
    required, optional = _declared()
    assert {"torch", "safetensors", "msgpack", "filelock"} <= required and "numpy" not in required
    allowed = set(sys.stdlib_module_names) | required | {"spmd_aot"}
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        top, lazy = _imports(path)
        where = path.relative_to(REPO)
        problems += [f"{where}: imports {m} at module level" for m in sorted(top - allowed)]
        # an optional extra (boto3 for s3://) is imported only where it is used
        problems += [f"{where}: imports {m}" for m in sorted(lazy - allowed - optional)]
    assert problems == [], "undeclared imports (add them to pyproject.toml or remove them):\n" + "\n".join(problems)


# Each rank is its own interpreter with numpy made unimportable before torch loads. Rank 1's
# cache is empty, so it gets the artifact's bytes from rank 0 over gloo (the path that once
# called Tensor.numpy()).
_RANK = """
import sys
sys.modules["numpy"] = None  # importing it fails; importlib.util.find_spec says it is not there
sys.path.insert(0, sys.argv[4])
import spmd_aot  # before torch, as the README's main job does: torch's import warns without numpy
import torch
import torch.distributed as dist
from support.jobs import fresh_objects, make_batch
from spmd_aot.examples.models import train_step

try:
    torch.zeros(1).numpy()
except RuntimeError as exc:
    assert "Numpy is not available" in str(exc), exc
else:
    raise AssertionError("numpy is importable in this rank")
rank, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
model, optim = fresh_objects("mlp", "sgd")
step = spmd_aot.compile(train_step, cache_dir=cache)
losses = [step(model, optim, make_batch("mlp", rank, s)).item() for s in range(3)]
print("OK", step.cache_info.source, losses)
dist.destroy_process_group()
"""


@pytest.mark.multiproc  # its two ranks are plain subprocesses, which tests/conftest.py cannot see
def test_two_rank_job_runs_without_numpy(tmp_path):
    from support.multiproc import free_port

    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    caches = [tmp_path / "shared", tmp_path / "rank1-empty"]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), port, str(caches[rank]),
                               str(REPO / "tests")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    deadline = time.monotonic() + 180
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(2)  # the other rank's error, if any, then stop it: a peer is gone
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    outs = [(proc.wait(), *proc.communicate()) for proc in procs]
    for rank, (rc, out, err) in enumerate(outs):
        assert rc == 0 and out.startswith("OK trace"), f"rank {rank} (rc {rc}):\n{out}\n{err[-3000:]}"
        assert "NumPy" not in err, err  # no "Failed to initialize NumPy" noise either
