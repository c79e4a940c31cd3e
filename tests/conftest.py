"""Test-session setup shared by every test file."""

from __future__ import annotations

import os
import tempfile

import pytest

# Loads remember passed checks in a per-user record (spmd_aot/entries/verified.py); the suite keeps its
# own, so it neither reads nor writes the record of the user running it. Set before any rank
# process starts: they inherit the environment.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="spmd-aot-tests-state-")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers
def pytest_collection_modifyitems(config, items):
    """``multiproc`` on every test that starts processes (read from the code), ``slow`` on the tests
    ``tests/slow.txt`` lists (measured): see ``support.markers``."""
    from support.markers import mark_multiproc, mark_slow

    mark_multiproc(items)
    mark_slow(items)
