"""Tracing and expansion: the user's whole train step as one per-rank FX graph.

``fake_factories`` runs the user's factories on fake tensors; ``trace`` runs make_fx over
forward, backward and the optimizer step (with ``accumulation``, ``optimizers``,
``python_autograd`` and the format's ``fused_meta`` for the step shapes that need them, ``data_dependent``
for what cannot be traced); ``expand`` puts DTensor at the parameter boundary so the parallel
axes' collectives appear in the graph; ``override`` applies the seed's hooks.
"""
