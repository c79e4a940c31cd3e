"""The ``kernels`` blob's format, and its check as data: what ``verify``, ``show`` and a load read
before anything in it may run.

The blob (written by ``building/kernels.py``) is msgpack: the Inductor artifact, the libraries it
built by their path in Inductor's cache, the options they were built with, the compiler, and the
process-group names the kernels call collectives on. Decoding it runs nothing (no pickle); the
native code in it loads only from a signed entry or a trusted cache (``runtime/kernel_load.py``).
"""

from __future__ import annotations

import re

from ..errors import CorruptArtifactError
from .bounded import unpack as unpack_bounded

__all__ = ["KERNELS_FORMAT", "FILE_PATTERN", "group_name", "unpack", "describe"]

#: Version of the ``kernels`` blob's layout.
KERNELS_FORMAT = 1
#: A stored library's path inside Inductor's cache directory: two-letter folder, hashed name.
FILE_PATTERN = re.compile(r"^[a-z0-9]{2}/[a-z0-9]{20,64}(\.main)?\.so$")
_MAX_FILES = 4096


def group_name(dim: int) -> str:
    """The process-group name compiled into kernels for mesh dimension ``dim``."""
    return f"spmd_aot.kernels.d{dim}"


def unpack(data: bytes, where: str) -> dict:
    """A ``kernels`` blob's fields, every one typed and every library path plain (no '..', no
    absolute paths): ``CorruptArtifactError`` otherwise. Decodes msgpack only (no pickle)."""
    doc = unpack_bounded(data, where, objects=4 * _MAX_FILES + 64, max_array=_MAX_FILES, max_map=_MAX_FILES)

    def bad(why):
        raise CorruptArtifactError(f"{where}: kernels blob {why}; rebuild the entry with `spmd-aot build --kernels`")

    if not isinstance(doc, dict) or doc.get("format") != KERNELS_FORMAT:
        bad(f"has format {str(doc.get('format') if isinstance(doc, dict) else doc)[:20]!r}, not {KERNELS_FORMAT}")
    if not isinstance(doc.get("artifact"), bytes) or not isinstance(doc.get("files"), dict) \
            or not isinstance(doc.get("requested"), dict) or not isinstance(doc.get("cxx"), str):
        bad("lacks its artifact, files, requested options or compiler")
    groups = doc.get("groups")
    if not isinstance(groups, list) or groups != [group_name(d) for d in range(len(groups))]:
        bad(f"names groups {str(groups)[:80]}")
    for rel, content in doc["files"].items():
        if not (isinstance(rel, str) and FILE_PATTERN.match(rel) and isinstance(content, bytes)):
            bad(f"holds a file named {str(rel)[:80]!r}")
    return doc


def describe(data: bytes, where: str) -> dict:
    """What ``show`` prints about a kernels blob: sizes and what built it."""
    doc = unpack(data, where)
    return {"torch": doc["requested"].get("torch"), "cxx": doc["cxx"],
            "cpu_capability": doc["requested"].get("cpu_capability"),
            "options": doc["requested"].get("options"), "libraries": len(doc["files"]),
            "bytes": len(data)}
