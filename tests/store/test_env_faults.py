"""Environment faults (full disk, quota, file size limit, read-only cache, no permission, no
flock) become clear errors naming the path, the errno and the fix, never tracebacks; a job
whose miss cannot be stored still trains from its trace."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import spmd_aot
from spmd_aot.building import pipeline
from support.jobs import make_batch, make_job
from spmd_aot.cli.app import main as cli
from spmd_aot.errors import CacheIOError, CacheMissError, SpmdAotError
from spmd_aot.examples.models import MLP, train_step
from spmd_aot.store import LocalStore
from spmd_aot.store import local as local_module
from spmd_aot.store import locks as locks_module

TARGET = textwrap.dedent("""
    import torch, spmd_aot
    from spmd_aot.examples.models import MLP, train_step

    def job():
        return spmd_aot.Job(step=train_step, model=lambda: MLP(8, 16, 4),
                            optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                            batch=lambda: (torch.randn(4, 8), torch.randint(0, 4, (4,))))
""")


def _fail_writes(monkeypatch, code: int) -> None:
    def boom(fd, view):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(local_module, "_write_all", boom)


@pytest.mark.parametrize("code,fix", [(errno.ENOSPC, "filesystem is full"), (errno.EDQUOT, "quota"),
                                      (errno.EFBIG, "ulimit -f"), (errno.EROFS, "read-only"),
                                      (errno.EACCES, "owner or mode")])
def test_cli_build_reports_the_fault_without_a_traceback(tmp_path, monkeypatch, capsys, code, fix):
    (tmp_path / "target.py").write_text(TARGET)
    _fail_writes(monkeypatch, code)
    status = cli(["build", f"{tmp_path / 'target.py'}:job", "-w", "1", "--cache-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err and f"({errno.errorcode[code]})" in err and fix in err
    assert str(tmp_path / "c") in err  # names the path


def test_real_file_size_limit_is_reported(tmp_path):
    """RLIMIT_FSIZE for real, in a child process: EFBIG from the kernel, a clear message."""
    (tmp_path / "target.py").write_text(TARGET)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000)); "
            "from spmd_aot.cli.app import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "build", f"{tmp_path / 'target.py'}:job", "-w", "1",
                           "--cache-dir", str(tmp_path / "c")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "(EFBIG)" in proc.stderr and "Traceback" not in proc.stderr


def test_a_miss_that_cannot_be_stored_still_trains(tmp_path, monkeypatch, caplog):
    _fail_writes(monkeypatch, errno.ENOSPC)
    def fresh():
        torch.manual_seed(0)
        model = MLP(32, 64, 10)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    ref_model, ref_optim = fresh()
    expected = [train_step(ref_model, ref_optim, make_batch("mlp", 0, s)).item() for s in range(3)]
    model, optim = fresh()
    step = spmd_aot.compile(train_step, cache_dir=tmp_path / "full")
    traced = []
    real_trace = pipeline.trace_step
    monkeypatch.setattr(pipeline, "trace_step", lambda *a, **k: traced.append(1) or real_trace(*a, **k))
    with caplog.at_level(logging.WARNING, logger="spmd_aot"):
        losses = [step(model, optim, make_batch("mlp", 0, s)).item() for s in range(3)]
    assert not step.cache_info.hit and step.cache_info.source == "trace"
    assert len(traced) == 1 and step.cache_info.traces == 1  # the failed store keeps the trace's blobs
    assert losses == pytest.approx(expected, abs=1e-5)  # it trained, as eager does
    assert any("training from the trace" in r.getMessage() and "ENOSPC" in r.getMessage() for r in caplog.records)
    assert LocalStore(tmp_path / "full").refs() == {}  # nothing was stored
    strict = spmd_aot.compile(train_step, cache_dir=tmp_path / "full", require_hit=True)
    with pytest.raises(CacheMissError):
        strict(model, optim, make_batch("mlp", 0, 0))


def test_filesystem_without_flock_falls_back_to_posix_locks(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(locks_module.fcntl, "flock", no_flock)
    result = spmd_aot.build(make_job("mlp", "sgd"), world_size=1, cache_dir=tmp_path / "c")
    assert result.traced
    monkeypatch.setattr(locks_module.fcntl, "lockf", no_flock)
    with pytest.raises(SpmdAotError, match="neither flock nor POSIX locks") as info:
        with LocalStore(tmp_path / "c").lock("k"):
            pass
    assert "locks/k.lock" in str(info.value)


def test_store_errors_are_cache_io_errors(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "c")
    _fail_writes(monkeypatch, errno.ENOSPC)
    with pytest.raises(CacheIOError) as info:
        store.put(b"x")
    assert info.value.errno == errno.ENOSPC and str(store.root) in str(info.value)
    assert list((store.root / "tmp").iterdir()) == []  # the temp file was removed
