"""Load checks remembered per artifact, in a per-user record outside every cache.

Why: the meta-tensor check of a loaded graph (``validate.check_graph``: op contracts, views
inside their storage, size limits) is most of a hit's cost (about 90 ms of a 12-layer step's
load), and its result depends only on bytes the manifest digest pins by sha256 (graph, layout,
constants; every load re-hashes them) and on the checker itself. So a job that checked an
artifact once records ``sha256(manifest digest, checker identity)`` as an empty file, and later
loads of the same artifact by the same checker skip the meta run. The allowlist (by decoding,
or, for a program kept in ``runtime/prepared.py``'s record, by resolving its op names), the
layout-versus-live-job comparison and the guards still apply on every load.

The record lives in ``$XDG_STATE_HOME/spmd_aot/verified`` (default ``~/.local/state/...``),
never in a cache directory, so whoever can write a cache cannot forge an entry. It is used only
when the folder and its parent belong to this user (or root) and nobody else can write them;
otherwise nothing is remembered and every load checks in full. ``spmd-aot verify`` never reads
it. The checker identity is the bytes of every module that decides the check (and the allowlist
file), the torch release, the load limits in force and this job's opted-in ops: changing any of
them checks again.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import stat

import torch

__all__ = ["known", "remember", "record_dir", "entry_name", "private_folder"]

# the files whose code decides what a load check accepts, relative to the package
# (and the allowlist file this process chose: allowlist.chosen_list)
_CHECKER_FILES = ("format/validate.py", "format/contracts", "format/allowlist.py",
                  "format/limits.py", "tracing/fused_meta.py", "format/serialize.py", "format/bounded.py",
                  "format/verified.py")


def record_dir() -> pathlib.Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return pathlib.Path(base) / "spmd_aot" / "verified"


@functools.lru_cache(maxsize=1)
def _checker_code() -> str:
    here = pathlib.Path(__file__).parent.parent
    h = hashlib.sha256(torch.__version__.encode())
    for name in _CHECKER_FILES:
        path = here / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(b"\0" + f.relative_to(here).as_posix().encode() + b"\0" + f.read_bytes())
    from .allowlist import chosen_list
    h.update(b"\0" + chosen_list().identity())
    return h.hexdigest()


def entry_name(digest: str) -> str:
    """The record's name for artifact ``digest`` under this checker (also the base of
    ``runtime/prepared.py``'s names)."""
    from .allowlist import opted_in_ops
    from .limits import load_limits

    ident = f"{digest}\0{_checker_code()}\0{load_limits()!r}\0{sorted(opted_in_ops())!r}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _private(path: pathlib.Path) -> bool:
    """Owned by this user (or root), a real directory, writable by nobody else."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid in (os.getuid(), 0)
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def private_folder(folder: pathlib.Path) -> bool:
    """``folder`` and its parent belong to this user (or root) and nobody else can write them."""
    return _private(folder) and _private(folder.parent)


def known(digest: str) -> bool:
    """This checker has checked artifact ``digest`` (its manifest digest) before, and passed it."""
    folder = record_dir()
    if not private_folder(folder):
        return False
    return os.path.isfile(folder / entry_name(digest))


def remember(digest: str) -> None:
    """Record that artifact ``digest`` passed this checker (best effort: a read-only home or a
    folder others can write means nothing is recorded)."""
    folder = record_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not private_folder(folder):
            return
        fd = os.open(folder / entry_name(digest), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        os.close(fd)
    except OSError:
        pass
