"""tools/bench/bench_start.py --fresh-node's table: the ready span's CPU ms (median and best) and
the best wall time beside the median, per row, and the phases in CPU ms (no processes here: the
table of given runs)."""

from __future__ import annotations


def _run(ready, cpu, phase):
    return {"ready_s": ready, "ready_cpu_s": cpu, "first_s": ready + 0.05, "setup_s": 0.01,
            "validate_imported": False, "phases": {"cache key": phase}}


def test_the_fresh_node_table_reports_cpu_and_best_wall_per_row():
    import bench_start

    runs = {row: [_run(0.2, 0.050, 0.009), _run(0.1, 0.040, 0.008), _run(0.3, 0.045, 0.010)]
            for row in bench_start.FRESH_ROWS}
    text = bench_start.fresh_table({"layers": 12, "d_model": 128, "seq": 64, "batch": 2}, runs)
    first = next(line for line in text.splitlines() if line.startswith(f"| {bench_start.FRESH_ROWS[0]} |"))
    assert "| 0.200 s | 0.100 s | 45.0 (40.0) |" in first  # median and best wall; median (best) CPU ms
    assert "| cache key | 9.0 | 9.0 | 9.0 | 9.0 |" in text and "CPU ms" in text
