"""The artifact format: an entry's bytes and every check they pass, with no store, key or runtime.

``serialize`` writes a graph as plain msgpack and reads it back without running stored code;
``bounded`` decodes within limits fixed before allocation; ``digests`` names blobs; ``manifest``
is the manifest (parts, guards, packing, the check of a read one); ``artifact`` turns a traced step
into an entry's blobs and checks a layout read back; ``signing`` the manifest's signature header;
``allowlist`` (with ``allowed_ops.txt``) and ``contracts`` say which ops a graph may call and what
each assumes of its arguments; ``limits`` bounds sizes; ``validate`` runs a decoded graph on meta
tensors against its layout (with ``fused_meta`` and ``device_results``); ``records`` is the
per-user records' file format. Everything here takes the bytes a caller hands it and writes
nothing: ``entries/`` reads and writes entries in a store and remembers passed checks per user.
"""
