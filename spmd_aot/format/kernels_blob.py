"""The ``kernels`` blob's format, and its check as data: what ``verify``, ``show`` and a load read
before anything in it may run.

The blob (written by ``building/kernels.py``) is msgpack: the native libraries (each a segment of
the step, compiled by Inductor's C++ wrapper into a Python extension module whose init is
``PyInit_<ENTRY>``, with its number of inputs and outputs), the calls that run the step, the options
it was built with, the compiler, and the process-group names it calls collectives on.

The calls are data: ``[library, [reference, ...]]`` each, where a reference numbers a value: the
step's inputs first, then the stored constants the blob names (``constants``: names in the entry's
constants blob), then every output of every call in order; ``outputs`` references the step's
results. A repeated block is one library called once per block. ``check`` proves every reference
names a value defined before it is read and every call passes its library's number of inputs, so
running the calls is bounded, in-range work. Decoding runs nothing (no pickle); the libraries load
only from a signed entry or a trusted cache (``runtime/kernel_load.py``).

Format 1 held Inductor's saved artifact (pickles), format 2 one library for the whole step; a
blob of another format is refused here (``verify``) and skipped at load (the step runs interpreted).
"""

from __future__ import annotations

import torch

from ..errors import CorruptArtifactError
from .bounded import unpack as unpack_bounded

__all__ = ["KERNELS_FORMAT", "ENTRY", "OPTIONS", "INDUCTOR_SETTINGS", "WORLD_GROUP", "ingredient", "group_name",
           "decode", "check", "unpack", "describe"]

#: Version of the ``kernels`` blob's layout.
KERNELS_FORMAT = 3
#: The library's module name: its init is ``PyInit_<ENTRY>``, its one function ``<ENTRY>``.
ENTRY = "inductor_entry_cpp"
_MAX_SLOTS = 1 << 20
#: Most calls, and most references in all calls together, a blob may hold.
_MAX_CALLS = 1 << 16
_MAX_REFERENCES = 1 << 22
#: Decode limits: those of format 1 (up to 4096 libraries), so that an older blob still decodes
#: and is skipped by its ``format`` rather than refused as corrupt.
_MAX_ITEMS = 4096

#: Inductor options the build passes (part of the key: other options, other kernels).
OPTIONS: dict = {}
#: Inductor settings of the build (in the key: other settings, other library). ``cpp_wrapper``: each
#: segment of the step as one C++ library (see the module doc). A precompiled header: the build
#: compiles several libraries (one per distinct segment), and parsing torch's headers once, not
#: once per library, cut a 6-layer LM's compile from 39 to 33 s. ``sink_waits``: each
#: collective's wait as late as its first reader (Inductor's default waits right after the issue,
#: so a gradient bucket's all-reduce would not overlap the rest of the backward, as the
#: interpreted graph's own ``passes/schedule.py`` makes it do).
INDUCTOR_SETTINGS = {"cpp_cache_precompile_headers": True, "cpp_wrapper": True,
                     "reorder_for_compute_comm_overlap": True,
                     "reorder_for_compute_comm_overlap_passes": ["sink_waits"]}


def ingredient(device_type: str) -> dict:
    """The key ingredient ``kernels``: what decides whether stored kernels run in this process.

    Inductor's release is torch's full version (its ``+cpu`` / ``+cu130`` suffix too: the two
    builds generate different code); the options; for CPU targets the CPU capability, which picks
    the vector ISA the C++ kernels are built for (a job on another ISA would need a compiler to
    rebuild them). The C++ compiler that built the libraries is recorded in the blob (``show``),
    not keyed: a job never needs one."""
    value = {"format": KERNELS_FORMAT, "torch": torch.__version__, "options": dict(sorted(OPTIONS.items())),
             "settings": dict(sorted(INDUCTOR_SETTINGS.items()))}
    if device_type == "cpu":
        value["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return value


def group_name(dim: int) -> str:
    """The process-group name compiled into kernels for mesh dimension ``dim``."""
    return f"spmd_aot.kernels.d{dim}"


#: The process-group name compiled into kernels for the world group (every rank) on a mesh of
#: several dimensions: a gradient averaged over every data-parallel dimension at once, a loss
#: or norm reduced over all ranks. On a 1-D mesh the world is dimension 0 and is compiled as that.
WORLD_GROUP = "spmd_aot.kernels.world"


def decode(data: bytes, where: str) -> dict:
    """The blob's top-level map, decoded as bounded msgpack and not yet checked (a load reads its
    ``format`` first: an older blob is skipped, not misread)."""
    doc = unpack_bounded(data, where, objects=_MAX_REFERENCES + 4 * _MAX_ITEMS + 64, max_array=_MAX_SLOTS,
                         max_map=_MAX_ITEMS)
    if not isinstance(doc, dict):
        raise CorruptArtifactError(f"{where}: kernels blob is not a map; rebuild the entry with "
                                   "`spmd-aot build --kernels`")
    return doc


def check(doc: dict, where: str) -> dict:
    """``doc`` when every field is present and typed: ``CorruptArtifactError`` otherwise."""
    def bad(why):
        raise CorruptArtifactError(f"{where}: kernels blob {why}; rebuild the entry with `spmd-aot build --kernels`")

    if doc.get("format") != KERNELS_FORMAT:
        bad(f"has format {str(doc.get('format'))[:20]!r}, this spmd_aot reads {KERNELS_FORMAT}")
    if not isinstance(doc.get("requested"), dict) or not isinstance(doc.get("cxx"), str):
        bad("lacks its requested options or compiler")
    if doc.get("entry") != ENTRY:
        bad(f"names entry {str(doc.get('entry'))[:40]!r}, not {ENTRY!r}")
    count = doc.get("inputs")
    if type(count) is not int or not 0 <= count <= _MAX_SLOTS:
        bad(f"has inputs {str(count)[:20]!r}")
    libraries = doc.get("libraries")
    if not isinstance(libraries, list) or not libraries:
        bad("lacks its libraries")
    for library in libraries:
        if not isinstance(library, dict) or not isinstance(library.get("library"), bytes) or not library["library"] \
                or any(type(library.get(f)) is not int or not 0 <= library[f] <= _MAX_SLOTS
                       for f in ("inputs", "outputs")):
            bad("has a library without its code or its numbers of inputs and outputs")
        strides, written = library.get("strides"), library.get("written")
        if not isinstance(strides, list) or len(strides) != library["inputs"] \
                or not all(isinstance(st, list) and len(st) <= 64 and all(type(x) is int and 0 <= x < 1 << 62 for x in st)
                           for st in strides) \
                or not isinstance(written, list) or len(written) > library["inputs"] \
                or not all(type(i) is int and 0 <= i < library["inputs"] for i in written):
            bad("has a library without each input's strides or with written inputs out of range")
    _check_calls(doc, libraries, bad)
    groups = doc.get("groups")
    if not isinstance(groups, list) or groups != [group_name(d) for d in range(len(groups))]:
        bad(f"names groups {str(groups)[:80]}")
    world = doc.get("world")  # absent in blobs of 1-D meshes, which compile the world as dimension 0
    if world is not None and (world != WORLD_GROUP or len(groups) < 2):
        bad(f"names world group {str(world)[:80]} for {len(groups)} mesh dimensions")
    return doc


def _check_calls(doc: dict, libraries: list, bad) -> None:
    """Every call names a library and passes it that library's number of values, each defined before."""
    calls, outputs = doc.get("calls"), doc.get("outputs")
    if not isinstance(calls, list) or not 0 < len(calls) <= _MAX_CALLS or not isinstance(outputs, list):
        bad("lacks its calls or outputs")
    constants = doc.get("constants")
    if not isinstance(constants, list) or len(constants) > _MAX_ITEMS \
            or not all(isinstance(c, str) and 0 < len(c) <= 200 for c in constants):
        bad("names its constants wrongly")
    defined, references = doc["inputs"] + len(constants), 0
    for call in calls:
        if not isinstance(call, list) or len(call) != 2 or type(call[0]) is not int \
                or not 0 <= call[0] < len(libraries) or not isinstance(call[1], list):
            bad("has a call that names no library")
        library = libraries[call[0]]
        references += len(call[1])
        if len(call[1]) != library["inputs"] or references > _MAX_REFERENCES \
                or any(type(r) is not int or not 0 <= r < defined for r in call[1]):
            bad(f"has a call of library {call[0]} with inputs that are not its {library['inputs']} defined values")
        defined += library["outputs"]
    if any(type(r) is not int or not 0 <= r < defined for r in outputs):
        bad("returns a value no call defines")


def unpack(data: bytes, where: str) -> dict:
    """A ``kernels`` blob's fields, every one typed (``decode`` then ``check``)."""
    return check(decode(data, where), where)


def describe(data: bytes, where: str) -> dict:
    """What ``show`` prints about a kernels blob: sizes and what built it."""
    doc = unpack(data, where)
    return {"torch": doc["requested"].get("torch"), "cxx": doc["cxx"],
            "cpu_capability": doc["requested"].get("cpu_capability"),
            "options": doc["requested"].get("options"), "libraries": len(doc["libraries"]),
            "calls": len(doc["calls"]), "library_bytes": sum(len(lib["library"]) for lib in doc["libraries"]),
            "inputs": doc["inputs"], "outputs": len(doc["outputs"]), "bytes": len(data)}
