"""``CacheInfo``: what a compiled step's first call found and cost, for whole steps and pipelines.

Its own module so that both ``step.py`` (``spmd_aot.compile``, which hands a pipeline's options
to ``pipeline_schedule.py``) and ``pipeline_schedule.py`` report in one form without importing
each other.
"""

from __future__ import annotations

import dataclasses

__all__ = ["CacheInfo"]


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    hit: bool  # rank 0's lookup found a serving entry (no build was needed)
    key: str
    digest: str  # manifest digest every rank loaded
    source: str  # "trace": rank 0 traced it for this call; "cache": stored before (by anyone)
    seconds: float  # first-call cost on this rank: key, agreement, trace if any, load, bind
    trace_seconds: float  # what tracing this step cost (measured when it was built)
    traces: int = 0  # traces this process has performed for this compiled step so far
