"""The ``spmd-aot build`` command line that builds one configuration.

Every hint that tells a user to build something (a job's cache miss, ``spmd-aot explain``) is
made here, so it is a complete command that can be pasted as printed: the target when it is
known, the world size, placement, device, mesh, every non-default communication option and the
cache location. ``tests/cli/test_cli_conventions.py`` parses it back with the CLI's own parser.
"""

from __future__ import annotations

import os
import shlex

from .parallel.dims import cli_fields
from .parallel.plan import Plan
from .schema import Comm

__all__ = ["build_command", "TARGET_PLACEHOLDER"]

#: Stands for the user's ``module:function`` where the code giving the hint cannot know it.
TARGET_PLACEHOLDER = "TARGET"


def build_command(plan: Plan, *, target: str | None = None, cache_dir: str | os.PathLike | None = None) -> str:
    """``spmd-aot build TARGET --world-size N --placement P ...`` for exactly ``plan``."""
    default = Comm()
    args = ["spmd-aot", "build", target or TARGET_PLACEHOLDER,
            "--world-size", str(plan.world_size), "--placement", plan.placement]
    if plan.device_type != "cpu":
        args += ["--device", plan.device_type]
    own = cli_fields(plan.placement, bool(plan.tp_plan))  # the CLI applies these options to it only
    if "mesh_shape" in own and len(plan.mesh_shape) > 1:
        args += ["--mesh-shape", "x".join(map(str, plan.mesh_shape))]
    if "param_placements" in own:
        for pattern, placement in plan.param_placements:
            args += ["--param-placement", f"{pattern}={placement}"]
    if "shard_groups" in own:
        for group in plan.shard_groups:
            args += ["--shard-group", group]
    if "reshard_after_forward" in own and not plan.reshard_after_forward:
        args.append("--keep-params-after-forward")
    for pattern, style in plan.tp_plan:
        args += ["--tp-plan", f"{pattern}={style}"]
    if plan.bucket_cap_mb != default.bucket_cap_mb:
        args += ["--bucket-cap-mb", repr(plan.bucket_cap_mb)]
    if plan.first_bucket_cap_mb != default.first_bucket_cap_mb:
        args += ["--first-bucket-cap-mb", repr(plan.first_bucket_cap_mb)]
    for field, value in (plan.mixed_precision.to_dict().items() if plan.mixed_precision else ()):
        if field == "cast_forward_inputs":
            args += [] if value else ["--no-cast-forward-inputs"]
        elif value is not None:
            args += ["--" + field.replace("_", "-"), value]
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    return shlex.join(args)

