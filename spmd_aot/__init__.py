"""spmd-aot: build a distributed train step once, offline; load it at job start; never retrace.

    step = spmd_aot.compile(train_step, parallel=spmd_aot.ParallelOptions("shard"), cache_dir="cache")
    loss = step(model, optim, batch)        # rank-local loss, as eager DDP returns it
    print(step.cache_info)

    evaluate = spmd_aot.compile(eval_step, placement="replicate", cache_dir="cache")
    metrics = evaluate(model, batch)         # forward-only: eval_step(model, batch), no optimizer
"""

import warnings

with warnings.catch_warnings():
    # Importing torch (its functional tensors) warns "Failed to initialize NumPy" on a machine
    # without numpy. spmd-aot never uses numpy (it is not a dependency), so the warning would
    # only be noise in every build and on every rank; the filter ends with this block.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch
    import torch._subclasses.functional_tensor  # noqa: F401

from .errors import (ArtifactMismatchError, CacheMissError, CorruptArtifactError, LockTimeoutError,
                     SpmdAotError, TargetError, UnsafeArtifactError, UnsupportedError, OpNotAllowedError)
from .keying.fingerprint import register_fingerprint
from .job import Job, load_target
from .parallel.mixed_precision import MixedPrecisionPolicy
from .tracing.override import Override
from .parallel.plan import Plan
from .runtime.step import CacheInfo, CompiledStep, compile
from .runtime import teardown  # noqa: E402  (registers what a job's end must do; see the module)
from .options import ParallelOptions, RunOptions
from .schema import Comm, Schema
from .spmd import SPMD
from .parallel.pipeline_parallel import Pipeline
from .runtime.pipeline_schedule import PipelineStep, compile_pipeline

__all__ = [
    "Job", "build", "compile", "load_target", "Override", "register_fingerprint", "SPMD",
    "ParallelOptions", "RunOptions", "Schema", "Comm",
    "BuildResult", "CacheInfo", "CompiledStep", "Plan", "MixedPrecisionPolicy",
    "SpmdAotError", "TargetError", "UnsupportedError", "CacheMissError", "ArtifactMismatchError",
    "CorruptArtifactError", "UnsafeArtifactError", "OpNotAllowedError", "LockTimeoutError",
    "Pipeline", "build_pipeline", "compile_pipeline", "PipelineStep",
]
del teardown  # imported for the exit handler it registers, not part of the API


def __getattr__(name: str):
    """``build`` and ``BuildResult`` on first use: a job that only loads (``compile`` on a hit)
    never imports the tracer and the build passes, part of its start-up."""
    if name in ("build", "BuildResult"):
        from .building import builder

        return getattr(builder, name)
    if name == "build_pipeline":
        from .building.pipeline_build import build_pipeline

        return build_pipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
