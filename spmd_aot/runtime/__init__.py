"""Job start and every step after: look up, agree across ranks, load, bind, run.

``step`` is ``spmd_aot.compile`` and the ``CompiledStep`` it returns; ``ranks`` the cross-rank
protocol of the first call; ``device_check`` the artifact's device against this process;
``program`` runs a loaded graph op by op, after ``constant_fold``; ``teardown`` what a job's end
must release.
"""
