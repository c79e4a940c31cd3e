"""The CLI behaves like a well-kept Unix tool: quiet on a closed pipe, ``--version``, the
documented exit statuses, and hints that are complete commands which work when pasted."""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from support.jobs import MLP_JOB_FILE as JOB_FILE
from spmd_aot.cli import parser as cli_parser, report
from spmd_aot.cli.build import plan_for
from spmd_aot.cli.app import main
from spmd_aot.hints import build_command
from spmd_aot.parallel.plan import Plan

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(job file, cache) with the MLP job built for world size 1."""
    job_file = tmp_path_factory.mktemp("job") / "conventions_job.py"
    job_file.write_text(JOB_FILE)
    cache = tmp_path_factory.mktemp("cache")
    assert main(["build", f"{job_file}:job", "-w", "1", "--cache-dir", str(cache)]) == 0
    return job_file, cache


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("SPMD_AOT_CACHE_DIR", None)
    return env


def test_closed_stdout_exits_quietly_like_a_unix_tool(built, capsys):
    """`spmd-aot show REF --code | head`: the reader has gone before the first write."""
    _, cache = built
    main(["ls", "--cache-dir", str(cache)])
    key = capsys.readouterr().out.splitlines()[1].split()[0]
    proc = subprocess.Popen([sys.executable, "-m", "spmd_aot", "show", key, "--code", "--cache-dir", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=REPO)
    proc.stdout.close()  # the read end is closed before the CLI has even imported torch
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == report.EXIT_PIPE == 141
    assert err == ""  # no traceback, no "Exception ignored ... BrokenPipeError"


def test_version(capsys):
    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("spmd-aot ") and "torch 2." in out


@pytest.mark.parametrize("argv", [["ls"], ["show", "abc"], ["verify"], ["rm", "abc"], ["gc"],
                                  ["export", "abc", "-o", "b.tar"], ["push", "--to", "elsewhere"]])
def test_a_missing_cache_directory_is_exit_2_for_every_command_reading_it(argv, tmp_path, capsys):
    missing = tmp_path / "no-such-cache"
    assert main([*argv, "--cache-dir", str(missing)]) == report.EXIT_ERROR == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cache directory") and str(missing) in err and "does not exist" in err
    assert not missing.exists()


def test_exit_statuses_for_answers_and_bugs(built, tmp_path, capsys, monkeypatch):
    job_file, cache = built
    # explain: 0 hit, 1 miss (also when the cache does not exist: the answer is still "no")
    assert main(["explain", f"{job_file}:job", "-w", "1", "--cache-dir", str(cache)]) == 0
    assert main(["explain", f"{job_file}:job", "-w", "3", "--cache-dir", str(cache)]) == 1
    assert main(["explain", f"{job_file}:job", "-w", "1", "--cache-dir", str(tmp_path / "none")]) == 1
    capsys.readouterr()

    def bug(args):
        raise ValueError("a bug")

    monkeypatch.setattr(cli_parser, "cmd_ls", bug)
    assert main(["ls", "--cache-dir", str(cache)]) == report.EXIT_BUG == 3  # never 1, which means "problems found"
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("error: unexpected ValueError: a bug")


def test_explain_hint_is_a_command_that_builds_what_was_missing(built, capsys):
    """Pasted as printed, the hint builds exactly the missing configuration into the same cache."""
    job_file, cache = built
    argv = ["-w", "4", "-p", "shard", "--mesh-shape", "2x2", "--param-placement", "*.bias=replicate",
            "--keep-params-after-forward", "--cache-dir", str(cache)]
    capsys.readouterr()
    assert main(["explain", f"{job_file}:job", *argv]) == 1
    hint = [line for line in capsys.readouterr().out.splitlines() if "build it with:" in line]
    command = shlex.split(hint[0].split("build it with:", 1)[1])
    assert command[:3] == ["spmd-aot", "build", f"{job_file}:job"] and "--cache-dir" in command
    assert main(command[1:]) == 0
    assert main(["explain", f"{job_file}:job", *argv]) == 0  # now a hit


@pytest.mark.parametrize("plan", [
    Plan(2),
    Plan(8, "shard", "cuda", (2, 4), (("*.bias", "replicate"),), bucket_cap_mb=10, first_bucket_cap_mb=0.5,
         shard_groups=("blocks.*", "head.*"), reshard_after_forward=False),
    Plan(4, "replicate", bucket_cap_mb=12.345678901),
    Plan(2, tp_plan=(("blocks.*.q", "colwise"), ("blocks.*.o", "rowwise"))),
    Plan(8, "shard", mesh_shape=(4, 2), tp_plan=(("blocks.*.q", "colwise"),), reshard_after_forward=False),
], ids=["default", "every-option", "odd-bucket", "tp", "fsdp-x-tp"])
def test_build_command_parses_back_to_the_same_plan(plan):
    """What a hint prints is what the CLI builds: parsed by the CLI's own parser."""
    words = shlex.split(build_command(plan, target="my job.py:job", cache_dir="/tmp/a cache"))
    assert words[:3] == ["spmd-aot", "build", "my job.py:job"]
    args = cli_parser.parser().parse_args(words[1:])
    assert args.cache_dir == "/tmp/a cache"
    assert plan_for(args, args.world_size[0], args.placement[0]) == plan


def test_verbose_logs_info_lines(built, caplog, capsys):
    import logging

    job_file, cache = built
    try:
        assert main(["build", "-v", f"{job_file}:job", "-w", "1", "--cache-dir", str(cache)]) == 0
    finally:
        logging.getLogger("spmd_aot").setLevel(logging.NOTSET)
    assert [r.getMessage().split(":")[0] for r in caplog.records
            if r.levelno == logging.INFO and "already cached" in r.getMessage()] == ["build world=1 mesh=1 replicate cpu"]
