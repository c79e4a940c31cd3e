"""Stored kernels at job start: loaded only from an entry the user trusts, else the interpreter.

Compiled kernels are code: the stored library is native code that ``dlopen`` runs. Everything else spmd-aot loads is data checked
against an allowlist, so kernels need a stronger reason to run than the cache's directory
permissions (which any copy into the cache, a shared filesystem or a remote layer bypasses):

* a **signed entry**: with ``SPMD_AOT_SIGNING_KEY`` set, ``entries.read_manifest`` refused any
  manifest whose HMAC does not verify, and the manifest names the kernels blob by sha256; or
* a cache the user **explicitly trusts**: ``SPMD_AOT_TRUST_CACHE=1`` / ``trust_cache=True``
  (``store/trust.py``), which says "I trust everyone who can write this cache".

Otherwise the step runs the interpreted graph (``program.Program``), exactly as without kernels,
and the reason is logged once per process; so does a blob of an older format (its ``format`` is
read first, nothing else of it). A trusted load writes each library into a fresh private
directory (``mkdtemp``: mode 0700), loads it as the Python extension module it is
(``importlib.machinery.ExtensionFileLoader``: a ``dlopen`` and its ``PyInit``), and registers the
live process group of each mesh dimension under the name the kernels were compiled with
(``kernels_blob.group_name``), and on a mesh of several dimensions the default group under
``kernels_blob.WORLD_GROUP``. No ``torch._inductor`` or ``torch._dynamo`` import: the build
proved a bare call of each library is all its segment does (``building/kernel_library.py``);
calling one is the two conversions Inductor's own wrapper makes, tensors to handles and back. The
step is the blob's calls in order (``format/kernels_blob.py``): a repeated block's library once per
block, each value released after its last reader.
"""

from __future__ import annotations

import atexit
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import tempfile
import threading

import torch

from ..errors import CorruptArtifactError
from ..format import kernels_blob
from ..format.signing import ENV_SIGNING_KEY, signing_key
from ..store import trust

__all__ = ["untrusted_reason", "interpreting", "load_kernels", "KernelProgram", "loaded_dirs"]

log = logging.getLogger(__name__)

_said: set[str] = set()
_lock = threading.Lock()
_dirs: list[str] = []  # private directories of this process's loaded kernels (removed at exit)


def untrusted_reason(trust_cache: bool | None = None) -> str | None:
    """None when stored native code may load in this process, else why not (and how to allow it)."""
    if signing_key() is not None or trust.opted_in(trust_cache):
        return None
    return (f"the entry is not signed and the cache is not explicitly trusted, and compiled kernels are "
            f"native code; set {ENV_SIGNING_KEY} on builders and jobs (only signed entries load), or "
            f"{trust.ENV_TRUST_CACHE}=1 (API: trust_cache=True) if you trust everyone who can write the cache")


def interpreting(digest: str, why: str) -> None:
    """Log that the entry's kernels are not run and why, once per reason per process."""
    with _lock:
        if why in _said:
            return
        _said.add(why)
    log.warning("artifact %s: running the interpreted graph, not its compiled kernels: %s", digest[:12], why)


class KernelProgram:
    """The compiled step, called like ``program.Program``: inputs in, the graph's outputs out.

    Each library's entry takes a list of new tensor handles (it steals them: each is a new
    reference to the input's tensor, so the caller's tensors stay valid, and are updated in
    place where the step writes them) and returns handles the caller owns. The calls pass values
    by reference number (the step's inputs, then each call's outputs); a value is dropped after
    its last reader, as Inductor frees a buffer inside one library."""

    def __init__(self, entries: list, libraries: list[dict], calls: list, outputs: list[int], n_inputs: int,
                 directory: str, constants: list[torch.Tensor] = ()):
        self.n_inputs, self.directory = n_inputs, directory
        self._constants = list(constants)
        self.n_outputs = len(outputs)
        self._outputs = outputs
        produced = n_inputs + len(self._constants)  # values from here on are outputs of calls
        last: dict[int, int] = {}  # value -> the call that reads it last, or makes it if none reads it
        at = produced
        for i, (lib, refs) in enumerate(calls):
            for r in refs:
                last[r] = i
            for r in range(at, at + libraries[lib]["outputs"]):
                last.setdefault(r, i)  # an output this call returns for another call of its library
            at += libraries[lib]["outputs"]
        keep = set(outputs)
        drops: list[list[int]] = [[] for _ in calls]
        for r, i in last.items():
            if r not in keep:
                drops[i].append(r)

        def checks(lib, refs):
            """(position, strides, written) of each input another call produced: its strides are that
            library's choice, which may differ from the layout this library was compiled for."""
            library = libraries[lib]
            written = set(library["written"])
            return [(k, tuple(library["strides"][k]), k in written) for k, r in enumerate(refs) if r >= produced]

        self._plan = [(entries[lib], refs, libraries[lib]["outputs"], drops[i], checks(lib, refs))
                      for i, (lib, refs) in enumerate(calls)]
        self._size = n_inputs + len(self._constants) + sum(libraries[lib]["outputs"] for lib, _ in calls)

    def __call__(self, *inputs: torch.Tensor):
        if len(inputs) != self.n_inputs:
            raise TypeError(f"compiled step takes {self.n_inputs} inputs, got {len(inputs)}")
        values: list = [*inputs, *self._constants]
        at = len(values)
        values.extend([None] * (self._size - at))
        to_handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
        from_handles = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs
        for entry, refs, n_outputs, drops, checks in self._plan:
            args = [values[r] for r in refs]
            restrided = _restrided(args, checks)
            outputs = from_handles(entry(to_handles(args)))
            for original, copy in restrided:  # an input the library updated, through its copy
                original.copy_(copy)
            if len(outputs) != n_outputs:
                raise CorruptArtifactError(f"a compiled library returned {len(outputs)} outputs, its blob says "
                                           f"{n_outputs}; rebuild the entry")
            values[at:at + n_outputs] = outputs
            at += n_outputs
            for r in drops:
                values[r] = None
        return [values[r] for r in self._outputs]


def _restrided(args: list, checks: list) -> list:
    """Each checked input whose strides differ from its library's, replaced in ``args`` by a copy
    with the library's strides (Inductor's own input check would refuse it); the (input, copy)
    pairs of those the library writes, to copy back after the call."""
    written = []
    for position, strides, writes in checks:
        value = args[position]
        if value.stride() != strides:
            copy = torch.empty_strided(value.shape, strides, dtype=value.dtype, device=value.device)
            copy.copy_(value)
            args[position] = copy
            if writes:
                written.append((value, copy))
    return written


def load_kernels(artifact, live_groups: list[str], trust_cache: bool | None, device: torch.device):
    """A ``KernelProgram`` for ``artifact``'s stored kernels, or None (the caller interprets):
    the entry has none, this process may not load native code, or they were built for another
    device or process (each logged once)."""
    if artifact.kernels is None:
        return None
    why = untrusted_reason(trust_cache)
    if why is not None:
        interpreting(artifact.digest, why)
        return None
    where = f"artifact {artifact.digest[:12]}"
    doc = kernels_blob.decode(artifact.kernels, where)
    if doc.get("format") != kernels_blob.KERNELS_FORMAT:  # read nothing else of it
        interpreting(artifact.digest, f"its kernels blob has format {str(doc.get('format'))[:20]}, this spmd_aot "
                                   f"loads format {kernels_blob.KERNELS_FORMAT}; rebuild it with --kernels")
        return None
    kernels_blob.check(doc, where)
    if doc["inputs"] != len(artifact.slots):
        raise CorruptArtifactError(f"{where}: its kernels take {doc['inputs']} inputs, its layout has "
                                   f"{len(artifact.slots)}; rebuild it")
    here = kernels_blob.ingredient(device.type)
    if doc["requested"] != here:
        interpreting(artifact.digest, f"its kernels were built for {doc['requested']}, this process is {here}")
        return None
    missing = [name for name in doc["constants"] if name not in artifact.constants]
    if missing:
        raise CorruptArtifactError(f"{where}: its kernels read constants the entry does not hold "
                                   f"({', '.join(missing[:3])}); rebuild it")
    _register_groups(doc["groups"], live_groups, doc.get("world"))
    from ..building import kernel_collectives  # noqa: F401  (defines the operators the library calls)

    directory = _private_directory()
    entries = [_load(_library_file(directory, i, library["library"]), f"{artifact.digest[:16]}_{i}")
               for i, library in enumerate(doc["libraries"])]
    log.info("artifact %s: running its compiled kernels (%d libraries, %d calls, %d bytes of native code, "
             "built by %s)", artifact.digest[:12], len(entries), len(doc["calls"]),
             sum(len(lib["library"]) for lib in doc["libraries"]), doc["cxx"])
    constants = [artifact.constants[name].to(device) for name in doc["constants"]]
    return KernelProgram(entries, doc["libraries"], doc["calls"], doc["outputs"], doc["inputs"], directory,
                         constants)


def _register_groups(names: list[str], live: list[str], world: str | None) -> None:
    """Each compiled group name resolves to the live group of its mesh dimension, and the
    compiled world name (meshes of several dimensions) to the default group: what the
    interpreter binds the same stored dimensions and world to (``format/serialize.py``)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group, _unregister_process_group

    if len(names) != len(live):
        raise CorruptArtifactError(f"kernels compiled for {len(names)} mesh dimensions, the job has {len(live)}")
    pairs = list(zip(names, live))
    if world is not None:
        pairs.append((world, dist.group.WORLD.group_name))
    for name, live_name in pairs:
        group = _resolve_process_group(live_name)
        try:
            if _resolve_process_group(name) is group:
                continue
            _unregister_process_group(name)  # a group of an earlier process group init, now gone
        except (RuntimeError, ValueError):
            pass
        _register_process_group(name, group)


def _private_directory() -> str:
    """A new private directory for this load's libraries (removed at exit)."""
    directory = tempfile.mkdtemp(prefix="spmd-aot-kernels-")  # 0700, a new name: nobody else writes here
    with _lock:
        if not _dirs:
            atexit.register(_remove_dirs)
        _dirs.append(directory)
    return directory


def _library_file(directory: str, index: int, content: bytes) -> str:
    """``content`` written to a new file in ``directory``; its path."""
    path = os.path.join(directory, f"{kernels_blob.ENTRY}_{index}.so")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    return path


#: What the library's init reads (Inductor sets it the same way before loading its own): the
#: address of torch's function from a Python tensor to its data pointer.
_DATA_PTR_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def _load(path: str, tag: str):
    """The library's entry function, the module imported from ``path`` under a name of its own
    (``tag``: the artifact's digest and the library's number; not put in ``sys.modules``: nothing
    imports it by name)."""
    os.environ[_DATA_PTR_ENV] = str(torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
    name = f"spmd_aot_kernels_{tag}.{kernels_blob.ENTRY}"  # PyInit_<ENTRY>: the last part
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
        loader.exec_module(module)
        return getattr(module, kernels_blob.ENTRY)
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:  # dlopen, PyInit or entry failed
        raise CorruptArtifactError(f"artifact {tag[:12]}: its compiled kernels do not load "
                                   f"({type(exc).__name__}: {str(exc)[:200]}); rebuild it") from exc


def loaded_dirs() -> list[str]:
    """The private directories kernels were loaded from in this process (tests, diagnostics)."""
    with _lock:
        return list(_dirs)


def _remove_dirs() -> None:
    for directory in loaded_dirs():
        shutil.rmtree(directory, ignore_errors=True)
