"""The checked program of a signed entry, stored as data beside its graph (the ``program`` part).

Why: a job's first load of an artifact on a node decodes the graph against the allowlist and
runs the meta check (``validate.check_graph``, which imports ``torch._dynamo``: 1-2 s once per
process) to derive what the program's run-time invariants compare with. The per-user records
(``verified.py``, ``runtime/prepared.py``) spare later loads on the same node, but every node of
a cluster job starts with empty per-user state, so every job start paid the first load. A
builder runs the very same checks before it stores an entry (``building/load_check.py``); with
a signing key set it also stores their result, the built ``ProgramTable`` with the meta check's
expected metadata of every value, as this blob, named by sha256 in the manifest the signature
covers. A job that verified that signature (``SPMD_AOT_SIGNING_KEY`` set: unsigned or badly
signed manifests are refused before anything is decoded) builds its program from the blob
(``Program.from_table``): no graph decode, no meta check, no dynamo import.

Trust: exactly what signing already grants. The key holder vouches for every part (the graph
too: a signed graph is trusted to be what its builder traced); this part adds the builder's own
check results to what it vouches for. Without a key at load the blob is never read: an unsigned
entry is checked in full whatever it holds, so a forged ``program`` part in a writable cache is
ignored. What stays on a signed load: every blob re-hashed; the manifest, layout and output spec
validated; ops resolved by name through the allowlist in force (opt-ins included); the layout
compared with the live job and the guards checked (``runtime/step.py``); the run-time
invariants (the table carries the expected metadata); and the cheap structural checks below.

Format: ``MAGIC`` then the body, tagged plain data in the per-user records' format
(``records.py``: msgpack read by the bounded decoder, nothing unpickled or imported), a map::

    {"builder": <identity of the code that builds tables>, "torch": <torch release>,
     "mesh_dims": <n>, "device_type": "cpu"|"cuda"|..., "bind": [["s"|"f", k], ...],
     "table": <program_form.stored_form of the ProgramTable>}

The table is device- and group-independent: the graph is decoded at build with placeholder
group names (``GROUP_PREFIX`` + mesh dimension, ``WORLD``) and the device type without an index,
and ``bind`` lists the steps (``"s"``) and folds (``"f"``) whose arguments hold either; a load
replaces those placeholders with the live groups' names and the device with the live one, as
``serialize.decode_graph`` binds them. A blob of other builder code or another torch release is
ignored (the load checks in full). Nothing here imports ``validate``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..format import records
from ..errors import CorruptArtifactError
from ..format.serialize import Ref

__all__ = ["MAGIC", "GROUP_PREFIX", "WORLD", "PART", "encode", "program", "check"]

log = logging.getLogger(__name__)

PART = "program"
MAGIC = b"spmd-aot program 2\n"
#: Placeholder group names in a stored table (a NUL byte: no process group is named so).
GROUP_PREFIX = "\0spmd-aot mesh dim "
WORLD = "\0spmd-aot world group"


def _placeholders(mesh_dims: int) -> list[str]:
    return [f"{GROUP_PREFIX}{d}" for d in range(mesh_dims)]


def _identity() -> str:
    from ..interpreter.program_form import builder_code

    return builder_code()


def _holds_binding(value: Any) -> bool:
    """Whether a step's argument holds a placeholder group or a device."""
    kind = type(value)
    if kind is str:
        return value.startswith("\0spmd-aot ")
    if kind is torch.device:
        return True
    if kind in (tuple, list):
        return any(_holds_binding(v) for v in value)
    if kind is dict:
        return any(_holds_binding(v) for v in value.values())
    return False


def encode(artifact) -> bytes | None:
    """The ``program`` part of ``artifact`` (an entry in memory that passed ``check_entry``): its
    graph decoded with placeholder groups and meta-checked (``Artifact._check``: the check every
    load runs), the program built, its table stored. None when the table holds a constant argument the records'
    format has no form for (the entry is then stored without the part: every load checks it)."""
    from ..interpreter.program_form import stored_form
    from ..interpreter.program import Program

    plan = artifact.plan
    dims = len(plan.mesh_shape) if plan.world_size > 1 else 0
    device = torch.device(plan.device_type)
    nodes, expected = artifact._check(_placeholders(dims), device, remember=False, world=WORLD if dims else None)
    table = Program(nodes, artifact.constants, expected=expected).table
    plain = stored_form(table)
    folds, steps = plain[4], plain[6]
    bind = [("f", k) for k, f in enumerate(folds) if len(f) > 2 and _holds_binding((f[2], f[3]))]
    bind += [("s", k) for k, s in enumerate(steps) if _holds_binding((s[2], s[3]))]
    try:
        body = records.encode({"builder": _identity(), "torch": str(torch.__version__), "mesh_dims": dims,
                               "device_type": device.type, "bind": bind, "table": plain})
    except TypeError as exc:
        log.warning("artifact %s: its checked program is not stored (%s); loads check the graph in full",
                    artifact.digest[:12], exc)
        return None
    return MAGIC + body


def check(artifact) -> None:
    """``spmd-aot verify``'s check of a signed entry's part: it must be exactly what this code
    builds from the entry's graph (``CorruptArtifactError`` otherwise). A part of other builder
    code or another torch release is not compared: a load ignores it too."""
    data = artifact.program_blob
    if data is None or not data.startswith(MAGIC):
        if data is not None:
            raise CorruptArtifactError(f"program part of artifact {artifact.digest[:12]} does not start with {MAGIC!r}")
        return
    doc = records.decode(data[len(MAGIC):], f"program part of artifact {artifact.digest[:12]}")
    if type(doc) is dict and (doc.get("builder"), doc.get("torch")) != (_identity(), str(torch.__version__)):
        return
    if encode(artifact) != data:
        raise CorruptArtifactError(
            f"artifact {artifact.digest[:12]}: its signed program part is not the program its graph gives "
            "(a builder bug or a misused key); remove the entry and build it again")


def program(artifact, groups: list[str], device: torch.device):
    """The ``Program`` of a signed ``artifact`` built from its ``program`` part, bound to the live
    ``groups`` and ``device``; None when the part is of other code or does not fit (the caller
    then decodes and checks the graph in full)."""
    from ..interpreter.program import Program

    data = artifact.program_blob
    if data is None:
        return None
    try:
        table = _table(data, artifact, groups, device)
    except _Other as exc:
        log.info("artifact %s: its program part %s; checking the graph in full", artifact.digest[:12], exc)
        return None
    return Program.from_table(table, artifact.constants_on(device))


class _Other(Exception):
    """A part this code does not read (another builder, torch release or device type)."""


def _table(data: bytes, artifact, groups: list[str], device: torch.device):
    from ..interpreter.program_form import table_from_stored

    where = f"program part of artifact {artifact.digest[:12]}"
    if not data.startswith(MAGIC):
        raise CorruptArtifactError(f"{where} does not start with {MAGIC!r}")
    doc = records.decode(data[len(MAGIC):], where)
    if type(doc) is not dict or set(doc) != {"builder", "torch", "mesh_dims", "device_type", "bind", "table"}:
        raise CorruptArtifactError(f"{where} is not a map of the fields cache/README.md lists")
    if doc["builder"] != _identity() or doc["torch"] != str(torch.__version__):
        raise _Other("was built by other spmd-aot code or another torch release")
    if doc["device_type"] != device.type:
        raise _Other(f"is for {doc['device_type']!r}, this job runs on {device.type!r}")
    if doc["mesh_dims"] != len(groups):
        raise CorruptArtifactError(f"{where} is for {doc['mesh_dims']} mesh dimensions, the job has {len(groups)}")
    plain = doc["table"]
    if type(plain) is not tuple or len(plain) != 9:
        raise CorruptArtifactError(f"{where}: the table is not the 9 fields of a stored ProgramTable")
    _check_structure(plain, artifact, where)
    if groups:
        import torch.distributed as dist

        live = dict(zip(_placeholders(len(groups)), groups))
        live[WORLD] = dist.group.WORLD.group_name if dist.is_initialized() else groups[0]
    else:
        live = {}
    n_nodes, n_inputs, n_ops, constants, folds, output, steps, inputs, expects = plain
    folds, steps = list(folds), list(steps)
    for entry in doc["bind"]:
        if type(entry) is not tuple or len(entry) != 2 or entry[0] not in ("s", "f") or type(entry[1]) is not int:
            raise CorruptArtifactError(f"{where}: bind entry {str(entry)[:60]} is malformed")
        seq = steps if entry[0] == "s" else folds
        k = entry[1]
        if not 0 <= k < len(seq) or len(seq[k]) < 4:
            raise CorruptArtifactError(f"{where}: bind entry {entry} names no call")
        item = seq[k]
        seq[k] = (*item[:2], _bound(item[2], live, device, where), _bound(item[3], live, device, where), *item[4:])
    return table_from_stored((n_nodes, n_inputs, n_ops, constants, tuple(folds), output, tuple(steps), inputs,
                              expects))


def _bound(value: Any, live: dict[str, str], device: torch.device, where: str) -> Any:
    """``value`` with placeholder groups replaced by the live groups' names and devices of this
    job's device type by its device (as ``serialize.decode_graph`` binds ``~device``)."""
    kind = type(value)
    if kind is str and value.startswith("\0spmd-aot "):
        if value not in live:
            raise CorruptArtifactError(f"{where} names process group {value[1:]!r}, which the live mesh lacks")
        return live[value]
    if kind is torch.device:
        return device if value.type == device.type else value
    if kind in (tuple, list):
        return kind(_bound(v, live, device, where) for v in value)
    if kind is dict:
        return {k: _bound(v, live, device, where) for k, v in value.items()}
    return value


def _check_structure(plain: tuple, artifact, where: str) -> None:
    """The cheap structural checks: counts within the load limits and the layout, every index a
    step writes or frees inside the value table, every constant stored, every expectation a
    position in the table of expectations."""
    from ..format.limits import load_limits

    n_nodes, n_inputs, n_ops, constants, folds, output, steps, inputs, expects = plain

    def bad(why):
        raise CorruptArtifactError(f"{where}: {why}")

    if not all(type(x) is int for x in (n_nodes, n_inputs, n_ops)) or not 0 <= n_inputs <= n_nodes:
        bad("node counts are not integers in range")
    if n_nodes > load_limits().nodes:
        bad(f"{n_nodes} nodes, more than the load limit of {load_limits().nodes}")
    if n_inputs != len(artifact.slots):
        bad(f"{n_inputs} inputs where the layout lists {len(artifact.slots)}")
    if type(inputs) is not tuple or len(inputs) not in (0, n_inputs):
        bad("the inputs' expected metadata does not match the input count")
    if type(expects) is not tuple:
        bad("the expectations are not a table")
    n_expects = len(expects)

    def expectation(k):
        if k is not None and (type(k) is not int or not 0 <= k < n_expects):
            bad(f"expectation {str(k)[:20]} outside the table of {n_expects}")

    for k in inputs:
        expectation(k)

    def index(i):
        if type(i) is not int or not 0 <= i < n_nodes:
            bad(f"value index {str(i)[:20]} outside the program's {n_nodes} values")

    for c in constants:
        if type(c) is not tuple or len(c) != 2 or c[1] not in artifact.constants:
            bad(f"constant {str(c)[:60]} is not stored")
        index(c[0])
    for f in folds:
        if type(f) is not tuple or len(f) not in (2, 5):
            bad("a fold is malformed")
        index(f[0])
        if len(f) == 5:
            expectation(f[4])
    for s in steps:
        if type(s) is not tuple or len(s) != 7 or type(s[4]) is not tuple or type(s[5]) is not tuple:
            bad("a step is malformed")
        index(s[1])
        expectation(s[6])
        for u in s[4]:
            if type(u) is not tuple or len(u) != 3:
                bad("an unpacked item is malformed")
            index(u[0])
            expectation(u[2])
        for f in s[5]:
            index(f)
    if not all(type(r) is Ref and r.index < n_nodes for r in _refs(output)):
        bad("the output reads a value outside the program")


def _refs(value: Any):
    if type(value) is Ref:
        yield value
    elif type(value) in (tuple, list):
        for v in value:
            yield from _refs(v)
    elif type(value) is dict:
        for v in value.values():
            yield from _refs(v)
