"""tools/bench/bench_step.py runs end to end on real gloo ranks: a row per configuration, a chart.

Smoke test only (no timing assertions): the benchmark is what the lead measures with.
"""

import json
import os
import statistics
import xml.etree.ElementTree as ET

from support.multiproc import preloaded_context



def test_quick_run_prints_a_row_per_configuration_and_writes_a_chart(tmp_path, monkeypatch, capsys):
    """The tool's main() in this process (its ranks forked from the tests' preloaded server),
    on a one-layer model."""
    rows_file, chart = tmp_path / "rows.json", tmp_path / "chart.svg"
    import bench_step

    monkeypatch.setattr(bench_step, "rank_context", preloaded_context)
    monkeypatch.chdir(tmp_path)
    code = bench_step.main(["--quick", "--layers", "1", "--d-model", "16", "--seq", "8", "--worlds", "1,2",
                            "--placements", "replicate,shard", "--json", str(rows_file), "--plot", str(chart)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    rows = json.loads(rows_file.read_text())["rows"]
    assert [(r["world"], r["placement"], r["eager_kind"]) for r in rows] == [
        (1, "single", "eager"), (2, "replicate", "DDP"), (2, "shard", "FSDP2")]
    for r in rows:
        assert r["cache_hit"] and r["loaded_ms"] > 0 and r["eager_ms"] > 0 and r["ops"] > 0
        assert r["delta_loss"] < 1e-3  # loaded and eager did the same training
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # header + one row each
    svg = ET.parse(chart).getroot()
    bars = [e for e in svg.iter("{http://www.w3.org/2000/svg}rect") if e.find("{http://www.w3.org/2000/svg}title") is not None]
    assert len(bars) == 2 * len(rows)  # loaded and eager side by side per configuration


def test_profile_step_splits_communication_from_compute(monkeypatch, capsys):
    """tools/bench/profile_step.py: the four variants, with the loaded program's collectives skipped
    in one of them (it reaches into ``Program``: this keeps it working)."""
    import bench_step
    import profile_step

    monkeypatch.setattr(bench_step, "rank_context", preloaded_context)
    code = profile_step.main(["--world", "2", "--layers", "1", "--d-model", "16", "--seq", "8", "--batch", "2",
                              "--steps", "1", "--blocks", "2", "--warmup", "1"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    variants = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")][1:]
    assert variants == ["loaded", "eager", "local", "loaded-local"], out
    assert "# communication per step: eager" in out


def test_without_collectives_skips_every_collective_of_a_replicate_program(monkeypatch):
    from profile_step import _without_collectives

    import torch
    from spmd_aot.interpreter.program import Program
    from spmd_aot.format.serialize import DecodedNode, Ref

    c10d = torch.ops._c10d_functional
    nodes = [DecodedNode("placeholder", "x", "x", (), {}),
             DecodedNode("call_function", "mul", torch.ops.aten.mul.Tensor, (Ref(0), 2.0), {}),
             DecodedNode("call_function", "reduce", c10d.all_reduce_.default, (Ref(1), "avg", "0"), {}),
             DecodedNode("call_function", "wait", c10d.wait_tensor.default, (Ref(2),), {}),
             DecodedNode("output", "output", "output", ([Ref(3)],), {})]
    program = Program(nodes, {})
    assert _without_collectives(program) == 2
    out = program(torch.ones(3))  # no process group exists: a collective left in would fail
    assert torch.equal(out[0], torch.full((3,), 2.0))


def test_bench_start_quick_prints_every_row(tmp_path, monkeypatch, capsys):
    """tools/bench/bench_start.py --quick: fresh processes for eager and the hit, steady steps
    interleaved here; the kernel row and the aot_compile / AOTInductor rows (Inductor compiles
    before the runs) are left out; every child's parameters match eager's."""
    import bench_start

    state = os.environ.get("XDG_STATE_HOME")
    figures = tmp_path / "start.json"
    assert bench_start.main(["--quick", "--json", str(figures), "--plot", str(tmp_path / "start.svg")]) == 0
    assert (tmp_path / "start.svg").read_text().count("<rect") >= 4  # two rows, two bars each
    out = capsys.readouterr().out
    assert os.environ.get("XDG_STATE_HOME") == state  # the run's own state dir is not left behind
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(bench_start.VARIANTS) <= set(rows)
    assert bench_start.KERNELS_SKIPPED in rows["spmd-aot hit + kernels"]  # compiling is not for a smoke run
    assert bench_start.COMPILED_SKIPPED in rows[bench_start.AOT_COMPILE]
    assert bench_start.COMPILED_SKIPPED in rows[bench_start.AOTI]
    assert "# parity, spmd-aot hit: max |param - eager| after 3 steps" in out
    starts = json.loads(figures.read_text())["starts"]
    hit, eager = starts["spmd-aot hit"][0], starts["eager"][0]
    assert hit["parity"] <= bench_start.PARITY_LIMIT and eager["parity"] == 0
    assert 0 < hit["ready_s"] <= hit["first_s"] < hit["start_to_first_s"]
    assert eager["ready_s"] is None and 0 < eager["first_s"] < eager["start_to_first_s"]
    over = rows["spmd-aot hit"].split("|")[5].strip()  # the paired difference from eager's start
    paired = statistics.median(h["start_to_first_s"] - e["start_to_first_s"]
                               for h, e in zip(starts["spmd-aot hit"], starts["eager"]))
    assert over == f"{paired:+.3f} s" and rows["eager"].split("|")[5].strip() == "-"
    own = statistics.median(h["setup_s"] + h["first_s"] - e["setup_s"] - e["first_s"]
                            for h, e in zip(starts["spmd-aot hit"], starts["eager"]))
    assert rows["spmd-aot hit"].split("|")[6].strip() == f"{own:+.3f} s"
    assert 0 < hit["setup_s"] and 0 <= eager["setup_s"] < hit["setup_s"]  # eager imports no spmd_aot


def test_context_and_expert_parallel_rows_match_their_eager_references(tmp_path, monkeypatch, capsys):
    """--context-parallel and --expert-parallel: cp at world 2, dp_shard x cp and dp_shard x ep at
    world 4, each loaded from its artifact and doing the same training as its eager reference."""
    rows_file = tmp_path / "rows.json"
    import bench_step

    monkeypatch.setattr(bench_step, "rank_context", preloaded_context)
    code = bench_step.main(["--quick", "--context-parallel", "--expert-parallel", "--layers", "1", "--d-model", "16",
                            "--seq", "8", "--json", str(rows_file), "--plot", str(tmp_path / "chart.svg")])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    rows = json.loads(rows_file.read_text())["rows"]
    assert [(r["world"], r["placement"], r["eager_kind"]) for r in rows] == [
        (2, "cp", "eager, whole seq"), (4, "shard x cp", "FSDP2 dp 2, whole seq"), (4, "shard x ep", "FSDP2")]
    for r in rows:
        assert r["cache_hit"] and r["loaded_ms"] > 0 and r["eager_ms"] > 0 and r["ops"] > 0
        assert r["delta_loss"] < 1e-4, r  # cp: the cp ranks' mean loss is the unsplit sequence's
    assert "torch's own context_parallel does not run on CPU/gloo" in out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows) and all(line.split("|")[10].strip() == "-" for line in table[1:])
