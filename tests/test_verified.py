"""A load remembers that an artifact passed its meta check, in a per-user record outside the
cache, and later loads of the same artifact by the same checker skip the meta run; another
artifact, other load limits, a record folder others can write, and ``verify`` check in full."""

from __future__ import annotations

import os

import pytest
import torch

from support.jobs import build_unsigned
from spmd_aot.format import validate
from spmd_aot.format import verified
from spmd_aot.format.artifact import read_artifact
from spmd_aot.cli.app import main as cli
from spmd_aot.format.limits import ENV_LOAD_LIMITS
from spmd_aot.store import LocalStore


@pytest.fixture
def counted(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    calls = []
    real = validate.check_graph
    monkeypatch.setattr(validate, "check_graph", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def _load(cache, digest):
    return read_artifact(LocalStore(cache), digest).program(["0"], torch.device("cpu"))


def test_second_load_of_an_artifact_skips_the_meta_check(tmp_path, counted, monkeypatch, capsys):
    cache = tmp_path / "cache"
    digest = build_unsigned(cache).digest
    _load(cache, digest)
    assert len(counted) == 1 and verified.known(digest)
    _load(cache, digest)
    assert len(counted) == 1  # remembered
    assert cli(["verify", "--cache-dir", str(cache)]) == 0
    assert len(counted) == 2  # verify never trusts the record
    monkeypatch.setenv(ENV_LOAD_LIMITS, "tensor_factor=32")
    _load(cache, digest)
    assert len(counted) == 3  # other limits: another checker
    other = build_unsigned(tmp_path / "cache2", optim_name="adamw").digest
    _load(tmp_path / "cache2", other)
    assert len(counted) == 4


def test_a_record_folder_others_can_write_is_not_used(tmp_path, counted):
    cache = tmp_path / "cache"
    digest = build_unsigned(cache).digest
    _load(cache, digest)
    os.chmod(verified.record_dir(), 0o777)
    assert not verified.known(digest)
    _load(cache, digest)
    assert len(counted) == 2
