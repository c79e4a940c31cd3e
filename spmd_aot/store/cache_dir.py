"""Where the local cache is when nobody says: one rule for every entry point.

``build``, a training job, the CLI and ``open_store`` all resolve the directory here, so a build
and the job it serves agree on where artifacts live without being told twice.
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["ENV_CACHE_DIR", "resolve_cache_dir", "default_cache_dir"]

ENV_CACHE_DIR = "SPMD_AOT_CACHE_DIR"


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Pick the cache directory: explicit argument > env SPMD_AOT_CACHE_DIR >
    $XDG_CACHE_HOME/spmd_aot > ~/.cache/spmd_aot.

    One rule for every entry point, so ``build`` and the training job agree on where
    artifacts live. ``~`` is expanded; nothing is created. Empty environment values count as
    unset, and a relative XDG_CACHE_HOME is ignored, as the XDG base-directory spec requires.
    """
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return pathlib.Path(env).expanduser()
    return default_cache_dir()


def default_cache_dir() -> pathlib.Path:
    """$XDG_CACHE_HOME/spmd_aot (when absolute), else ~/.cache/spmd_aot."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        xdg_path = pathlib.Path(xdg).expanduser()
        if xdg_path.is_absolute():
            return xdg_path / "spmd_aot"
    return pathlib.Path("~/.cache/spmd_aot").expanduser()
