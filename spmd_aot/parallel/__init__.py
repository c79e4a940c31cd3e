"""Parallelism as composable axes over named mesh dimensions.

``dims`` and ``tp_plan`` are names and arithmetic (what ``Plan``, a pure value, imports);
``data_parallel`` (replicate / shard over ``dp_replicate`` and ``dp_shard``) and
``tensor_parallel`` (over ``tp``) are the axes' mechanics; ``axes`` is their registry and how
they compose (TP first, then data parallelism over what TP left, as torchtitan applies them).
"""
