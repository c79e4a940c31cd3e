"""Graph transformations applied between tracing and storing. Each pass is one function.

Passes edit ``gm.graph`` and never call ``gm.recompile()``: generating Python code for a
70B-shaped step's graph (35k nodes) takes seconds, so the pipeline does it once, at the end."""

from .buckets import bucket_gradient_all_reduces
from .cleanup import fold_views, remove_detach, strip_profiler_ops
from .conv_masks import ask_conv_weight_grads
from .collectives import collective_stats, dedupe_collectives, is_collective
from .inplace_views import rewrite_inplace_views
from .prefetch import prefetch_groups
from .schedule import sink_waits

__all__ = ["strip_profiler_ops", "remove_detach", "fold_views", "collective_stats", "dedupe_collectives", "is_collective",
           "bucket_gradient_all_reduces", "prefetch_groups", "sink_waits",
           "rewrite_inplace_views", "ask_conv_weight_grads"]
