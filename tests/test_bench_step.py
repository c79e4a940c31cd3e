"""tools/bench_step.py runs end to end on real gloo ranks: a row per configuration, a chart.

Smoke test only (no timing assertions): the benchmark is what the lead measures with.
"""

import json
import os
import xml.etree.ElementTree as ET

from multiproc import preloaded_context

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


def test_quick_run_prints_a_row_per_configuration_and_writes_a_chart(tmp_path, monkeypatch, capsys):
    """The tool's main() in this process (its ranks forked from the tests' preloaded server),
    on a one-layer model."""
    rows_file, chart = tmp_path / "rows.json", tmp_path / "chart.svg"
    monkeypatch.syspath_prepend(TOOLS)
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
