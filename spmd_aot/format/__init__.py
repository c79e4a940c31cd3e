"""The artifact format and every check a stored artifact passes before it runs.

``serialize`` writes a graph as plain msgpack and reads it back without running stored code;
``bounded`` decodes within limits fixed before allocation; ``artifact`` is the manifest and its
blobs; ``signing`` the manifest's signature header; ``allowlist`` (with ``allowed_ops.txt``) and
``contracts`` say which ops a graph may call and what each assumes of its arguments; ``limits``
bounds sizes; ``validate`` runs a decoded graph on meta tensors against its layout; ``verified``
remembers passed checks per user, outside every cache.
"""
