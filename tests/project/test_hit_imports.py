"""A job that hits loads what it runs and nothing it would only need to trace: the tracer, the
build pipeline and the builder stay unimported (they were a third of ``import spmd_aot``)."""

import json
import os
import subprocess
import sys

import spmd_aot
from support.jobs import make_job

_CHILD = """
import json, sys
import spmd_aot
from spmd_aot.examples.models import train_step
from support.jobs import fresh_objects, make_batch
model, optim = fresh_objects("mlp", "sgd")
step = spmd_aot.compile(train_step, cache_dir=sys.argv[1], require_hit=True)
step(model, optim, make_batch("mlp"))
print(json.dumps({"hit": step.cache_info.hit,
                  "modules": sorted(m for m in sys.modules if m.startswith("spmd_aot"))}))
"""

# (``spmd_aot.passes`` still comes in: the parallel axes label and bucket collectives with it)
TRACE_ONLY = ("spmd_aot.building.pipeline", "spmd_aot.building.builder", "spmd_aot.tracing.trace")


def test_a_hit_imports_neither_the_tracer_nor_the_builder(tmp_path):
    spmd_aot.build(make_job("mlp", "sgd"), world_size=1, cache_dir=tmp_path)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the tests root
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hit"]
    loaded = [m for m in TRACE_ONLY if m in result["modules"]]
    assert not loaded, f"a hit imported {loaded}"
