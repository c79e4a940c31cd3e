"""Parallelism as composable axes over named mesh dimensions, and the configuration they read.

``dims`` and ``tp_plan`` are names and arithmetic; ``plan`` (``Plan``, a pure value) and
``mixed_precision`` (the policy, a value) import only those; ``layout`` says how one tensor lies
over the mesh, ``mesh`` makes meshes (fake at build time, live at job start). ``placements``
(replicate / shard over ``dp_replicate`` and ``dp_shard``, with ``groups`` for shard's
communication groups) and ``tensor_parallel`` (over ``tp``) are the axes' mechanics; ``axes`` is
their registry and how they compose (TP first, then data parallelism over what TP left, as
torchtitan applies them); ``sharding`` gives the live state its DTensor form at job start.
"""
