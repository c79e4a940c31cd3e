"""Stored entries: an artifact written into a store part by part, read back and verified.

``write`` stores an entry's blobs in the order a reader can trust (parts, manifest, ref) with
crash points between; ``read`` fetches them within the load limits, re-hashes and validates them
into an ``Artifact`` (``artifact``), which ``check``s its graph as a load does and becomes the
interpreter's ``Program``; ``verified`` remembers passed checks per user, outside every cache;
``program_blob`` is a signed entry's stored program, ``pipeline_artifact`` a pipeline-parallel
entry. The bytes' format is ``format/``'s, the places they live are ``store/``'s; this layer
joins the two.
"""

from .artifact import Artifact
from .read import artifact_bytes, check_entry, manifest_blobs, read_artifact, read_blob, read_manifest
from .write import artifact_in_memory, store_artifact

__all__ = ["Artifact", "read_artifact", "read_manifest", "read_blob", "manifest_blobs", "artifact_bytes",
           "check_entry", "store_artifact", "artifact_in_memory"]
