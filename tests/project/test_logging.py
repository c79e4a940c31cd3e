"""Job start logs through the standard ``logging`` module under ``spmd_aot`` and prints nothing:
one INFO line per step resolution, a WARNING (with why and how to build) when a miss traces."""

from __future__ import annotations

import logging
import shlex

import pytest

import spmd_aot
from support.jobs import compiled_run
from spmd_aot.cli.parser import parser


def _records(caplog, level):
    return [r for r in caplog.records if r.name.startswith("spmd_aot") and r.levelno == level]


def test_miss_warns_with_a_build_command_then_hit_logs_one_info_line(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="spmd_aot")
    *_, info = compiled_run("mlp", "sgd", 0, 1, 2, tmp_path)  # world 1, no process group
    assert not info.hit
    (warning,) = _records(caplog, logging.WARNING)
    text = warning.getMessage()
    assert f"cache miss for key {info.key[:12]}" in text and "The cache holds no artifacts." in text
    command = text.split("`")[1]
    assert command == f"spmd-aot build TARGET --world-size 1 --placement replicate --cache-dir {tmp_path}"
    (miss,) = _records(caplog, logging.INFO)
    assert "train_step: cache miss, traced by rank 0" in miss.getMessage() and info.key[:12] in miss.getMessage()

    caplog.clear()
    *_, info = compiled_run("mlp", "sgd", 0, 1, 2, tmp_path)  # a new job start: a hit
    assert info.hit and _records(caplog, logging.WARNING) == []
    (hit,) = _records(caplog, logging.INFO)
    assert hit.getMessage().startswith(f"train_step: cache hit on rank 0, key {info.key[:12]}")
    assert hit.getMessage().endswith(" s")  # the seconds the resolution took

    caplog.clear()  # require_hit: the error names what differs and the command that builds it
    with pytest.raises(spmd_aot.CacheMissError) as exc:
        compiled_run("mlp", "sgd", 0, 1, 1, tmp_path, batch_size=8, require_hit=True)
    message = str(exc.value)
    assert "differs in: batch (" in message and "..." not in message
    words = shlex.split(message.split("`")[1].replace("TARGET", "train.py:job"))
    args = parser().parse_args(words[1:])
    assert (args.world_size, args.placement, args.cache_dir) == ([1], ["replicate"], str(tmp_path))
    assert capsys.readouterr() == ("", "")  # library code prints nothing itself


def test_miss_hint_for_a_job_with_python_hooks_names_spmd_aot_build(tmp_path):
    """Hooks cannot be passed on the command line, so the hint is the Python call instead."""
    with pytest.raises(spmd_aot.CacheMissError) as exc:
        compiled_run("mlp", "sgd", 0, 1, 1, tmp_path, require_hit=True, gm_transformation=lambda gm: gm)
    message = str(exc.value)
    assert "spmd_aot.build(job, parallel=..., run=..., world_size=1)" in message
    assert "same ParallelOptions and RunOptions" in message
    assert "gm_transformation" in message and "spmd-aot build" not in message
