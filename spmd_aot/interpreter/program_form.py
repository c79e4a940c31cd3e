"""The stored form of a ``ProgramTable`` (ops by name, everything else plain data), and the
identity of the code that builds programs and that form.

Shared by the per-user prepared records (``prepared.py``) and the signed ``program`` part of an
entry (``entries/program_blob.py``): one form, one rule for which code may have written it.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import pathlib

from ..format import records
from ..format.contracts import op_name
from ..format.serialize import resolve_target
from .program import ProgramTable, value_checked

__all__ = ["builder_code", "stored_form", "table_from_stored"]

_BUILDER_FILES = ("interpreter/program.py", "interpreter/constant_fold.py", "runtime/prepared.py",
                  "interpreter/program_form.py", "interpreter/invariants.py", "format/records.py")
_GETITEM = "operator.getitem"


@functools.lru_cache(maxsize=1)
def builder_code() -> str:
    """The identity of the code that builds and stores programs (a table from other code is not read)."""
    here = pathlib.Path(__file__).parent.parent
    h = hashlib.sha256()
    for name in _BUILDER_FILES:
        h.update(b"\0" + name.encode() + b"\0" + (here / name).read_bytes())
    return h.hexdigest()


def _target_name(target) -> str:
    if target is operator.getitem:
        return _GETITEM
    return op_name(getattr(target, "overload", target))  # a value-checked op: the op it wraps


def stored_form(table: ProgramTable) -> tuple:
    """``table`` with ops named (everything else is plain data, ``Ref``s, slices, torch enums,
    devices: what ``records.encode`` stores), as ``(n_nodes, n_inputs, n_ops, constants, folds,
    output, steps, inputs, expects)``: every expected metadata (``invariants.describe``) is a
    position in ``expects``, which holds each distinct one once (a 12-layer step's ~4k values
    have ~100), and a step without keyword arguments stores None for them: each stored map costs
    a Python call to decode, and these were most of them."""
    described: list = []

    def at(expect):  # a placeholder position, made final once every expectation is known
        if expect is None:
            return None
        described.append(expect)
        return len(described) - 1

    folds = tuple(f if len(f) == 2 else (f[0], _target_name(f[1]), f[2], f[3] or None, at(f[4]))
                  for f in table.folds)
    steps = tuple((_target_name(t), i, args, kwargs or None, tuple((item, k, at(e)) for item, k, e in unpack),
                   frees, at(expect))
                  for t, i, args, kwargs, unpack, frees, expect in table.steps)
    inputs = tuple(at(e) for e in table.inputs)
    expects, ids = records.interned(described)

    def final(k):
        return None if k is None else ids[k]

    folds = tuple(f if len(f) == 2 else (*f[:4], final(f[4])) for f in folds)
    steps = tuple((name, i, args, kwargs, tuple((item, k, final(e)) for item, k, e in unpack) if unpack else (),
                   frees, final(e))
                  for name, i, args, kwargs, unpack, frees, e in steps)
    return (table.n_nodes, table.n_inputs, table.n_ops, table.constants, folds, table.output, steps,
            tuple(final(k) for k in inputs), expects)


def table_from_stored(plain) -> ProgramTable:
    """The stored form back to a ``ProgramTable``: op names resolved through the allowlist,
    expectations looked up by position (``IndexError``/``TypeError`` for a position outside
    ``expects``: the caller's checks, ``program_blob._check_structure``, name it first)."""
    n_nodes, n_inputs, n_ops, constants, folds, output, steps, inputs, expects = plain
    targets: dict[str, object] = {}
    checks: dict[int, object] = {}

    def target(name):
        t = targets.get(name)
        if t is None:
            t = targets[name] = value_checked(resolve_target(name), checks)
        return t

    def expect(k):
        return None if k is None else expects[k]

    folds = tuple(f if len(f) == 2 else (f[0], target(f[1]), f[2], f[3] if f[3] is not None else {}, expect(f[4]))
                  for f in folds)
    steps = tuple((target(name), i, args, kwargs if kwargs is not None else {},
                   tuple([(item, k, None if e is None else expects[e]) for item, k, e in unpack]) if unpack else (),
                   frees, None if e is None else expects[e])
                  for name, i, args, kwargs, unpack, frees, e in steps)
    return ProgramTable(n_nodes, n_inputs, n_ops, constants, folds, output, steps, tuple(map(expect, inputs)))
