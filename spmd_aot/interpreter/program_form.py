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

import torch

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
    a Python call to decode, and these were most of them. Positions are given in one pass, in
    the order ``records.interned`` would give them (folds, then steps, then inputs)."""
    expects: list = []
    seen: dict = {}
    dtype = torch.dtype

    def at(expect):  # records.interned, one value at a time
        if expect is None:
            return None
        if type(expect) is tuple and len(expect) == 3 and type(expect[2]) is dtype:
            k = seen.get(expect)
            if k is None:
                k = seen[expect] = len(expects)
                expects.append(expect)
            return k
        expects.append(expect)
        return len(expects) - 1

    names: dict[int, str] = {}  # id(target) -> its stored name (the table holds every target)

    def named(target):
        name = names.get(id(target))
        if name is None:
            name = names[id(target)] = _target_name(target)
        return name

    folds = tuple(f if len(f) == 2 else (f[0], named(f[1]), f[2], f[3] or None, at(f[4])) for f in table.folds)
    steps = []
    for t, i, args, kwargs, unpack, frees, expect in table.steps:
        items = tuple([(item, k, at(e)) for item, k, e in unpack]) if unpack else ()
        steps.append((named(t), i, args, kwargs or None, items, frees, at(expect)))
    inputs = tuple([at(e) for e in table.inputs])
    return (table.n_nodes, table.n_inputs, table.n_ops, table.constants, folds, table.output, tuple(steps),
            inputs, tuple(expects))


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
