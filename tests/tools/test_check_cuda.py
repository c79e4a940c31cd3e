"""tools/bench/check_cuda.py, the one script to run on a GPU machine, runs its checks on CPU + gloo.

No GPU here: this keeps the script working (what it found, build, hit, parity with eager under
the floor rule, timing against eager and torch.compile, bf16 mixed precision, world 2 against DDP and
FSDP2, the budget, the summary) so that a session lent a GPU can run it as it is."""


import pytest
import torch

TINY = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--seq", "16", "--batch", "2", "--steps", "3",
        "--blocks", "1", "--timed-steps", "1", "--warmup", "1"]
PLAIN = [f"world {w} {m} {p}" for w in (1, 2) for m in ("lm", "llama") for p in ("replicate", "shard")]
BF16 = ["world 1 lm replicate bf16", "world 1 lm shard bf16"]  # mixed precision (the example LM)
CHECKS = PLAIN + BF16


@pytest.fixture
def check_cuda(monkeypatch):
    import bench_step
    import check_cuda

    try:  # ranks forked from a torch-preloaded server: quick to start (spawned ones, the tool's way, are slower)
        from support.multiproc import preloaded_context
        monkeypatch.setattr(bench_step, "rank_context", preloaded_context)
    except ImportError:
        pass
    return check_cuda


def _verdicts(out: str) -> dict:
    """check name -> PASS/FAIL/SKIP, from the summary table."""
    table = out[out.index("# summary"):]
    rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| world")]
    return {cells[0].strip(): cells[3].strip() for cells in rows}


def _summary_row(out: str, check: str) -> list[str]:
    table = out[out.index("# summary"):]
    return next([c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
                if line.startswith(f"| {check} |"))


def test_every_check_passes_on_cpu(check_cuda, capsys):
    code = check_cuda.main(TINY + ["--compile", "lm"])
    out = capsys.readouterr().out
    assert code == 0, out
    # what it found comes first
    assert out.startswith("# python "), out
    assert f"torch {torch.__version__}" in out and "NCCL available" in out and "spmd-aot 0.1" in out and "transformers" in out
    assert "# SDPA backend eager picks on cpu" in out and "bfloat16 causal GQA 4/2: " in out, out
    verdicts = _verdicts(out)
    assert verdicts == {c: "PASS" for c in CHECKS}, out
    assert "|loaded - FSDP2(mp_policy)|" in out and "|loaded - replicate(mp_policy)|" in out
    assert out.count("cache hit True, traces 0") == len(CHECKS), out
    # timing: loaded/eager everywhere, loaded/compile where torch.compile was asked for
    for check in CHECKS:
        row = _summary_row(out, check)
        assert row[4] != "-", out
        assert (row[5] != "-") == (check == "world 1 lm replicate"), out
    assert "torch.compile" in out and "first step" in out


def test_a_parity_failure_fails_the_run(check_cuda, capsys):
    # a tolerance nothing can meet: every comparison reports FAIL and the exit status says so;
    # a timing threshold beyond the budget skips the timing of every check, saying why
    code = check_cuda.main(TINY + ["--models", "lm", "--no-compile", "--tolerance", "-1",
                                   "--timing-seconds", "1e9"])
    out = capsys.readouterr().out
    assert code == 1, out
    lm = [c for c in CHECKS if " lm " in c]
    assert _verdicts(out) == {c: "FAIL" for c in lm}, out
    assert out.count("timing skipped: ") == len(lm), out
    assert "FAILED world 1 lm replicate" in out


def test_floor_rule(check_cuda):
    """max(1e-5, 10 x floor) per metric; a miss or a trace fails whatever the differences."""
    row = dict(check="c", diff={"param": 2e-4, "state": 1e-6, "loss": 0.0},
               floor={"param": 3e-5, "state": 0.0, "loss": 0.0}, hit=True, traces=0, allow_ops=[])
    assert check_cuda.judge(dict(row), None)["status"] == "PASS"
    assert check_cuda.judge(dict(row, floor={"param": 1e-5, "state": 0.0, "loss": 0.0}), None)["status"] == "FAIL"
    assert check_cuda.judge(dict(row), 1e-3)["status"] == "PASS"
    assert check_cuda.judge(dict(row), 1e-5)["status"] == "FAIL"
    assert check_cuda.judge(dict(row, traces=1), None)["status"] == "FAIL"


def test_an_exhausted_budget_skips_every_check_with_a_reason(check_cuda, capsys):
    code = check_cuda.main(TINY + ["--budget-seconds", "0"])
    out = capsys.readouterr().out
    assert code == 0, out  # nothing failed: nothing ran
    assert _verdicts(out) == {c: "SKIP" for c in CHECKS}, out
    for check in CHECKS:
        assert f"SKIP {check}: budget: 0s left" in out, out
    assert "# 0 passed, 0 failed, 10 skipped" in out, out


def test_a_failing_torch_compile_costs_its_timing_not_the_check(check_cuda, capsys, monkeypatch):
    def broken(module):
        def call(*args, **kwargs):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(check_cuda.torch, "compile", broken)
    code = check_cuda.main(TINY + ["--models", "lm", "--worlds", "1", "--compile", "lm"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert _verdicts(out) == {"world 1 lm replicate": "PASS", "world 1 lm shard": "PASS",
                              "world 1 lm replicate bf16": "PASS", "world 1 lm shard bf16": "PASS"}, out
    assert "torch.compile failed: RuntimeError: no compiler here" in out
    assert _summary_row(out, "world 1 lm replicate")[5] == "-", out
