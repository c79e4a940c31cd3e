"""Decode stored msgpack and JSON within limits fixed before anything is allocated.

Stored documents come from whoever can write the cache. A size check on the blob alone bounds
little: an empty container is one stored byte and ~70 bytes decoded, so 32 MiB of ``0x90``
bytes decode to 2.4 GiB of lists. So every decode here

* sets msgpack's length limits up front (buffer, strings, binaries, arrays, maps; ext types
  refused), each no larger than the document format needs; and
* counts the containers it builds and the elements they hold, and stops (raising
  ``CorruptArtifactError``) as soon as that count passes ``objects``: the memory a document
  can cost is then bounded by its limits, not by its bytes.

Counting costs a Python call per container. Every msgpack object takes at least one byte and
is counted at most twice (as an element of its container and as a container itself), so a
document of ``n`` bytes decodes to at most ``2 n`` counted objects: when ``2 n <= objects`` the
count can never pass the limit, and it is skipped (same bound, no hook).

Only msgpack's native types come out (nil, bool, int, float, str, bytes, lists, maps with str
keys); nothing is imported or constructed from type names. Nothing here imports torch.
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Callable

import msgpack

from ..errors import CorruptArtifactError

__all__ = ["unpack", "unpacker", "load_json"]


def _counter(objects: int, what: str) -> Callable:
    """A list/map hook that charges each container 1 + its length against ``objects``."""
    left = objects

    def charge(obj):
        nonlocal left
        left -= len(obj) + 1
        if left < 0:
            raise CorruptArtifactError(
                f"{what} decodes to more than {objects} objects (containers and their elements), "
                "more than the load limit allows; if the artifact is yours, raise it with "
                "SPMD_AOT_LOAD_LIMITS=objects=...")
        return obj

    return charge


def _never_over(size: int, objects: int) -> bool:
    """Whether ``size`` bytes can never decode to more than ``objects`` counted objects (module doc)."""
    return 2 * size <= objects


def unpacker(data: bytes, what: str, *, objects: int, max_array: int, max_map: int,
             max_str: int | None = None, use_list: bool = True,
             object_hook: Callable | None = None) -> msgpack.Unpacker:
    """A streaming msgpack reader over ``data`` within these limits (see the module doc).
    ``use_list=False`` decodes arrays as tuples; ``object_hook`` (called on every map, after
    the count) lets a format with tagged maps rebuild its values as they are decoded."""
    size = max(len(data), 1)
    charge = None if _never_over(len(data), objects) else _counter(objects, what)
    hooks = dict(list_hook=charge, object_hook=charge) if charge else {}  # one budget for both
    if object_hook is not None:
        hooks["object_hook"] = object_hook if charge is None else (lambda obj: object_hook(charge(obj)))
    reader = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=use_list, max_buffer_size=size,
                              max_str_len=min(max_str or size, size), max_bin_len=size,
                              max_array_len=min(max_array, size), max_map_len=min(max_map, size),
                              max_ext_len=0, **hooks)
    reader.feed(data)
    return reader


def unpack(data: bytes, what: str, *, objects: int, max_array: int = 1 << 20, max_map: int = 1 << 20,
           max_str: int | None = None, use_list: bool = True, object_hook: Callable | None = None) -> Any:
    """The one msgpack document ``data`` holds, decoded within these limits; trailing bytes,
    ext types, anything over a limit and any error of ``object_hook`` are ``CorruptArtifactError``."""
    try:
        reader = unpacker(data, what, objects=objects, max_array=max_array, max_map=max_map, max_str=max_str,
                          use_list=use_list, object_hook=object_hook)
        value = reader.unpack()
        if reader.tell() != len(data):
            raise CorruptArtifactError(f"{what} has {len(data) - reader.tell()} bytes after its document")
        return value
    except CorruptArtifactError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage and for exceeded limits
        raise CorruptArtifactError(f"{what} is not valid msgpack within the load limits: "
                                   f"{type(exc).__name__}: {str(exc)[:200]}") from None


def load_json(raw: bytes, what: str, *, max_bytes: int, objects: int) -> Any:
    """JSON ``raw`` of maps and scalars only (the bundle index), decoded within ``max_bytes``
    and ``objects`` (maps and their entries). Any ``[`` is refused before parsing: ``json`` has
    no hook to count lists, and no string of that format holds one."""
    if len(raw) > max_bytes:
        raise CorruptArtifactError(f"{what} is {len(raw)} bytes, more than the {max_bytes} allowed")
    if b"[" in raw:
        raise CorruptArtifactError(f"{what} holds an array, which its format never has")
    count = _counter(objects, what)
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=lambda pairs: count(dict(pairs)))
    except CorruptArtifactError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptArtifactError(f"{what} is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
