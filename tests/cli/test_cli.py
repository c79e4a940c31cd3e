"""Tests for the ``spmd-aot`` command line (in-process via ``main``, plus one real subprocess)."""

from __future__ import annotations

import io
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from support.jobs import MLP_JOB_FILE as JOB_FILE
from spmd_aot.cli.app import main
from spmd_aot.cli.progress import Progress
from spmd_aot.store import LocalStore

REPO = pathlib.Path(__file__).resolve().parents[2]


def _rows(out: str) -> list[list[str]]:
    """Table rows under the header line (the first line), split on whitespace."""
    lines = [line for line in out.splitlines() if line.strip()]
    return [line.split() for line in lines[1:]]


@pytest.fixture(scope="module")
def job_file(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("job") / "mlp_job.py"
    path.write_text(JOB_FILE)
    return path


@pytest.fixture(scope="module")
def built(job_file, tmp_path_factory):
    """A cache with the MLP job built for world sizes 1 and 2; returns (cache, stdout, stderr, rc)."""
    cache = tmp_path_factory.mktemp("cache")
    capture = pytest.MonkeyPatch()
    out, err = io.StringIO(), io.StringIO()
    capture.setattr(sys, "stdout", out)
    capture.setattr(sys, "stderr", err)
    try:
        rc = main(["build", f"{job_file}:job", "--world-size", "1", "--world-size", "2",
                   "--cache-dir", str(cache)])
    finally:
        capture.undo()
    return cache, out.getvalue(), err.getvalue(), rc


@pytest.fixture
def cache_copy(built, tmp_path) -> pathlib.Path:
    """A private copy of the built cache, for tests that damage or extend it."""
    dest = tmp_path / "cache"
    shutil.copytree(built[0], dest)
    return dest


def _artifacts(cache) -> dict[int, tuple[str, str]]:
    """world size -> (key, manifest digest)."""
    from spmd_aot.entries import read_manifest

    store = LocalStore(cache)
    return {read_manifest(store, d)["plan"]["world_size"]: (k, d) for k, d in store.refs().items()}


# ---------------------------------------------------------------------------- build
def test_build_table_then_cached(built, job_file, capsys):
    cache, out, err, rc = built
    assert rc == 0, err
    rows = _rows(out)
    assert len(rows) == 2
    assert out.splitlines()[0].split() == ["CONFIG", "KEY", "DIGEST", "NODES", "COLLECTIVES",
                                           "SECONDS", "STATUS"]
    assert [r[-1] for r in rows] == ["built", "built"]
    assert "world=1" in out and "world=2" in out and "replicate cpu" in out
    arts = _artifacts(cache)
    assert {r[4] for r in rows} == {arts[1][0][:12], arts[2][0][:12]}  # key column
    # progress: stderr is not a TTY here, so one line per finished config
    assert "[1/2]" in err and "[2/2]" in err and "\r" not in err

    assert main(["build", f"{job_file}:job", "-w", "1", "-w", "2", "--cache-dir", str(cache)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r[-1] for r in rows] == ["cached", "cached"]


def test_build_accepts_module_target_and_callable(tmp_path, capsys, monkeypatch):
    """'module:func' imports from the current directory, as `python -m` does (the installed
    `spmd-aot` script's sys.path starts with its bin directory, not the current directory)."""
    (tmp_path / "cli_mod_job.py").write_text(JOB_FILE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    rc = main(["build", "cli_mod_job:make_job", "-w", "2", "--cache-dir", str(tmp_path / "c")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert _rows(out)[0][-1] == "built"


# ---------------------------------------------------------------------------- bad targets
@pytest.mark.parametrize("target, expect", [
    ("no_such_module_xyz:job", ["module 'no_such_module_xyz' not found", "pkg.module:job"]),
    ("{job}:missing", ["has no attribute 'missing'", "expected"]),
    ("{job}:not_a_job", ["is a int, not a Job", "expected"]),
    ("{job}", ["is malformed", "path/to/file.py:job"]),
    ("{dir}/nope.py:job", ["not found", "expected"]),
    ("os.path:join", ["raised TypeError", "zero-argument function"]),
])
def test_bad_target_exits_2(target, expect, job_file, tmp_path, capsys):
    target = target.format(job=job_file, dir=tmp_path)
    rc = main(["build", target, "-w", "1", "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: TARGET")
    for fragment in expect:
        assert fragment in last


def test_usage_errors_exit_2(job_file, tmp_path, capsys):
    assert main(["build", f"{job_file}:job", "-w", "0", "--cache-dir", str(tmp_path)]) == 2
    assert main(["build", f"{job_file}:job", "-w", "1", "-p", "nonsense"]) == 2
    assert main([]) == 2
    assert "positive integer" in capsys.readouterr().err


# ---------------------------------------------------------------------------- ls
def test_ls_lists_every_ref(built, capsys):
    cache = built[0]
    assert main(["ls", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)[:-1]  # last line: "2 artifacts in ..."
    assert len(rows) == 2
    arts = _artifacts(cache)
    by_world = {int(r[2]): r for r in rows}
    assert by_world[2][:2] == [arts[2][0][:12], arts[2][1][:12]]
    assert by_world[2][3:5] == ["replicate", "cpu"]
    assert int(by_world[2][6]) > 0 and int(by_world[1][6]) == 0  # collectives
    assert all(int(r[7]) > 0 for r in rows)  # bytes


def test_ls_empty_and_missing_cache(tmp_path, capsys, monkeypatch):
    assert main(["ls", "--cache-dir", str(tmp_path / "nope")]) == 2  # as show, rm, gc, verify
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()  # listing does not create a cache
    monkeypatch.setenv("SPMD_AOT_CACHE_DIR", str(tmp_path / "empty"))
    LocalStore(tmp_path / "empty")
    assert main(["ls"]) == 0
    assert "no artifacts in" in capsys.readouterr().out


def test_ls_flags_damaged_entries(cache_copy, capsys):
    store = LocalStore(cache_copy)
    (cache_copy / "refs" / "damaged").write_text("not a digest\n")
    store.set_ref("dangling", "ab" * 32)
    assert main(["ls", "--cache-dir", str(cache_copy)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:-1]}
    assert len(lines) == 4
    assert "CORRUPT:" in lines["damaged"] and "CORRUPT:" in lines["dangling"]
    assert sum("CORRUPT" in line for line in lines.values()) == 2


# ---------------------------------------------------------------------------- show
def test_show_by_prefix_and_code(built, capsys):
    cache = built[0]
    key, digest = _artifacts(cache)[2]
    assert main(["show", key[:8], "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert key in out and digest in out
    assert "world=2" in out and "all_reduce" in out  # stats by kind
    assert "step_code" in out and "ingredients:" in out
    assert "def forward" not in out

    assert main(["show", digest[:10], "--code", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "def forward" in out and "all_reduce" in out.split("code:", 1)[1]

    key1, _ = _artifacts(cache)[1]
    assert main(["show", key1, "--code", "--cache-dir", str(cache)]) == 0
    assert "all_reduce" not in capsys.readouterr().out.split("code:", 1)[1]


def test_show_unknown_and_ambiguous_ref(cache_copy, capsys):
    assert main(["show", "zzzz", "--cache-dir", str(cache_copy)]) == 2
    assert "no artifact matches 'zzzz'" in capsys.readouterr().err

    store = LocalStore(cache_copy)
    arts = _artifacts(cache_copy)
    store.set_ref("feed01", arts[1][1])
    store.set_ref("feed02", arts[2][1])
    assert main(["show", "feed", "--cache-dir", str(cache_copy)]) == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and "feed01" in err and "feed02" in err
    assert main(["show", "feed02", "--cache-dir", str(cache_copy)]) == 0
    assert "world=2" in capsys.readouterr().out


# ---------------------------------------------------------------------------- verify
def test_verify_clean_then_flipped_byte(cache_copy, capsys):
    assert main(["verify", "--cache-dir", str(cache_copy)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "11 blobs, 2 artifacts checked, 0 problems"

    from spmd_aot.entries import read_manifest

    store = LocalStore(cache_copy)
    key, digest = _artifacts(cache_copy)[2]
    code_digest = read_manifest(store, digest)["blobs"]["code"]
    path = store.blob_path(code_digest)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))

    assert main(["verify", "--cache-dir", str(cache_copy)]) == 1
    out = capsys.readouterr().out
    assert code_digest in out and str(path) in out
    assert f"artifact {key[:12]}" in out  # the artifact using the blob is named too
    assert out.strip().splitlines()[-1] == "11 blobs, 2 artifacts checked, 2 problems"
    assert path.exists()  # verify reports; it does not move anything to quarantine


def test_verify_reads_artifacts_not_just_blobs(cache_copy, capsys):
    """A manifest naming a blob that is gone passes the blob re-hash but not the full read."""
    from spmd_aot.entries import read_manifest

    store = LocalStore(cache_copy)
    _, digest = _artifacts(cache_copy)[1]
    store.delete(read_manifest(store, digest)["blobs"]["layout"])
    assert main(["verify", "--cache-dir", str(cache_copy)]) == 1
    out = capsys.readouterr().out
    assert "missing" in out and out.strip().endswith("1 problem")


# ---------------------------------------------------------------------------- progress
class _FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_on_a_tty():
    stream = _FakeTTY()
    with Progress(2, stream=stream, refresh=0) as bar:
        bar.start("world=1 a")
        bar.finish("built")
        bar.start("world=2 b")
        bar.finish("cached")
    text = stream.getvalue()
    assert text.count("\r") >= 4 and text.endswith("\n") and text.count("\n") == 1
    assert "1/2 world=1 a" in text and "2/2 done" in text and "s" in text


def test_progress_lines_when_not_a_tty():
    stream = io.StringIO()
    with Progress(2, stream=stream) as bar:
        bar.start("cfg-a")
        bar.finish("built")
    assert stream.getvalue().startswith("[1/2] cfg-a: built in ")


# ---------------------------------------------------------------------------- entry point
def test_python_dash_m_entry_point(job_file, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("SPMD_AOT_CACHE_DIR", None)
    good, bad = [  # both at once: each interpreter's start-up is most of its time
        subprocess.Popen([sys.executable, "-m", "spmd_aot", "build", *args, "--cache-dir", str(tmp_path / "c")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        for args in ([f"{job_file}:job", "--world-size", "2"], ["nope_mod:job", "-w", "1"])]
    (out, err), (_, bad_err) = good.communicate(timeout=120), bad.communicate(timeout=120)
    assert good.returncode == 0, err
    assert "world=2 mesh=2 replicate cpu" in out and "built" in out
    assert "[1/1]" in err
    assert bad.returncode == 2 and "error: TARGET 'nope_mod:job'" in bad_err
