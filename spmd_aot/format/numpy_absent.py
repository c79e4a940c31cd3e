"""Spare torch a failing ``import numpy`` per call when numpy is not installed.

numpy is not a dependency. Without it, torch's ``sym_max``/``sym_min`` (called for every
tensor's contiguity check while tracing and while checking a graph on meta tensors) try
``import numpy`` on every call, and each failing import searches every ``sys.path`` entry:
about a fifth of a build's time and most of a load's. Marking numpy absent in ``sys.modules``
for the duration makes that import fail at once, exactly as it would have failed anyway.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator

__all__ = ["numpy_lookups_skipped"]


@contextlib.contextmanager
def numpy_lookups_skipped() -> Iterator[None]:
    """While active, ``import numpy`` fails without a search if numpy is not installed."""
    if "numpy" in sys.modules or importlib.util.find_spec("numpy") is not None:
        yield  # installed (or already imported): nothing to skip
        return
    sys.modules["numpy"] = None  # the import system's own "known missing" marker
    try:
        yield
    finally:
        if sys.modules.get("numpy", 0) is None:
            del sys.modules["numpy"]
