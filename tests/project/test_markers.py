"""The suite's own markers are right: ``multiproc`` is found from the code (a test reaching a
``support.multiproc`` launcher, through its fixtures and helpers, is marked; one that does not is
not), and every id ``tests/slow.txt`` lists names a test that exists, so a renamed test cannot
silently fall back into the fast tier's budget."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import types

import pytest

from support import markers

ROOT = pathlib.Path(__file__).resolve().parents[2]

SYNTHETIC = '''
import pytest
from support.multiproc import run_ranks, start_ranks


def _rank(rank, world):
    return rank


def _launch_later():
    return start_ranks(_rank, 2)


@pytest.fixture(scope="module")
def built():
    return run_ranks(_rank, 2)


def test_uses_the_fixture(built):
    assert built


def test_calls_a_helper_that_launches():
    _launch_later().result()


def test_stays_in_this_process():
    assert _rank(0, 1) == 0
'''


class _Item:
    """What ``starts_processes`` reads of a collected pytest item."""

    def __init__(self, path: pathlib.Path, name: str, fixturenames=()):
        self.path, self.fixturenames = path, list(fixturenames)
        self.function = types.SimpleNamespace(__name__=name)


def test_a_test_reaching_a_launcher_through_a_fixture_or_a_helper_is_multiproc(tmp_path):
    module = tmp_path / "test_synthetic.py"
    module.write_text(SYNTHETIC)
    assert markers.starts_processes(_Item(module, "test_uses_the_fixture", ["built", "request"]))
    assert markers.starts_processes(_Item(module, "test_calls_a_helper_that_launches"))
    assert not markers.starts_processes(_Item(module, "test_stays_in_this_process", ["tmp_path"]))


def test_the_suite_marks_rank_tests_multiproc_and_leaves_others_alone():
    files = ["tests/parallel/test_parity.py", "tests/project/test_docs.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "multiproc", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert collected == {"tests/parallel/test_parity.py"}, out.stdout[-3000:]


def _test_functions(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")}


@pytest.mark.parametrize("nodeid", markers.slow_ids())
def test_every_slow_id_names_a_test(nodeid):
    file, _, rest = nodeid.partition("::")
    path = ROOT / file
    assert path.is_file(), f"tests/slow.txt lists {nodeid!r}: no file {file} (moved? update tests/slow.txt)"
    name = rest.split("[", 1)[0]
    assert name in _test_functions(path), (
        f"tests/slow.txt lists {nodeid!r}: {file} defines no {name} (renamed? update tests/slow.txt)")
