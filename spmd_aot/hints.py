"""The ``spmd-aot build`` command line that builds one configuration.

Every hint that tells a user to build something (a job's cache miss, ``spmd-aot explain``) is
made here, so it is a complete command that can be pasted as printed: the target when it is
known, the world size, placement, device, mesh, every non-default communication option and the
cache location. ``tests/cli/test_cli_conventions.py`` parses it back with the CLI's own parser.
"""

from __future__ import annotations

import os
import shlex

from .options import ParallelOptions
from .parallel.plan import Plan

__all__ = ["build_command", "TARGET_PLACEHOLDER"]

#: Stands for the user's ``module:function`` where the code giving the hint cannot know it.
TARGET_PLACEHOLDER = "TARGET"


def build_command(plan: Plan, *, target: str | None = None, cache_dir: str | os.PathLike | None = None) -> str:
    """``spmd-aot build TARGET --world-size N --placement P ...`` for exactly ``plan``: its options'
    own command-line words (``ParallelOptions.words``), so every option a plan can hold is said."""
    args = ["spmd-aot", "build", target or TARGET_PLACEHOLDER,
            "--world-size", str(plan.world_size), "--placement", plan.placement]
    if plan.device_type != "cpu":
        args += ["--device", plan.device_type]
    args += ParallelOptions.from_plan(plan).words(skip=("placement",))
    if cache_dir is not None:
        args += ["--cache-dir", str(cache_dir)]
    return shlex.join(args)
