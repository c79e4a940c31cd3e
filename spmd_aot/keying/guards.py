"""Guards: what only the trace can know, recorded while tracing and checked before a hit.

The key is computed before tracing, from live objects. Two things it cannot know:

- **which code ran.** A model calls helpers in other files and installed libraries; while
  tracing, a profile hook records every Python source file whose code ran. Outside the
  standard library, torch (the torch release is in the key) and spmd-aot's own modules (the
  ``spmd_aot_code`` ingredient), each file is stored with the sha256 of its bytes, and each
  installed distribution it belongs to with its version;
- **which real tensors the graph baked in.** A plain tensor attribute or global read in forward
  becomes a graph constant. The key holds such tensors' shapes and dtypes; the trace stores the
  sha256 of every *real* one's value (a fake one cannot be baked in: storing it fails).

At load every rank checks the guards of the entry it is about to use: file contents (memoized
by inode, size, mtime and ctime, so a check costs one ``stat`` per file), distribution
versions, tensor values. A failed guard is a miss whose explanation names the file, the
distribution or the tensor. Files are found by their path relative to the ``sys.path`` entry
that holds them (``mypkg/helpers.py``, ``transformers/models/llama/modeling_llama.py``), so a
project checked out elsewhere or a virtualenv at another path still matches; paths themselves
are never compared.

Stored guard paths come from the cache, so checking one reads only what an import could run:
a path must be relative with no ``.``/``..``/empty part, the file must resolve (links followed)
to inside the ``sys.path`` entry it was found under (or be a loaded module's file), be a regular
file (opened ``O_NONBLOCK``: a FIFO or device is refused, not waited on) and be at most
``LoadLimits.guard_file_bytes`` (a larger one fails the guard). A path breaking those rules
fails the guard too; ``artifact`` refuses a manifest holding one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import importlib.metadata
import os
import stat
import sys
import sysconfig
from collections.abc import Iterator

import torch

from .fingerprint import file_digest, is_installed_path
from ..format.limits import load_limits
# the guard schema (what a manifest's ``guards`` holds) is the artifact format's
from ..format.manifest import GUARD_KINDS as KINDS, empty_guards as empty, is_safe_path

__all__ = ["recording_sources", "record", "check", "empty", "is_safe_path"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLES_DIR = os.path.join(_PACKAGE_DIR, "examples") + os.sep
_TORCH_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                    for m in (torch,) + tuple(sys.modules[n] for n in ("torchgen", "functorch") if n in sys.modules))
_STDLIB_DIRS = tuple(sorted({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")}))


# ---------------------------------------------------------------------------- recording
def _observer_codes() -> frozenset:
    """Functions whose callees only observe the trace: import finders (they decide where a
    module comes from; the module's own code, run by the import, is recorded), logging
    handlers and warning display (a build under a test runner logs through its plugins)."""
    import logging
    import warnings

    bootstrap = sys.modules.get("_frozen_importlib") or importlib._bootstrap
    return frozenset(id(f.__code__) for f in (bootstrap._find_spec, logging.Logger.callHandlers,
                                              warnings._showwarnmsg))  # live functions: ids stay valid


@contextlib.contextmanager
def recording_sources() -> Iterator[set[str]]:
    """Collect ``co_filename`` of every Python function called in this block on this thread.

    The recorder is ``cProfile``: its hook is C code, which costs a trace a fraction of what a
    Python ``settrace`` function does (every call inside torch's tracing machinery pays it).
    Functions reached only through an observer (see ``_observer_codes``) are left out, using
    the profile's caller -> callee edges. The set is filled when the block exits."""
    import cProfile

    files: set[str] = set()
    previous = sys.getprofile()  # a profiler already running (a user profiling the build)
    profiler = cProfile.Profile(builtins=False)
    profiler.enable()
    try:
        yield files
    finally:
        profiler.disable()
        if callable(previous):
            sys.setprofile(previous)
        files.update(_files_outside_observers(profiler.getstats(), _observer_codes()))


def _files_outside_observers(stats, observers: frozenset) -> set[str]:
    callees: dict[int, list] = {}
    called: set[int] = set()
    codes = {}
    for entry in stats:
        if isinstance(entry.code, str):  # a C function (none with builtins=False)
            continue
        codes[id(entry.code)] = entry.code
        targets = [sub.code for sub in (entry.calls or ()) if not isinstance(sub.code, str)]
        callees[id(entry.code)] = targets
        called.update(id(c) for c in targets)
    stack = [c for i, c in codes.items() if i not in called]  # called from outside the block
    reached: set[int] = set()
    while stack:
        code = stack.pop()
        if id(code) in reached or id(code) in observers:
            continue
        reached.add(id(code))
        stack.extend(callees.get(id(code), ()))
    return {codes[i].co_filename for i in reached if i in codes}


@functools.lru_cache(maxsize=1)
def _typing_shim() -> str | None:
    """``typing_extensions``' file: it patches the stdlib's ``typing`` internals, so whether its
    code runs during a trace depends on ``typing``'s own LRU caches (process history: torch builds
    ``Optional[...]`` in ``record_function``), not on the step. It only makes annotation objects."""
    spec = importlib.util.find_spec("typing_extensions")
    return os.path.abspath(spec.origin) if spec is not None and spec.origin else None


def _guarded(path: str) -> bool:
    """Code whose file a guard must cover: not stdlib (nor its ``typing_extensions`` shim), torch
    or spmd-aot's own (keyed) modules."""
    if path.startswith(_TORCH_DIRS) or path == _typing_shim():
        return False
    if path.startswith(_PACKAGE_DIR + os.sep):
        return path.startswith(_EXAMPLES_DIR)  # examples are user code
    if path.startswith(_STDLIB_DIRS) and not is_installed_path(path):
        return False
    return os.path.isfile(path)


def record(ran: set[str], key) -> dict:
    """The guards of one trace: the files in ``ran`` that need one, their distributions, and
    the value of every real tensor the key met outside parameters and buffers."""
    files, dists = set(), set()
    packages = None
    for name in ran:
        if not name or name.startswith("<"):
            continue  # frozen modules, exec'd code: bytecode in the key covers what is reachable
        path = os.path.abspath(name)
        if not _guarded(path):
            continue
        digest = file_digest(path)
        if digest is None:
            continue
        rel = relative_name(path)
        files.add((rel, digest))
        if is_installed_path(path):
            if packages is None:
                packages = importlib.metadata.packages_distributions()
            top = rel.split("/")[0].removesuffix(".py")
            for dist in packages.get(top, ()):
                version = _version(dist)
                if version is not None:
                    dists.add((dist, version))
    tensors = {(path, value_digest(t)) for path, t in key.tensors.items() if _has_value(t)}
    return dict(zip(KINDS, (sorted(map(list, found)) for found in (files, dists, tensors))))


# ---------------------------------------------------------------------------- checking
def check(guards: dict, key) -> str | None:
    """Why the live process differs from the trace that recorded ``guards``, or None."""
    for name, version in guards["distributions"]:
        live = _version(name)
        if live != version:
            return (f"installed distribution {name} is {live or 'not installed'} here; the entry "
                    f"was traced with {name} {version}")
    for rel, digest in guards["files"]:
        if not is_safe_path(rel):
            return f"guard path {rel[:200]!r} is not a plain relative path (absolute, empty or with '..'): refused"
        candidates = _locate(rel)
        if not candidates:
            return f"{rel}, whose code ran while tracing, is not found here"
        for path in candidates:
            live, why = _guard_digest(path)
            if why is not None:
                return f"{rel}: {why}"
            if live != digest:
                return f"{rel} changed since the entry was traced (its code ran while tracing; now {path})"
    for path, digest in guards["tensors"]:
        t = key.tensors.get(path)
        if t is None or not _has_value(t):
            return f"tensor {path}, whose value the trace may have baked in, is {'gone' if t is None else 'fake'} here"
        if value_digest(t) != digest:
            return f"tensor {path} has another value than the one the trace may have baked in"
    return None


# ---------------------------------------------------------------------------- files
def _roots() -> list[str]:
    return [os.path.abspath(p or os.curdir) + os.sep for p in sys.path if isinstance(p, str)]


def relative_name(path: str) -> str:
    """``path`` relative to the deepest ``sys.path`` entry holding it; else, for a loaded
    module's file, the path its dotted name spells (``pkg/sub/mod.py``: an editable install
    finds packages through an import hook, not ``sys.path``, and a bare ``models.py`` would also
    match every other loaded ``models.py``, so the guard never held); else its file name (with
    its package folder for an ``__init__.py``)."""
    best = ""
    for root in _roots():
        if path.startswith(root) and len(root) > len(best):
            best = root
    if best:
        return path[len(best):]
    module = _loaded_modules_by_file().get(os.path.abspath(path))
    head, name = os.path.split(path)
    if module:
        spelled = module.replace(".", "/") + ("/__init__.py" if name == "__init__.py" else ".py")
        if os.path.abspath(path).endswith(os.sep + spelled):  # not __main__ or a file imported by path
            return spelled
    return f"{os.path.basename(head)}/{name}" if name == "__init__.py" else name


_BY_FILE: tuple[int, dict[str, str]] = (-1, {})


def _loaded_modules_by_file() -> dict[str, str]:
    """Absolute file path -> dotted name of the loaded module defined there (``.py`` files;
    rebuilt when modules come or go)."""
    global _BY_FILE
    modules = list(sys.modules.items())
    if _BY_FILE[0] != len(modules):
        out: dict[str, str] = {}
        for name, m in modules:
            f = getattr(m, "__file__", None)
            if isinstance(f, str) and f.endswith(".py") and getattr(m, "__name__", None) == name:
                out.setdefault(os.path.abspath(f), name)
        _BY_FILE = (len(modules), out)
    return _BY_FILE[1]


_INDEX: tuple[int, dict[str, list[str]]] = (-1, {})


def _loaded_files() -> dict[str, list[str]]:
    """File name -> absolute paths of the loaded modules' files (rebuilt when modules come or go)."""
    global _INDEX
    modules = list(sys.modules.values())
    if _INDEX[0] != len(modules):
        index: dict[str, list[str]] = {}
        for m in modules:
            f = getattr(m, "__file__", None)
            if isinstance(f, str):
                p = os.path.abspath(f)
                index.setdefault(os.path.basename(p), []).append(p)
        _INDEX = (len(modules), index)
    return _INDEX[1]


def _inside(path: str, root: str) -> str | None:
    """``path`` with every link resolved, if that lies under ``root`` (also resolved); else None."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real if real.startswith(top.rstrip(os.sep) + os.sep) else None


_GUARD_DIGESTS: dict[str, tuple[tuple, str]] = {}


def _guard_digest(path: str) -> tuple[str | None, str | None]:
    """(sha256 of the file at ``path``, None), or (None, why it cannot guard): not a regular
    file, unreadable, or larger than ``guard_file_bytes``. Memoized by inode, size, mtime, ctime."""
    limit = load_limits().guard_file_bytes
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        return None, f"cannot be read here ({exc.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{real} is not a regular file"
        if st.st_size > limit:
            return None, (f"{real} is {st.st_size} bytes, more than guard_file_bytes={limit} "
                          "(SPMD_AOT_LOAD_LIMITS): not a source file spmd-aot hashes")
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        cached = _GUARD_DIGESTS.get(real)
        if cached is not None and cached[0] == stamp:
            return cached[1], None
        h, left = hashlib.sha256(), limit + 1
        while left > 0 and (chunk := os.read(fd, min(1 << 20, left))):
            h.update(chunk)
            left -= len(chunk)
        if left <= 0:
            return None, f"{real} grew past guard_file_bytes={limit} while it was read"
        _GUARD_DIGESTS[real] = (stamp, h.hexdigest())
        return h.hexdigest(), None
    finally:
        os.close(fd)


def _locate(rel: str) -> list[str]:
    """The live files ``rel`` (a safe path: ``is_safe_path``) can name: the module an import of
    that name gives (usually loaded already), else every loaded module's file ending in it,
    else the first ``sys.path`` entry that holds it inside itself (where an import would find it)."""
    name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if isinstance(path, str) and os.path.abspath(path).endswith(os.sep + rel):
        return [os.path.abspath(path)]
    # a loaded file names ``rel`` only if ``record`` would have named it so: a script ``train.py``
    # at a sys.path root is not a library's ``pkg/sub/train.py``, whose path merely ends alike
    found = sorted({p for p in _loaded_files().get(os.path.basename(rel), ())
                    if (p == rel or p.endswith(os.sep + rel)) and relative_name(p) == rel})
    if found:
        return found
    for root in _roots():
        if os.path.isfile(root + rel):
            inside = _inside(root + rel, root)
            return [inside] if inside is not None else []
    return []


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- tensors
def _has_value(t: torch.Tensor) -> bool:
    return not isinstance(t, torch._subclasses.FakeTensor) and t.device.type != "meta"


def value_digest(t: torch.Tensor) -> str:
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach().cpu().contiguous().clone()  # a fresh storage of exactly its bytes
    h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
    h.update(bytes(t.untyped_storage()))
    return h.hexdigest()
