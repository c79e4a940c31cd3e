"""The file format of the per-user records (``verified.py``, ``runtime/prepared.py``).

A record is ``magic line + sha256(body) + body``, where the body is msgpack of tagged plain
data: msgpack's own types for None, bools, ints, floats, strings and tuples (arrays), and a map
with one key for everything else (``{"r": 3}`` a ``Ref``, ``{"L": [...]}`` a list,
``{"k": [[key, value], ...]}`` a dict, ``{"s": [start, stop, step]}`` a slice, ``{"d":
"float32"}`` a dtype, ``{"m": ...}`` a memory format, ``{"l": ...}`` a layout, ``{"v": "cpu"}``
a device; ``{"T": [3, 4]}`` and ``{"R": [3, 4]}`` a tuple and a list of ``Ref``s, the commonest
arguments, in one map instead of one per reference). Reading rebuilds those by name from fixed tables as the
bounded decoder meets them
(``bounded.py``: limits set before anything is allocated, no ext types; its map hook, so no
second pass in Python): nothing is unpickled, imported or called by a name the file holds.
The decoder calls Python once per map, so a format that holds many repeated descriptions of
tensors (``(shape, strides, dtype)``: one dtype map each) stores them once and refers to them by
position (``interned`` / ``expanded``).

Why not pickle, even restricted: a record stands in for checks the job ran itself, so reading it
must never be able to do more than building these values, whatever its bytes. The sha256 tells
a torn or damaged file (a crash mid-write, a full disk) from a whole one; records are written to
a fresh name and renamed, relative to the folder's descriptor, so readers see whole records.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from typing import Any

import msgpack
import torch

from . import bounded
from .limits import load_limits
from .serialize import Ref

__all__ = ["encode", "decode", "read", "write", "remove", "trim", "interned", "expanded"]

_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_NAMED = {"d": _DTYPES, "m": _FORMATS, "l": _LAYOUTS}


_PLAIN = frozenset((type(None), bool, int, float, str))


def _tagged(v: Any) -> Any:
    kind = type(v)
    if kind in _PLAIN:
        return v
    if kind is tuple:
        if not v:
            return v
        first = type(v[0])
        if first is int and all(type(x) is int for x in v):  # shapes and strides: as they are
            return v
        if first is Ref and all(type(x) is Ref for x in v):
            return {"T": [x.index for x in v]}
        return [_tagged(x) for x in v]
    if kind is Ref:
        return {"r": v.index}
    if kind is list:
        if v and all(type(x) is Ref for x in v):
            return {"R": [x.index for x in v]}
        return {"L": [_tagged(x) for x in v]}
    if kind is dict:
        if not all(type(k) is str for k in v):
            raise TypeError("a map with keys other than strings has no stored form")
        return {"k": [[k, _tagged(x)] for k, x in v.items()]}
    if kind is slice:
        return {"s": [_tagged(v.start), _tagged(v.stop), _tagged(v.step)]}
    if kind is torch.dtype:
        return {"d": str(v).removeprefix("torch.")}
    if kind is torch.memory_format:
        return {"m": str(v).removeprefix("torch.")}
    if kind is torch.layout:
        return {"l": str(v).removeprefix("torch.")}
    if kind is torch.device:
        return {"v": str(v)}
    raise TypeError(f"a {kind.__name__} has no stored form")


def _indices(x: Any) -> bool:
    return type(x) is tuple and all(type(i) is int and i >= 0 for i in x)


def _untag(m: dict) -> Any:
    """One tagged map back to its value (the decoder calls it on every map, innermost first,
    so what it holds is rebuilt already; arrays arrive as tuples)."""
    x = m.get("r")  # the commonest first: value references, then dtypes
    if x is not None and type(x) is int and x >= 0 and len(m) == 1:
        return Ref(x)
    x = m.get("d")
    if x is not None and len(m) == 1 and x in _DTYPES:
        return _DTYPES[x]
    if len(m) != 1:
        raise ValueError("a tagged value with other than one tag")
    (tag, x), = m.items()
    if tag == "T" and _indices(x):
        return tuple(map(Ref, x))
    if tag == "R" and _indices(x):
        return list(map(Ref, x))
    if tag == "L" and type(x) is tuple:
        return list(x)
    if tag == "k" and type(x) is tuple and all(type(p) is tuple and len(p) == 2 and type(p[0]) is str for p in x):
        return dict(x)
    if tag == "s" and type(x) is tuple and len(x) == 3 and all(v is None or type(v) is int for v in x):
        return slice(*x)
    names = _NAMED.get(tag)
    if names is not None and type(x) is str and x in names:
        return names[x]
    if tag == "v" and type(x) is str and len(x) < 64:
        return torch.device(x)
    raise ValueError(f"a record holds an unknown value {str(m)[:80]}")


def interned(values) -> tuple[tuple, tuple]:
    """``values`` as (distinct values, the position of each value's among them): tensor
    descriptions ``(shape, strides, dtype)`` are stored once however often they repeat (layers
    repeat them); any other value gets a position of its own. ``expanded`` inverts it."""
    table: list = []
    ids: list = []
    seen: dict = {}
    dtype = torch.dtype
    for v in values:
        if type(v) is tuple and len(v) == 3 and type(v[2]) is dtype:  # of ints: hashes by value, no bools
            k = seen.get(v)
            if k is None:
                k = seen[v] = len(table)
                table.append(v)
        else:
            k = len(table)
            table.append(v)
        ids.append(k)
    return tuple(table), tuple(ids)


def expanded(table: Any, ids: Any, what: str) -> list:
    """``interned``'s input back; ``ValueError`` naming ``what`` if a position is out of range."""
    if type(table) is not tuple or not _indices(ids) or (ids and max(ids) >= len(table)):
        raise ValueError(f"{what}: positions outside its table of values")
    return [table[i] for i in ids]


def encode(value: Any) -> bytes:
    """``value`` (tagged plain data, module doc) as msgpack; ``TypeError`` for anything else."""
    return msgpack.packb(_tagged(value), use_bin_type=True)


def decode(body: bytes, what: str = "record") -> Any:
    """``encode``'s input back, read by the bounded decoder, tagged maps rebuilt as they are
    decoded (nothing imported or unpickled); ``CorruptArtifactError`` for anything else."""
    limits = load_limits()
    items = max(limits.items, limits.nodes)
    return bounded.unpack(body, what, objects=limits.objects_per_node * limits.nodes, max_array=items,
                          max_map=items, use_list=False, object_hook=_untag)


def read(folder: int, name: str, magic: bytes, limit: int) -> bytes | None:
    """The body of record ``name`` in the folder's descriptor: None when there is none;
    ``ValueError`` when it is not a regular file, too large, or damaged (its sha256)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a link (ELOOP), a FIFO without writer (ENXIO), ...
        raise ValueError(f"not a readable record: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError("not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit or not data.startswith(magic):
        raise ValueError("not a record")
    body = data[len(magic) + 32:]
    if hashlib.sha256(body).digest() != data[len(magic):len(magic) + 32]:
        raise ValueError("content does not match its sha256")
    return body


def write(folder: int, name: str, magic: bytes, body: bytes) -> None:
    """Record ``name`` := ``body``, whole or not at all (a fresh name, then a rename; ranks on
    several hosts may share one home directory)."""
    tmp = f".{name[:16]}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(magic + hashlib.sha256(body).digest() + body)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        remove(folder, tmp)
        raise


def remove(folder: int | None, name: str) -> None:
    """Unlink ``name`` in the folder's descriptor (never through a path); quietly."""
    if folder is None:
        return
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:
        pass


def trim(folder: int, keep: int) -> None:
    """Keep the ``keep`` most recently written regular files of the folder's descriptor."""
    records = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                records.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.name))
    for _, name in sorted(records, reverse=True)[keep:]:
        remove(folder, name)
