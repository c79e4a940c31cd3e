"""What fits: per-rank memory and communication of candidate configurations, known before a build.

``footprint`` measures a job once per compute dtype and checkpointing choice on fake tensors
(one rank, no process group); ``memory_model`` turns such a measurement into a per-rank peak
and bytes per collective kind for one mesh and set of options (arithmetic, no trace);
``candidates`` lists the meshes a world size allows and ranks them (docs/plan.md).
"""
