"""Test-session setup shared by every test file."""

from __future__ import annotations

import os
import tempfile

# Loads remember passed checks in a per-user record (spmd_aot/format/verified.py); the suite keeps its
# own, so it neither reads nor writes the record of the user running it. Set before any rank
# process starts: they inherit the environment.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="spmd-aot-tests-state-")
