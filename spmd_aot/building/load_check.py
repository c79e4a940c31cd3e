"""A build stores only what loads: the check every load runs, run on the blobs before they are stored.

Why: the tracer, the passes and the user's graph transformations can produce a graph that a load
refuses (an op argument that breaks its contract, a view outside its storage, a tensor over the
load limits). Stored, such an entry is worse than none: the build exits 0, every rank of every job
that hits it fails, and ``spmd-aot verify`` reports it only when someone runs it. So the entry
goes through ``entries.check_entry`` (the function ``spmd-aot verify`` runs, and the
checks a load runs: re-hash and decode every blob, the op allowlist, the load limits, every node
against its op's contract on meta tensors shaped by the layout) while it is still in memory; a
refusal is a build error and nothing is written under the key.

It costs one meta run of the graph per build (a few percent of a build: the README's figures).
With a signing key set, a second one: the checked program is stored as the entry's ``program``
part (``entries/program_blob.py``), so that jobs that verify the signature skip the load check.
"""

from __future__ import annotations

from ..errors import CorruptArtifactError, UnsupportedError
from ..entries import program_blob
from ..format import signing
from ..entries import artifact_in_memory, check_entry
from ..format.artifact import amended
from ..keying.key import CacheKey

__all__ = ["check_before_storing"]


def check_before_storing(blobs: dict[str, bytes], key: CacheKey) -> None:
    """Raise ``UnsupportedError`` when a load of ``blobs`` (an entry for ``key``) would refuse it.

    The blobs are checked as ``store_artifact`` would store them (signed when a signing key is
    set), under the allowlist opt-ins in force, which are the build's. With a signing key set,
    ``blobs`` gains the checked program (``program_blob.PART``) and a manifest naming it."""
    digest, memory = artifact_in_memory(blobs)
    try:
        artifact = check_entry(memory, key.key, digest)
        part = (program_blob.encode(artifact) if signing.signing_key() is not None
                and program_blob.PART not in blobs else None)
        if part is not None:
            blobs.update(amended(blobs, {program_blob.PART: part}, {}))
    except CorruptArtifactError as exc:  # UnsafeArtifactError and OpNotAllowedError are kinds of it
        raise UnsupportedError(
            f"the built graph fails the check every load runs, so nothing was stored under key "
            f"{key.key[:12]}: {exc}. A gm_transformation or Override.transform must keep every op's "
            "argument contract; if the step has none, spmd-aot produced a graph its own loader refuses: "
            "report it with this message") from exc
