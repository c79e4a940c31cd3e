"""The ``spmd-aot`` command line (``app.main``), one module per command family."""
