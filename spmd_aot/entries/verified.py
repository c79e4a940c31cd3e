"""Load checks remembered per artifact, in a per-user record outside every cache.

Why: the meta-tensor check of a loaded graph (``validate.check_graph``: op contracts, views
inside their storage, size limits) is most of a hit's cost (about 90 ms of a 12-layer step's
load), and its result depends only on bytes the manifest digest pins by sha256 (graph, layout,
constants; every load re-hashes them) and on the checker itself. So a job that checked an
artifact once records, under ``sha256(manifest digest, checker identity)``, what the check
derived that a program still needs: the meta result's shape, strides and dtype of every node
(``interpreter/invariants.py`` compares the real results with them at run time). Later loads of the
same artifact by the same checker skip the meta run and take those from the record
(``format/records.py``: tagged plain data, its sha256, the bounded decoder). The allowlist (by
decoding, or, for a program kept in ``runtime/prepared.py``'s record, by resolving its op
names), the layout-versus-live-job comparison and the guards still apply on every load.

The record lives in ``$XDG_STATE_HOME/spmd_aot/verified`` (default ``~/.local/state/...``),
never in a cache directory, so whoever can write a cache cannot forge an entry. It is used only
when the folder is reached safely (``private_dir``): from ``/`` one component at a time, each
opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one before and checked by ``fstat`` on
the opened descriptor (so a directory swapped for a symbolic link, or renamed, between a check
and an open is never followed: there is no second lookup by path); every ancestor must belong
to this user or root and be writable by nobody else unless sticky (``/tmp``), and the record
folder and its parent must belong to this user or root and be writable by nobody else.
Records are opened relative to the folder's descriptor with ``O_NOFOLLOW``. Otherwise nothing
is remembered and every load checks in full. ``spmd-aot verify`` never reads it. The checker
identity is the bytes of every module that decides the check (and the allowlist file), the
torch release, the load limits in force and this job's opted-in ops: changing any of them
checks again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import stat
from collections.abc import Iterator

import torch

__all__ = ["known", "recall", "remember", "record_dir", "entry_name", "private_dir", "private_folder",
           "MAX_RECORDS"]

MAX_RECORDS = 256
_MAGIC = b"spmd-aot verified 3\n"
_MAX_BYTES = 256 << 20

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)

# the files whose code decides what a load check accepts, relative to the package
# (and the allowlist file this process chose: allowlist.chosen_list)
_CHECKER_FILES = ("format/validate.py", "format/contracts", "format/allowlist.py",
                  "format/limits.py", "format/fused_meta.py", "format/serialize.py", "format/bounded.py",
                  "entries/verified.py", "format/records.py", "interpreter/invariants.py",
                  "format/device_results.py", "format/shape_rules.py")


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
    from ..format.allowlist import chosen_list
    h.update(b"\0" + chosen_list().identity())
    return h.hexdigest()


def entry_name(digest: str) -> str:
    """The record's name for artifact ``digest`` under this checker (also the base of
    ``runtime/prepared.py``'s names)."""
    from ..format.allowlist import opted_in_ops
    from ..format.limits import load_limits

    ident = f"{digest}\0{_checker_code()}\0{load_limits()!r}\0{sorted(opted_in_ops())!r}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _trusted(st: os.stat_result, ancestor: bool) -> bool:
    """Owned by this user or root, a directory, writable by nobody else (an ancestor: unless
    sticky, where others cannot rename or remove what is not theirs)."""
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (os.getuid(), 0):
        return False
    return not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or (ancestor and bool(st.st_mode & stat.S_ISVTX))


def _walk(folder: pathlib.Path, create: bool) -> int | None:
    """``private_dir``'s descriptor (the caller closes it), or None."""
    parts = pathlib.Path(os.path.realpath(folder)).parts  # links resolved once; the walk follows none
    try:
        fd = os.open(parts[0], _DIR_FLAGS)
    except OSError:
        return None
    try:
        for depth, part in enumerate(parts[1:], start=1):
            if not _trusted(os.fstat(fd), ancestor=True):
                return None
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            new = os.open(part, _DIR_FLAGS, dir_fd=fd)  # a link here: ELOOP or ENOTDIR, never followed
            os.close(fd)
            fd = new
            if depth >= len(parts) - 2 and not _trusted(os.fstat(fd), ancestor=False):
                return None  # the record folder and its parent: no group/other write at all
        result, fd = fd, None
        return result
    except OSError:
        return None
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def private_dir(folder: pathlib.Path, create: bool = False) -> Iterator[int | None]:
    """A descriptor of ``folder`` reached safely (module doc), or None when it is missing or any
    component fails the rule. ``create``: make missing components (mode 0700) on the way."""
    fd = _walk(folder, create)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def private_folder(folder: pathlib.Path) -> bool:
    """Whether ``folder`` passes ``private_dir``'s rule now."""
    with private_dir(folder) as fd:
        return fd is not None


def recall(digest: str) -> list | None:
    """What this checker derived for artifact ``digest`` (its manifest digest) when it passed it
    before (``invariants.describe`` of every node's meta result), or None."""
    from ..format import records

    name = entry_name(digest)
    with private_dir(record_dir()) as fd:
        if fd is None:
            return None
        try:
            body = records.read(fd, name, _MAGIC, _MAX_BYTES)
            if body is None:
                return None
            doc = records.decode(body, "verified record")  # (distinct results, each node's position)
            if type(doc) is not tuple or len(doc) != 2:
                raise ValueError("not a table of expected results")
            return records.expanded(doc[0], doc[1], "verified record")
        except Exception:  # damaged (a crash mid-write): as if never checked; it is checked again
            records.remove(fd, name)
            return None


def known(digest: str) -> bool:
    """This checker has checked artifact ``digest`` before, and passed it."""
    return recall(digest) is not None


def remember(digest: str, expected: list) -> None:
    """Record that artifact ``digest`` passed this checker, with what it derived (best effort: a
    read-only home or a folder others can write means nothing is recorded)."""
    from ..format import records

    try:
        body = records.encode(records.interned(expected))  # layers repeat their results' metadata
        if len(body) > _MAX_BYTES:
            return
        with private_dir(record_dir(), create=True) as fd:
            if fd is not None:
                records.write(fd, entry_name(digest), _MAGIC, body)
                records.trim(fd, MAX_RECORDS)
    except (OSError, TypeError, ValueError):
        pass
