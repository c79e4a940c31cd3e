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
    devices: what ``encode`` stores)."""
    folds = tuple(f if len(f) == 2 else (f[0], _target_name(f[1]), *f[2:]) for f in table.folds)
    steps = tuple((_target_name(t), *rest) for t, *rest in table.steps)
    return (table.n_nodes, table.n_inputs, table.n_ops, table.constants, folds, table.output, steps, table.inputs)


def table_from_stored(plain) -> ProgramTable:
    """The stored form back to a ``ProgramTable``: op names resolved through the allowlist."""
    n_nodes, n_inputs, n_ops, constants, folds, output, steps, inputs = plain
    targets: dict[str, object] = {}
    checks: dict[int, object] = {}

    def target(name):
        if name not in targets:
            targets[name] = value_checked(resolve_target(name), checks)
        return targets[name]

    folds = tuple(f if len(f) == 2 else (f[0], target(f[1]), *f[2:]) for f in folds)
    steps = tuple((target(name), *rest) for name, *rest in steps)
    return ProgramTable(n_nodes, n_inputs, n_ops, constants, folds, output, steps, inputs)
