"""Job start and every step after: look up, agree across ranks, load, bind, run.

``step`` is ``spmd_aot.compile`` and the ``CompiledStep`` it returns (a hit loads through
``entries/``, a miss builds through ``building/``: this stage sits above both); ``ranks`` the
cross-rank protocol of the first call; ``device_check`` the artifact's device against this
process; ``prepared`` keeps built programs per user; ``kernel_load`` loads compiled kernels when
trusted; ``teardown`` what a job's end must release. The loaded graph itself runs in the
interpreter (``interpreter/``).
"""
