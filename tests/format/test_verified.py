"""A load remembers that an artifact passed its meta check, in a per-user record outside the
cache, and later loads of the same artifact by the same checker skip the meta run; another
artifact, other load limits, a record folder others can write, and ``verify`` check in full."""

from __future__ import annotations

import os

import pytest
import torch

from support.jobs import build_unsigned
from spmd_aot.format import validate
from spmd_aot.entries import verified
from spmd_aot.entries import read_artifact
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
    counted.clear()  # the build runs the load's checks too (never the record)
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
    counted.clear()
    _load(tmp_path / "cache2", other)
    assert len(counted) == 1


def test_a_record_folder_others_can_write_is_not_used(tmp_path, counted):
    cache = tmp_path / "cache"
    digest = build_unsigned(cache).digest
    counted.clear()
    _load(cache, digest)
    os.chmod(verified.record_dir(), 0o777)
    assert not verified.known(digest)
    _load(cache, digest)
    assert len(counted) == 2


# ------------------------------------------------------- the record folder, reached safely
# As root here, "someone else" is another uid given with os.chown. The rule (verified.private_dir):
# a walk from / following no link, every ancestor yours or root's and not writable by others
# unless sticky, the record folder and its parent yours or root's and writable by nobody else.
ATTACKER = 4242


def _recorded(tmp_path, monkeypatch, state):
    """A verified record for a made-up digest in ``state`` (XDG_STATE_HOME), written while
    ``state`` was the user's own: what the attacker would like the job to read."""
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    verified.remember("f" * 64, [None, ((2,), (1,), torch.float32)])
    assert verified.recall("f" * 64) == [None, ((2,), (1,), torch.float32)]
    return "f" * 64


def test_a_record_is_remembered_with_what_the_check_derived(tmp_path, monkeypatch):
    digest = _recorded(tmp_path, monkeypatch, tmp_path / "state")
    (path,) = list(verified.record_dir().iterdir())
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # damaged: checked again, the record removed
    path.write_bytes(bytes(data))
    assert verified.recall(digest) is None and not path.exists()


def test_a_directory_swapped_for_a_link_between_check_and_open_is_not_followed(tmp_path, monkeypatch):
    """The race: the path is resolved (no links), then an attacker who can write an ancestor
    swaps a component for a link to a folder holding a record (here the user's own, private
    one: the link alone must be enough to refuse). The walk opens each component with
    O_NOFOLLOW relative to the one before, so it meets the link and stops."""
    elsewhere = tmp_path / "elsewhere"
    digest = _recorded(tmp_path, monkeypatch, elsewhere)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "spmd_aot").symlink_to(elsewhere / "spmd_aot")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    # the swap lands after the path was resolved: realpath saw a real directory there
    monkeypatch.setattr(verified.os.path, "realpath", lambda p: str(p))
    assert verified.recall(digest) is None
    before = {p.name: p.read_bytes() for p in (elsewhere / "spmd_aot" / "verified").iterdir()}
    verified.remember(digest, [None])  # nor is anything written through it
    assert {p.name: p.read_bytes() for p in (elsewhere / "spmd_aot" / "verified").iterdir()} == before
    monkeypatch.undo()
    monkeypatch.setenv("XDG_STATE_HOME", str(elsewhere))
    assert verified.recall(digest) == [None, ((2,), (1,), torch.float32)]  # untouched


def test_a_link_to_a_folder_someone_else_owns_is_refused(tmp_path, monkeypatch):
    attacker = tmp_path / "attacker"
    digest = _recorded(tmp_path, monkeypatch, attacker)
    for root, dirs, files in os.walk(attacker):
        for name in dirs + files + [""]:
            os.chown(os.path.join(root, name), ATTACKER, ATTACKER)
    (tmp_path / "state").symlink_to(attacker)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert verified.recall(digest) is None


@pytest.mark.parametrize("mode, owner, used", [
    (0o2770, ATTACKER, False),  # a team folder: group-writable, someone else's
    (0o0755, ATTACKER, False),  # someone else's, even read-only: they may chmod or rename within
    (0o0775, None, False),      # yours but group-writable: a member can swap what is below
    (0o1777, 0, True),          # sticky and root's (/tmp): others cannot rename what is not theirs
    (0o0755, 0, True),
])
def test_an_ancestor_of_the_state_folder_passes_the_rule(tmp_path, monkeypatch, mode, owner, used):
    team = tmp_path / "team"
    team.mkdir()
    digest = _recorded(tmp_path, monkeypatch, team / "me" / "state")
    if owner is not None:
        os.chown(team, owner, owner)
    os.chmod(team, mode)
    assert (verified.recall(digest) is not None) is used
    assert verified.private_folder(verified.record_dir()) is used


@pytest.mark.parametrize("which", ["verified", "spmd_aot"])
def test_the_record_folder_and_its_parent_must_be_yours_and_private(tmp_path, monkeypatch, which):
    digest = _recorded(tmp_path, monkeypatch, tmp_path / "state")
    folder = verified.record_dir() if which == "verified" else verified.record_dir().parent
    os.chmod(folder, 0o1777)  # sticky is no excuse for the record folder itself
    assert verified.recall(digest) is None
    os.chmod(folder, 0o700)
    assert verified.recall(digest) is not None
    os.chown(folder, ATTACKER, ATTACKER)
    assert verified.recall(digest) is None


def test_a_record_that_is_a_link_or_a_fifo_is_not_read(tmp_path, monkeypatch):
    digest = _recorded(tmp_path, monkeypatch, tmp_path / "state")
    (path,) = list(verified.record_dir().iterdir())
    target = tmp_path / "target"
    path.rename(target)
    path.symlink_to(target)
    assert verified.recall(digest) is None
    assert not path.is_symlink() and target.exists()  # the link removed, never what it names
    os.mkfifo(path)
    assert verified.recall(digest) is None  # refused at once (O_NONBLOCK, not a regular file)


def test_a_swap_in_the_middle_of_the_walk_is_not_followed(tmp_path, monkeypatch):
    """The swap lands while the walk runs: right before it opens ``spmd_aot``, that directory
    is renamed away and a link to it put in its place."""
    digest = _recorded(tmp_path, monkeypatch, tmp_path / "state")
    real_open, swapped = os.open, []

    def swapping_open(path, flags, *args, **kwargs):
        if path == "spmd_aot" and not swapped:
            parent = tmp_path / "state"
            (parent / "spmd_aot").rename(tmp_path / "moved")
            (parent / "spmd_aot").symlink_to(tmp_path / "moved")
            swapped.append(1)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(verified.os, "open", swapping_open)
    assert verified.recall(digest) is None and swapped
