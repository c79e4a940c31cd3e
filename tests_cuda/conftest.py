"""Every test here needs torch's CUDA build (CI's CUDA stage): marked ``cuda`` so a selection by
marker (``-m cuda``, ``-m "not cuda"``) says so; the folder is outside the default ``testpaths``."""

import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:  # the session's items: this hook is not limited to the folder it is in
        if HERE in pathlib.Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.cuda)
