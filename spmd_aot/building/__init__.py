"""Offline builds: trace -> passes -> user transformations -> blobs -> store.

``pipeline`` is the one path from a job to stored blobs (builds and run-time misses alike);
``builder`` is ``spmd_aot.build`` (one world size and placement into the cache); ``memory``
estimates a step's peak live bytes from its graph.
"""
