"""A job that destroys its process group leaves no group alive behind it.

A group that outlives ``destroy_process_group()`` is destroyed during interpreter teardown,
where gloo's worker threads now and then abort the process ("terminate called without an
active exception"; see spmd_aot/runtime/teardown.py). Each rank here counts gloo's threads in the
last exit handler, after spmd-aot's own: none may be left.
"""

import os
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

_RANK = """
import atexit, os, sys

def gloo_threads_at_exit():  # registered first: runs after every other exit handler
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print("GLOO_THREADS", sum("gloo" in n for n in names), flush=True)

atexit.register(gloo_threads_at_exit)
sys.path.insert(0, sys.argv[4])
import_first = sys.argv[5] == "before"
if import_first:
    import spmd_aot
import torch
import torch.distributed as dist

rank, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if not import_first:
    import spmd_aot  # a job that imports the package once its group is up
from support.jobs import fresh_objects, make_batch
from spmd_aot.examples.models import train_step

model, optim = fresh_objects("mlp", "sgd")
step = spmd_aot.compile(train_step, cache_dir=cache)
print("OK", step(model, optim, make_batch("mlp", rank, 0)).item(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
@pytest.mark.parametrize("imported", ["before", "after"], ids=["imported-before-init", "imported-after-init"])
def test_no_gloo_thread_survives_destroy_process_group(tmp_path, imported):
    from support.multiproc import free_port

    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), port, str(tmp_path / "cache"),
                               str(REPO / "tests"), imported], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    deadline = time.monotonic() + 180
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for rank, proc in enumerate(procs):
        out, err = proc.communicate()
        assert proc.returncode == 0 and "OK" in out, f"rank {rank} (rc {proc.returncode}):\n{out}\n{err[-3000:]}"
        assert "GLOO_THREADS 0" in out, f"rank {rank}: a process group outlived destroy_process_group():\n{out}"
