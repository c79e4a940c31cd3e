"""One definition of every option (``spmd_aot/options.py``) drives the API, the command line,
its ``--help``, the build hints and ``docs/options.md``.

Why: options written in several places drift apart: a flag the API lacks, an API keyword the
CLI cannot say, a hint that builds something else than what missed. These tests hold every
field to a documentation, a command-line form (or a stated reason for none) and one meaning
through every entry point, including the key a build stores its entry under.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shlex

import pytest
import torch
from support.jobs import MLP_JOB_FILE as JOB_FILE

import spmd_aot
from spmd_aot import ParallelOptions, RunOptions
from spmd_aot.cli import option_flags
from spmd_aot.cli.app import main
from spmd_aot.cli.build import plan_for
from spmd_aot.cli.option_flags import OPTION_CLASSES, first_sentence, reference_table
from spmd_aot.cli.parser import parser
from spmd_aot.errors import SpmdAotError
from spmd_aot.hints import build_command
from spmd_aot.options import Flag, option

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIELDS = [(cls, f) for cls in OPTION_CLASSES for f in dataclasses.fields(cls)]
#: Fields a command line cannot give: Python objects, or a choice only a running job makes.
API_ONLY = {"store", "require_hit", "module_override", "gm_transformation", "extra_sources"}


def _help(capsys, *argv) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("cls, field", FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in FIELDS])
def test_every_option_has_documentation_and_a_flag_or_a_reason(cls, field, capsys):
    doc = field.metadata["doc"]
    assert doc and doc[0].isupper() and doc.endswith("."), doc
    flag = field.metadata["flag"]
    if flag is None:
        assert field.name in API_ONLY and field.metadata["api_only"]
        return
    assert field.name not in API_ONLY
    line = flag.help or first_sentence(doc)
    assert line.endswith(".") and len(line) <= 240, line  # a --help line, not a paragraph
    for command in ("build", "explain") if "*" not in flag.commands else ("build", "explain", "ls", "gc"):
        if "*" in flag.commands or command in flag.commands:
            assert flag.flag in _help(capsys, command), (command, flag.flag)


def test_flags_are_unique_and_each_group_is_a_help_section(capsys):
    flags = [name for _, f in FIELDS if f.metadata["flag"] is not None
             for name in (f.metadata["flag"].flag, f.metadata["flag"].short) if name]
    assert len(flags) == len(set(flags))
    text = _help(capsys, "build")
    for _, f in FIELDS:
        if f.metadata["flag"] is not None:
            assert f"\n{f.metadata['flag'].group}:\n" in text, f.metadata["flag"].group


def test_build_help_shows_argument_groups_and_an_example_that_parses(capsys):
    text = _help(capsys, "build")
    for group in ("what to build", "data parallel", "communication", "tensor parallel", "mixed precision",
                  "cache and trust"):
        assert f"\n{group}:\n" in text
    example = text.split("\nexample:\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    words = shlex.split(example)
    assert words[:2] == ["spmd-aot", "build"]
    args = parser().parse_args(words[1:])
    plans = [plan_for(args, w, p) for w in args.world_size for p in args.placement]
    assert [p.describe() for p in plans] == ["world=8 mesh=8 replicate mp=bf16/bf16 cpu",
                                             "world=8 mesh=2x4 shard +1 overrides mp=bf16/bf16 cpu"]


def test_a_build_naming_several_placements_gives_each_only_the_options_it_reads():
    args = parser().parse_args(["build", "x:job", "-w", "4", "-p", "replicate", "-p", "shard",
                                "--mesh-shape", "2x2", "--shard-group", "blocks.*", "--bucket-cap-mb", "8"])
    replicate, shard = (plan_for(args, 4, p) for p in args.placement)
    assert (replicate.mesh_shape, replicate.shard_groups, replicate.bucket_cap_mb) == ((4,), (), 8.0)
    assert (shard.mesh_shape, shard.shard_groups, shard.bucket_cap_mb) == ((2, 2), ("blocks.*",), 8.0)
    with_tp = parser().parse_args(["build", "x:job", "-w", "4", "-p", "replicate", "--mesh-shape", "2x2",
                                   "--tp-plan", "a.b=colwise"])
    assert plan_for(with_tp, 4, "replicate").mesh_roles == ("dp_replicate", "tp")  # another axis: every placement's


@pytest.mark.parametrize("command", ["build", "explain"])
def test_an_option_no_named_placement_reads_is_refused_with_the_fix(command, capsys):
    """``--mesh-shape 2x2`` for 'replicate' alone would build a 1-D mesh: not what was asked."""
    assert main([command, "x:job", "-w", "4", "--mesh-shape", "2x2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --mesh-shape applies to placement 'shard' (or with another axis, e.g. --tp-plan) only, and this "
        "command's placement is 'replicate': add -p shard or drop --mesh-shape")
    assert main([command, "x:job", "-w", "4", "-p", "replicate", "--keep-params-after-forward"]) == 2
    assert "--keep-params-after-forward applies to placement 'shard' only" in capsys.readouterr().err


def test_every_field_prints_as_a_hint_that_parses_back_to_the_same_plan():
    options = ParallelOptions("shard", mesh_shape=(2, 2, 2), param_placements={"*.bias": "replicate"},
                              bucket_cap_mb=12.5, first_bucket_cap_mb=0.5, shard_groups=("blocks.*",),
                              reshard_after_forward=False, tp_plan={"blocks.*.q": "colwise"},
                              param_dtype=torch.bfloat16, reduce_dtype="fp32", output_dtype="fp32",
                              cast_forward_inputs=False)
    changed = {f.name for f in dataclasses.fields(options) if getattr(options, f.name) != f.default}
    assert changed >= {"placement", "mesh_shape", "param_placements", "bucket_cap_mb", "first_bucket_cap_mb",
                       "shard_groups", "reshard_after_forward", "tp_plan", "param_dtype", "reduce_dtype",
                       "output_dtype", "cast_forward_inputs"}
    plan = options.plan(8, "cuda")
    words = shlex.split(build_command(plan, target="job.py:job"))
    args = parser().parse_args(words[1:])
    assert plan_for(args, 8, "shard") == plan
    assert ParallelOptions.from_plan(plan) == options


def test_the_cli_and_the_api_store_the_same_key(tmp_path, capsys):
    job_file = tmp_path / "options_job.py"
    job_file.write_text(JOB_FILE)
    argv = ["-w", "4", "-p", "shard", "--mesh-shape", "2x2", "--param-placement", "*.bias=replicate",
            "--keep-params-after-forward", "--bucket-cap-mb", "10", "--param-dtype", "bf16", "--reduce-dtype", "fp32"]
    assert main(["build", f"{job_file}:job", *argv, "--cache-dir", str(tmp_path / "cli")]) == 0
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    cli_key = row[row.index("cpu") + 1]  # CONFIG (its words, the device last), KEY, ...
    assert len(cli_key) == 12

    job = spmd_aot.load_target(f"{job_file}:job")
    parallel = ParallelOptions("shard", mesh_shape=(2, 2), param_placements={"*.bias": "replicate"},
                               reshard_after_forward=False, bucket_cap_mb=10, param_dtype=torch.bfloat16,
                               reduce_dtype="fp32")
    api = spmd_aot.build(job, parallel=parallel, run=RunOptions(cache_dir=tmp_path / "api"), world_size=4)
    assert api.traced and api.key[:12] == cli_key
    # the keywords and the earlier Schema spelling make the same options: the CLI's entry serves them
    keywords = spmd_aot.build(job, world_size=4, placement="shard", mesh_shape=(2, 2),
                              param_placements={"*.bias": "replicate"}, reshard_after_forward=False,
                              bucket_cap_mb=10, mixed_precision={"param_dtype": "bf16", "reduce_dtype": "fp32"},
                              cache_dir=tmp_path / "cli")
    assert not keywords.traced and keywords.key == api.key
    schema = spmd_aot.Schema("shard", mesh_shape=(2, 2), param_placements={"*.bias": "replicate"},
                             comm=spmd_aot.Comm(bucket_cap_mb=10, reshard_after_forward=False),
                             mixed_precision=spmd_aot.MixedPrecisionPolicy("bf16", "fp32"))
    assert schema == parallel


def test_every_entry_point_takes_the_objects_or_their_keywords_not_both(tmp_path):
    from spmd_aot.examples.models import train_step

    step = spmd_aot.compile(train_step, placement="shard", mesh_shape=(2, 2), cache_dir=tmp_path, require_hit=True)
    assert step.parallel_options == ParallelOptions("shard", mesh_shape=(2, 2))
    assert step.run_options == RunOptions(cache_dir=tmp_path, require_hit=True)
    parallel = ParallelOptions("shard")
    assert spmd_aot.compile(parallel=parallel)(train_step).parallel_options is parallel
    assert spmd_aot.CompiledStep(train_step, schema=parallel).parallel_options is parallel
    with pytest.raises(TypeError, match="pass mesh_shape in the ParallelOptions"):
        spmd_aot.compile(train_step, parallel=parallel, mesh_shape=(2,))
    with pytest.raises(TypeError, match="pass cache_dir in the RunOptions"):
        spmd_aot.compile(train_step, run=RunOptions(), cache_dir=tmp_path)
    with pytest.raises(TypeError, match=r"placemnt.*docs/options.md"):
        spmd_aot.compile(train_step, placemnt="shard")
    with pytest.raises(TypeError, match="world_size"):
        spmd_aot.build(spmd_aot.Job(train_step, torch.nn.Linear(2, 2), None, lambda: ()), placement="shard")

    wrapper = spmd_aot.SPMD(torch.nn.Linear(2, 2), parallel, cache_dir=tmp_path)
    assert wrapper.parallel is parallel and wrapper._step.run_options.cache_dir == tmp_path
    with pytest.raises(TypeError, match="in the ParallelOptions"):
        spmd_aot.SPMD(torch.nn.Linear(2, 2), placement="shard")
    # checked when made, naming the fix
    with pytest.raises(SpmdAotError, match="placement 'shard'"):
        ParallelOptions(mesh_shape=(2, 2))


def test_a_new_field_is_one_definition(monkeypatch, capsys):
    """What another axis adds: one field, whose flag, --help group and table row follow."""
    @dataclasses.dataclass(frozen=True)
    class WithDemo:
        demo_degree: int = option(1, "Demo parallel: ranks along a demo mesh dimension. Nothing else.",
                                  Flag("--demo-degree", "demo parallel", metavar="N", parse=int))

    monkeypatch.setattr(option_flags, "OPTION_CLASSES", (WithDemo, RunOptions))
    p = argparse.ArgumentParser()
    option_flags.add_option_flags(p, "build")
    args = p.parse_args(["--demo-degree", "3"])
    assert option_flags.given(args, WithDemo) == {"demo_degree": 3}
    p.print_help()
    assert "demo parallel: --demo-degree N Demo parallel: ranks along a demo mesh dimension. Default: 1." \
        in " ".join(capsys.readouterr().out.split())
    assert "| `demo_degree` | `--demo-degree` `N` | `1` |" in option_flags.reference_table()


def test_docs_options_table_is_the_generated_one():
    text = (ROOT / "docs" / "options.md").read_text()
    table = text.split(option_flags.TABLE_BEGIN, 1)[1].split(option_flags.TABLE_END, 1)[0].strip()
    assert table == reference_table().strip(), (
        "docs/options.md's table is not the fields': run `python -m spmd_aot.cli.option_flags docs/options.md`")


def test_every_plan_field_is_an_option():
    """A Plan field without an option could be stored and hashed but never asked for: the CLI, the
    hints (``ParallelOptions.from_plan``) and the API would each lose it."""
    from spmd_aot.parallel.plan import Plan

    derived = {"world_size", "device_type", "mixed_precision"}  # the build's arguments; four option fields
    plan_fields = {f.name for f in dataclasses.fields(Plan) if f.init} - derived
    assert plan_fields <= {f.name for f in dataclasses.fields(ParallelOptions)}
