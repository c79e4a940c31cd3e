"""Prepared programs remembered per artifact, in the per-user record beside ``verified``.

Why: on a cache hit, decoding the stored graph (every node validated against the allowlist and
the load limits) and building its ``Program`` (folding, last uses, argument gatherers) were
most of what a job paid before its first step: ~25 ms of ~55 for a 12-layer step. Both depend
only on the artifact's bytes (pinned by its manifest digest, re-hashed on every load), the code
that decodes, checks and builds, and the live groups and device. So the first load of an
artifact keeps the built ``ProgramTable`` here, and later loads rebuild the program from it
(``Program.from_table``: ~3 ms) instead of decoding again.

Trust: a record stands in for a decode and a check this user's own job ran, exactly as a
``verified`` entry stands in for the meta check, and it is kept under the same rules: in
``$XDG_STATE_HOME/spmd_aot/prepared``, never in a cache, used only when that folder and its
parent belong to this user and nobody else can write them. Whoever can write a cache can
neither write a record nor choose its content (it is what our decoder made of the digest-pinned
bytes); a record's name hashes the ``verified`` identity (manifest digest, checker code, torch
release, load limits, opted-in ops) together with the code that builds programs, the Python
release, the live groups and the device, so any change there finds no record. On top of that:

* a record carries the sha256 of its content, checked before it is read: a torn or corrupted
  file is ignored (and removed), and the load decodes as if there were none;
* it is read by an unpickler that builds nothing but plain data, ``Ref``s and slices (its
  ``find_class`` refuses every other global) and torch's dtypes, memory formats, layouts and
  devices (by name, through ``persistent_load``); ops are stored by name and resolved through
  the allowlist again (``resolve_target``), so the allowlist in force still applies;
* at most ``MAX_RECORDS`` records are kept (the least recently written go first).

Anything unexpected reading a record is a miss of the record, never an error of the load.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import operator
import os
import pathlib
import pickle
import sys
import tempfile

import torch

from ..format import verified
from ..format.contracts import op_name
from ..format.serialize import Ref, resolve_target
from .program import Program, ProgramTable, value_checked

__all__ = ["program_for", "load", "save", "record_dir", "MAX_RECORDS"]

log = logging.getLogger(__name__)

MAX_RECORDS = 64
_MAGIC = b"spmd-aot prepared 1\n"
_MAX_BYTES = 256 << 20  # as much as a graph blob may be (LoadLimits.graph_bytes)
_BUILDER_FILES = ("runtime/program.py", "runtime/constant_fold.py", "runtime/prepared.py")
_ENUMS = (torch.dtype, torch.memory_format, torch.layout)
_GETITEM = "operator.getitem"


def record_dir() -> pathlib.Path:
    return verified.record_dir().parent / "prepared"


def program_for(artifact, groups: list[str], device: torch.device):
    """The ``Program`` of a loaded ``artifact``: rebuilt from its record when there is one,
    otherwise decoded, checked and built (``Artifact.program``), and its table kept."""
    table = load(artifact.digest, groups, device)
    if table is not None:
        try:
            program = Program.from_table(table, artifact.constants_on(device))
            log.debug("artifact %s: program rebuilt from its prepared record", artifact.digest[:12])
            return program
        except Exception as exc:  # a record that does not fit its artifact: decode, as without one
            log.info("prepared-program record of %s not usable (%s: %s); decoding the graph",
                     artifact.digest[:12], type(exc).__name__, str(exc)[:200])
            _remove(record_dir() / _name(artifact.digest, groups, device))
    program = artifact.program(groups, device)
    save(artifact.digest, groups, device, program.table)
    log.debug("artifact %s: graph decoded; its program kept for later loads", artifact.digest[:12])
    return program


def load(digest: str, groups: list[str], device: torch.device) -> ProgramTable | None:
    """The table kept for artifact ``digest`` bound to ``groups`` and ``device``, or None."""
    folder = record_dir()
    if not verified.private_folder(folder):
        return None
    path = folder / _name(digest, groups, device)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # no record: the common first load
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
        if len(data) > _MAX_BYTES or not data.startswith(_MAGIC):
            raise ValueError("not a record")
        body = data[len(_MAGIC) + 32:]
        if hashlib.sha256(body).digest() != data[len(_MAGIC):len(_MAGIC) + 32]:
            raise ValueError("content does not match its sha256")
        return _table(_Unpickler(io.BytesIO(body)).load())
    except Exception as exc:  # a record is an optimization: any doubt, and the load decodes
        log.info("prepared-program record %s ignored (%s: %s); decoding the graph", path.name,
                 type(exc).__name__, str(exc)[:200])
        _remove(path)
        return None


def save(digest: str, groups: list[str], device: torch.device, table: ProgramTable) -> None:
    """Keep ``table`` for later loads (best effort, as ``verified.remember``)."""
    folder = record_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not verified.private_folder(folder):
            return
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(_plain(table))
        body = buffer.getvalue()
        if len(body) > _MAX_BYTES:
            return
        path = folder / _name(digest, groups, device)
        # a fresh name (O_EXCL, random): ranks on several hosts may share one home directory
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(tmp, path)  # readers see the whole record or none
        except BaseException:
            _remove(pathlib.Path(tmp))
            raise
        _trim(folder)
    except Exception as exc:  # a read-only home, a full disk, an unpicklable constant argument
        log.info("prepared program not kept (%s: %s)", type(exc).__name__, str(exc)[:200])


def _name(digest: str, groups: list[str], device: torch.device) -> str:
    ident = (f"{verified.entry_name(digest)}\0{_builder_code()}\0{sys.version}\0"
             f"{list(groups)!r}\0{device}")
    return hashlib.sha256(ident.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def _builder_code() -> str:
    here = pathlib.Path(__file__).parent.parent
    h = hashlib.sha256()
    for name in _BUILDER_FILES:
        h.update(b"\0" + name.encode() + b"\0" + (here / name).read_bytes())
    return h.hexdigest()


def _trim(folder: pathlib.Path) -> None:
    """Keep the ``MAX_RECORDS`` most recently written records."""
    records = []
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            records.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path))
    for _, path in sorted(records, reverse=True)[MAX_RECORDS:]:
        _remove(pathlib.Path(path))


def _remove(path: pathlib.Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---------------------------------------------------------------------------- the stored form
def _target_name(target) -> str:
    if target is operator.getitem:
        return _GETITEM
    return op_name(getattr(target, "overload", target))  # a value-checked op: the op it wraps


def _plain(table: ProgramTable) -> tuple:
    """``table`` with ops named (everything else is plain data, ``Ref``s, torch enums, devices)."""
    folds = tuple(f if len(f) == 2 else (f[0], _target_name(f[1]), f[2], f[3]) for f in table.folds)
    steps = tuple((_target_name(t), *rest) for t, *rest in table.steps)
    return (table.n_nodes, table.n_inputs, table.n_ops, table.constants, folds, table.output, steps)


def _table(plain) -> ProgramTable:
    """The stored form back to a ``ProgramTable``: op names resolved through the allowlist."""
    n_nodes, n_inputs, n_ops, constants, folds, output, steps = plain
    targets: dict[str, object] = {}
    checks: dict[int, object] = {}

    def target(name):
        if name not in targets:
            targets[name] = value_checked(resolve_target(name), checks)
        return targets[name]

    folds = tuple(f if len(f) == 2 else (f[0], target(f[1]), f[2], f[3]) for f in folds)
    steps = tuple((target(name), *rest) for name, *rest in steps)
    return ProgramTable(n_nodes, n_inputs, n_ops, constants, folds, output, steps)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _ENUMS):
            return ("enum", str(obj).removeprefix("torch."))
        if isinstance(obj, torch.device):
            return ("device", str(obj))
        return None


class _Unpickler(pickle.Unpickler):
    """Plain data, ``Ref``s and slices; torch enums and devices by name; nothing else."""

    _CLASSES = {("spmd_aot.format.serialize", "Ref"): Ref, ("builtins", "slice"): slice}

    def find_class(self, module, name):
        found = self._CLASSES.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"a prepared-program record names {module}.{name}")
        return found

    def persistent_load(self, pid):
        kind, name = pid
        if kind == "enum" and type(name) is str:
            value = getattr(torch, name, None)
            if isinstance(value, _ENUMS):
                return value
        elif kind == "device" and type(name) is str:
            return torch.device(name)
        raise pickle.UnpicklingError(f"a prepared-program record holds {str(pid)[:80]}")

