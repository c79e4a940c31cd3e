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
``$XDG_STATE_HOME/spmd_aot/prepared``, never in a cache, reached only through
``verified.private_dir`` (a walk from ``/`` that follows no link and checks every component's
owner and mode on its open descriptor) and opened, written, renamed and removed relative to
that descriptor. Whoever can write a cache can
neither write a record nor choose its content (it is what our decoder made of the digest-pinned
bytes); a record's name hashes the ``verified`` identity (manifest digest, checker code, torch
release, load limits, opted-in ops) together with the code that builds programs, the Python
release, the live groups and the device, so any change there finds no record. On top of that:

* a record carries the sha256 of its content, checked before it is read: a torn or corrupted
  file is ignored (and removed), and the load decodes as if there were none;
* it is tagged plain data (``format/records.py``): msgpack read by the bounded decoder, with
  ``Ref``s, slices, tuples, torch's dtypes, memory formats, layouts and devices as tagged maps
  rebuilt by name from fixed tables; nothing is unpickled or imported. Ops are stored by name and resolved
  through the allowlist again (``resolve_target``), so the
  allowlist in force still applies;
* it keeps the meta check's expected shape, strides and dtype of every value the program checks
  at run time (``invariants.py``), so a rebuilt program checks exactly what a decoded one does;
* at most ``MAX_RECORDS`` records are kept (the least recently written go first).

Anything unexpected reading a record is a miss of the record, never an error of the load.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
import sys

import torch

from ..entries import verified
from ..format import records
from ..interpreter.program import Program, ProgramTable
from ..interpreter.program_form import builder_code, stored_form, table_from_stored

__all__ = ["program_for", "load", "save", "record_dir", "MAX_RECORDS"]

log = logging.getLogger(__name__)

MAX_RECORDS = 64
_MAGIC = b"spmd-aot prepared 3\n"
_MAX_BYTES = 256 << 20  # as much as a graph blob may be (LoadLimits.graph_bytes)


def record_dir() -> pathlib.Path:
    return verified.record_dir().parent / "prepared"


def program_for(artifact, groups: list[str], device: torch.device):
    """The ``Program`` of a loaded ``artifact``: built from its signed ``program`` part when the
    manifest's signature was verified (``entries/program_blob.py``: the builder's checked
    program, so a fresh node skips the load check too), else rebuilt from its record when there
    is one, otherwise decoded, checked and built (``Artifact.program``), and its table kept."""
    if artifact.program_blob is not None:
        from ..entries import program_blob

        program = program_blob.program(artifact, groups, device)
        if program is not None:
            log.debug("artifact %s: program built from its signed program part", artifact.digest[:12])
            return program
    table = load(artifact.digest, groups, device)
    if table is not None:
        try:
            program = Program.from_table(table, artifact.constants_on(device))
            log.debug("artifact %s: program rebuilt from its prepared record", artifact.digest[:12])
            return program
        except Exception as exc:  # a record that does not fit its artifact: decode, as without one
            log.info("prepared-program record of %s not usable (%s: %s); decoding the graph",
                     artifact.digest[:12], type(exc).__name__, str(exc)[:200])
            with verified.private_dir(record_dir()) as folder:
                records.remove(folder, _name(artifact.digest, groups, device))
    program = artifact.program(groups, device)
    save(artifact.digest, groups, device, program.table)
    log.debug("artifact %s: graph decoded; its program kept for later loads", artifact.digest[:12])
    return program


def load(digest: str, groups: list[str], device: torch.device) -> ProgramTable | None:
    """The table kept for artifact ``digest`` bound to ``groups`` and ``device``, or None."""
    name = _name(digest, groups, device)
    with verified.private_dir(record_dir()) as folder:
        if folder is None:
            return None
        try:
            body = records.read(folder, name, _MAGIC, _MAX_BYTES)
            return None if body is None else table_from_stored(records.decode(body, "prepared-program record"))
        except Exception as exc:  # a record is an optimization: any doubt, and the load decodes
            log.info("prepared-program record %s ignored (%s: %s); decoding the graph", name,
                     type(exc).__name__, str(exc)[:200])
            records.remove(folder, name)
            return None


def save(digest: str, groups: list[str], device: torch.device, table: ProgramTable) -> None:
    """Keep ``table`` for later loads (best effort, as ``verified.remember``)."""
    try:
        body = records.encode(stored_form(table))
        if len(body) > _MAX_BYTES:
            return
        with verified.private_dir(record_dir(), create=True) as folder:
            if folder is not None:
                records.write(folder, _name(digest, groups, device), _MAGIC, body)
                records.trim(folder, MAX_RECORDS)
    except Exception as exc:  # a read-only home, a full disk, a constant argument of no stored kind
        log.info("prepared program not kept (%s: %s)", type(exc).__name__, str(exc)[:200])


def _name(digest: str, groups: list[str], device: torch.device) -> str:
    ident = (f"{verified.entry_name(digest)}\0{builder_code()}\0{sys.version}\0"
             f"{list(groups)!r}\0{device}")
    return hashlib.sha256(ident.encode()).hexdigest()
