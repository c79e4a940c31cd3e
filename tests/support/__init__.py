"""What several test files share: jobs and models (``jobs``, ``features``, ``train_steps``, the
real-model ``corpus``), real multi-process runs over gloo (``multiproc``) and the store contract
every backend passes (``store_contract``). Imported as ``support.<module>``: pytest puts ``tests/``
and ``tools/`` on ``sys.path`` (``pythonpath`` in pyproject.toml), the one place that does."""
