"""tools/check_cuda.py, the one script to run on a GPU machine, runs its checks on CPU + gloo.

No GPU here: this keeps the script working (build, hit, parity with eager, timing) so that a
session lent a GPU can run it as it is."""

import os

from multiproc import preloaded_context

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
SMALL = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--steps", "3", "--blocks", "1",
         "--timed-steps", "1"]


def _verdicts(out: str) -> list[str]:
    return [line.split(":")[0] for line in out.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]


def test_every_check_passes_on_cpu_and_a_difference_fails(monkeypatch, capsys):
    monkeypatch.syspath_prepend(TOOLS)
    import bench_step
    import check_cuda

    monkeypatch.setattr(bench_step, "rank_context", preloaded_context)
    code = check_cuda.main(SMALL)
    out = capsys.readouterr().out
    assert code == 0, out
    assert _verdicts(out) == ["PASS world 1 replicate", "PASS world 2 replicate", "PASS world 2 shard"], out
    assert "cache hit True" in out and "loaded/eager" in out

    # a tolerance nothing can meet: every comparison must report FAIL and the exit status say so
    code = check_cuda.main(SMALL + ["--tolerance", "-1"])
    out = capsys.readouterr().out
    assert code == 1 and _verdicts(out) == ["FAIL world 1 replicate", "FAIL world 2 replicate",
                                             "FAIL world 2 shard"], out
