"""Graph transformations applied between tracing and storing. Each pass is one function."""

from .cleanup import remove_detach, strip_profiler_ops
from .collectives import collective_stats, dedupe_collectives, is_collective
from .prefetch import prefetch_groups

__all__ = ["strip_profiler_ops", "remove_detach", "collective_stats", "dedupe_collectives", "is_collective",
           "prefetch_groups"]
