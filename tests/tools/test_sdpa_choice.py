"""tools/bench/sdpa_choice.py: the table of SDPA kernels eager picks, as a lent GPU will print it."""

from __future__ import annotations

import json

import sdpa_choice  # a tool: pytest puts tools/ on sys.path (pyproject.toml)


def test_the_table_covers_the_grid_and_names_a_backend_per_call(tmp_path, capsys):
    out = tmp_path / "sdpa.json"
    assert sdpa_choice.main(["--device", "cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    grid = list(sdpa_choice.grid())
    assert len(data["rows"]) == len(grid) > 100
    backends = {r["backend"] for r in data["rows"]}
    assert backends <= {"MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "OVERRIDEABLE"}, backends
    # on CPU dropout rules out the flash kernel: the table must tell calls apart
    assert {r["backend"] for r in data["rows"] if r["dropout"]} == {"MATH"}
    assert data["facts"]["torch"] and "flags" in data["facts"]
    assert "| dtype | head dim |" in capsys.readouterr().out
