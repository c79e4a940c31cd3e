"""Stored kernels at job start: loaded only from an entry the user trusts, else the interpreter.

Compiled kernels are code: Inductor's saved artifact is pickles and generated Python, its
libraries are native code that ``dlopen`` runs. Everything else spmd-aot loads is data checked
against an allowlist, so kernels need a stronger reason to run than the cache's directory
permissions (which any copy into the cache, a shared filesystem or a remote layer bypasses):

* a **signed entry**: with ``SPMD_AOT_SIGNING_KEY`` set, ``artifact.read_manifest`` refused any
  manifest whose HMAC does not verify, and the manifest names the kernels blob by sha256; or
* a cache the user **explicitly trusts**: ``SPMD_AOT_TRUST_CACHE=1`` / ``trust_cache=True``
  (``store/trust.py``), which says "I trust everyone who can write this cache".

Otherwise the step runs the interpreted graph (``program.Program``), exactly as without kernels,
and the reason is logged once per process. A trusted load writes the libraries into a fresh
private directory (``mkdtemp``: mode 0700), points Inductor's cache there for the load only, so
no kernel is taken from (or left in) the user's Inductor cache, and registers the live process
group of each mesh dimension under the name the kernels were compiled with (``kernels_blob.group_name``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pathlib
import shutil
import tempfile
import threading

import torch

from ..building import kernels
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
    """The compiled step, called like ``program.Program``: inputs in, the graph's outputs out."""

    def __init__(self, compiled, n_inputs: int, directory: str):
        self._compiled, self.n_inputs, self.directory = compiled, n_inputs, directory

    def __call__(self, *inputs: torch.Tensor):
        if len(inputs) != self.n_inputs:
            raise TypeError(f"compiled step takes {self.n_inputs} inputs, got {len(inputs)}")
        return self._compiled(*inputs)


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
    doc = kernels_blob.unpack(artifact.kernels, f"artifact {artifact.digest[:12]}")
    if doc["requested"] != kernels.ingredient(device.type):
        interpreting(artifact.digest, f"its kernels were built for {doc['requested']}, this process is "
                                   f"{kernels.ingredient(device.type)}")
        return None
    _register_groups(doc["groups"], live_groups)
    directory = _private_dir(doc["files"])
    compiled = _load(directory, doc["artifact"], artifact.digest)
    log.info("artifact %s: running its compiled kernels (%d libraries, built by %s)",
             artifact.digest[:12], len(doc["files"]), doc["cxx"])
    return KernelProgram(compiled, len(artifact.slots), directory)


def _register_groups(names: list[str], live: list[str]) -> None:
    """Each compiled group name resolves to the live group of its mesh dimension."""
    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group, _unregister_process_group

    if len(names) != len(live):
        raise CorruptArtifactError(f"kernels compiled for {len(names)} mesh dimensions, the job has {len(live)}")
    for name, live_name in zip(names, live):
        group = _resolve_process_group(live_name)
        try:
            if _resolve_process_group(name) is group:
                continue
            _unregister_process_group(name)  # a group of an earlier process group init, now gone
        except (RuntimeError, ValueError):
            pass
        _register_process_group(name, group)


def _private_dir(files: dict[str, bytes]) -> str:
    directory = tempfile.mkdtemp(prefix="spmd-aot-kernels-")  # 0700, a new name: nobody else writes here
    with _lock:
        if not _dirs:
            atexit.register(_remove_dirs)
        _dirs.append(directory)
    for rel, content in files.items():  # rel matched kernels_blob.FILE_PATTERN: one plain folder, one name
        path = pathlib.Path(directory, rel)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
    return directory


def _load(directory: str, artifact: bytes, digest: str):
    from torch._inductor import CompiledArtifact
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    path = os.path.join(directory, "artifact.bin")
    pathlib.Path(path).write_bytes(artifact)
    try:
        with temporary_cache_dir(directory), kernels.inductor_settings(), _no_isa_probes():
            return CompiledArtifact.load(path=path, format="binary")
    except Exception as exc:  # torch's loader asserts on what it does not recognise
        raise CorruptArtifactError(f"artifact {digest[:12]}: its compiled kernels do not load "
                                   f"({type(exc).__name__}: {str(exc)[:200]}); rebuild it") from exc


@contextlib.contextmanager
def _no_isa_probes():
    """Inductor proves each vector ISA the CPU reports by dlopen-ing a test library in a fresh
    Python subprocess (about half a second each, several per process) before it loads a kernel.
    The stored kernels were built for this CPU capability (it is in the key) and their libraries
    are loaded directly; a library that cannot load fails the load, which then says so."""
    from torch._inductor import cpu_vec_isa

    probe = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if probe is None:  # another torch: nothing to skip
        yield
        return
    cpu_vec_isa.VecISA._probe_load = lambda self, path: os.path.isfile(path)
    try:
        yield
    finally:
        cpu_vec_isa.VecISA._probe_load = probe


def loaded_dirs() -> list[str]:
    """The private directories kernels were loaded from in this process (tests, diagnostics)."""
    with _lock:
        return list(_dirs)


def _remove_dirs() -> None:
    for directory in loaded_dirs():
        shutil.rmtree(directory, ignore_errors=True)
