"""A cache hit must be as sound as a retrace: every change to something the trace read gives a
different key or a named miss, never a wrong hit.

Each case builds offline (``spmd_aot.build``, fake tensors) into a cache, changes one thing the
trace depended on, and loads with ``require_hit=True``. The user's code lives in a real package
on ``sys.path`` (a model file, a helpers file) and calls an "installed" distribution (a
package with ``dist-info`` metadata in a ``site-packages`` folder), as a real project does.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import sys
import textwrap
import uuid

import pytest
import torch

import spmd_aot
import spmd_aot.runtime.step as runtime_mod
from support.multiproc import run_ranks
from spmd_aot.keying import guards
from spmd_aot.entries import read_manifest
from spmd_aot.errors import CacheMissError, UnsupportedError
from spmd_aot.keying.fingerprint import register_fingerprint
from spmd_aot.keying.lookup import Lookup
from spmd_aot.store import open_store

MODEL_SRC = '''
import dataclasses
import importlib

import torch
from torch import nn
from torch.nn import functional as F

import LIB as lib

SCALE = 1.0


class PlainConfig:
    def __init__(self, variant="relu", window=4):
        self.variant = variant
        self.window = window


@dataclasses.dataclass
class DataConfig:
    variant: str = "relu"
    window: int = 4


class Net(nn.Module):
    def __init__(self, config, act=None, extra=None):
        super().__init__()
        self.config = config
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.act = act
        if extra is not None:
            self.extra = extra  # a plain tensor attribute (not a parameter or buffer)

    def forward(self, x):
        h = self.fc1(x)
        h = torch.relu(h) if self.config.variant == "relu" else torch.tanh(h)
        h = h * (self.config.window / 4)
        h = lib.act(h)  # code in an installed distribution
        # reached dynamically: no fingerprint sees it, only the record of what ran
        h = importlib.import_module(__package__ + ".helpers").act(h)
        if self.act is not None:
            h = self.act(h)
        return self.fc2(h)


def step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y) * SCALE
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def make_step(scale):
    def scaled_step(model, optim, batch):
        x, y = batch
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss
    return scaled_step
'''

HELPERS_SRC = "import torch\n\n\ndef act(x):\n    return x * 1.0\n"
LIB_SRC = "import torch\n\n\ndef act(x):\n    return x + 0.0\n"


class Project:
    """A user package and an installed distribution, importable in this process and in ranks."""

    def __init__(self, root: pathlib.Path):
        tag = uuid.uuid4().hex[:8]
        self.pkg, self.lib = f"userpkg_{tag}", f"fakelib_{tag}"
        self.src, self.site = root / "src", root / "site-packages"
        (self.src / self.pkg).mkdir(parents=True)
        (self.src / self.pkg / "__init__.py").write_text("")
        (self.src / self.pkg / "model.py").write_text(MODEL_SRC.replace("LIB", self.lib))
        (self.src / self.pkg / "helpers.py").write_text(HELPERS_SRC)
        (self.site / self.lib).mkdir(parents=True)
        (self.site / self.lib / "__init__.py").write_text(LIB_SRC)
        self.set_lib_version("1.0")

    @property
    def paths(self) -> list[str]:
        return [str(self.src), str(self.site)]

    def set_lib_version(self, version: str) -> None:
        for old in self.site.glob("*.dist-info"):
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        info = self.site / f"{self.lib}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {self.lib}\nVersion: {version}\n")
        (info / "top_level.txt").write_text(f"{self.lib}\n")
        (info / "RECORD").write_text(f"{self.lib}/__init__.py,,\n")
        importlib.invalidate_caches()

    def model_module(self):
        return importlib.import_module(f"{self.pkg}.model")


@pytest.fixture
def project(tmp_path, monkeypatch):
    p = Project(tmp_path)
    for path in reversed(p.paths):
        monkeypatch.syspath_prepend(path)
    yield p
    for name in [n for n in sys.modules if n.startswith((p.pkg, p.lib))]:
        del sys.modules[name]


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1)


def build(cache, step, model_fn, world_size=1):
    job = spmd_aot.Job(step=step, model=model_fn, optimizer=sgd, batch=batch)
    return spmd_aot.build(job, world_size=world_size, cache_dir=cache)


def load(cache, step, model, require_hit=True):
    compiled = spmd_aot.compile(step, cache_dir=cache, require_hit=require_hit)
    compiled(model, sgd(model), batch())
    return compiled.cache_info


def assert_refused(cache, step, model, *named):
    """require_hit refuses, and the message names what changed."""
    with pytest.raises(CacheMissError) as info:
        load(cache, step, model)
    for text in named:
        assert text in str(info.value), str(info.value)
    return str(info.value)


# ---------------------------------------------------------------------------- same config: a hit
def test_same_configuration_built_twice_hits_with_its_recorded_guards(project, tmp_path):
    import typing

    mod = project.model_module()
    cache = tmp_path / "cache"
    for clear in typing._cleanups:  # typing's caches empty: typing_extensions' code runs in the trace
        clear()
    first = build(cache, mod.step, lambda: mod.Net(mod.PlainConfig()))
    again = build(cache, mod.step, lambda: mod.Net(mod.PlainConfig()))
    assert first.traced and not again.traced and again.key == first.key
    manifest = read_manifest(open_store(cache), first.digest)
    files = {rel for rel, _ in manifest["guards"]["files"]}
    assert {f"{project.pkg}/model.py", f"{project.pkg}/helpers.py", f"{project.lib}/__init__.py"} <= files
    assert not any(f.startswith(("torch/", "spmd_aot/")) for f in files)
    assert manifest["guards"]["distributions"] == [[project.lib, "1.0"]]
    info = load(cache, mod.step, mod.Net(mod.PlainConfig()))
    assert (info.hit, info.source, info.traces, info.key, info.digest) == (True, "cache", 0, first.key, first.digest)


# ---------------------------------------------------------------------------- (a) config objects
@pytest.mark.parametrize("config", ["PlainConfig", "DataConfig"])
@pytest.mark.parametrize("field,value", [("variant", "tanh"), ("window", 8)])
def test_config_field_read_in_forward_changes_key(project, tmp_path, config, field, value):
    mod = project.model_module()
    cls = getattr(mod, config)
    built = build(tmp_path / "cache", mod.step, lambda: mod.Net(cls()))
    msg = assert_refused(tmp_path / "cache", mod.step, mod.Net(cls(**{field: value})), "module_structure", field)
    assert built.key[:12] not in msg.split("Nearest")[0]  # a different key, not a wrong entry


# ---------------------------------------------------------------------------- (b) helper files
def test_helper_reached_dynamically_edited_is_a_named_miss(project, tmp_path):
    mod = project.model_module()
    build(tmp_path / "cache", mod.step, lambda: mod.Net(mod.PlainConfig()))
    (project.src / project.pkg / "helpers.py").write_text(HELPERS_SRC.replace("x * 1.0", "x * 2.0"))
    assert_refused(tmp_path / "cache", mod.step, mod.Net(mod.PlainConfig()),
                   f"{project.pkg}/helpers.py changed since the entry was traced")


def test_helper_imported_by_name_edited_changes_key(project, tmp_path, monkeypatch):
    helpers = project.src / project.pkg / "helpers.py"
    helpers.write_text(HELPERS_SRC + "\n\ndef scaled(loss):\n    return loss * 1.0\n")
    mod = project.model_module()
    step_src = project.src / project.pkg / "steps.py"
    step_src.write_text(textwrap.dedent(f"""
        from torch.nn import functional as F
        from {project.pkg} import helpers

        def step(model, optim, batch):
            x, y = batch
            loss = helpers.scaled(F.cross_entropy(model(x), y))
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss
    """))
    steps = importlib.import_module(f"{project.pkg}.steps")
    build(tmp_path / "cache", steps.step, lambda: mod.Net(mod.PlainConfig()))
    helpers.write_text(HELPERS_SRC + "\n\ndef scaled(loss):\n    return loss * 3.0\n")
    importlib.reload(importlib.import_module(f"{project.pkg}.helpers"))
    assert_refused(tmp_path / "cache", steps.step, mod.Net(mod.PlainConfig()), "step_code")


# ---------------------------------------------------------------------------- (c) installed code
def test_installed_distribution_version_change_is_a_named_miss(project, tmp_path):
    mod = project.model_module()
    build(tmp_path / "cache", mod.step, lambda: mod.Net(mod.PlainConfig()))
    project.set_lib_version("1.1")
    assert_refused(tmp_path / "cache", mod.step, mod.Net(mod.PlainConfig()),
                   f"installed distribution {project.lib} is 1.1 here", "traced with", "1.0")


def test_installed_file_change_is_a_named_miss(project, tmp_path):
    mod = project.model_module()
    build(tmp_path / "cache", mod.step, lambda: mod.Net(mod.PlainConfig()))
    (project.site / project.lib / "__init__.py").write_text(LIB_SRC.replace("x + 0.0", "x + 1.0"))
    assert_refused(tmp_path / "cache", mod.step, mod.Net(mod.PlainConfig()),
                   f"{project.lib}/__init__.py changed since the entry was traced")


def test_a_rebuild_after_a_failed_guard_keeps_both_entries(project, tmp_path):
    """One key, two guarded entries: jobs on either version of a file hit."""
    mod = project.model_module()
    cache = tmp_path / "cache"
    lib_file = project.site / project.lib / "__init__.py"
    first = build(cache, mod.step, lambda: mod.Net(mod.PlainConfig()))
    lib_file.write_text(LIB_SRC.replace("x + 0.0", "x + 1.0"))
    second = build(cache, mod.step, lambda: mod.Net(mod.PlainConfig()))
    assert second.traced and second.key == first.key and second.digest != first.digest
    assert read_manifest(open_store(cache), second.digest)["previous"] == first.digest
    assert load(cache, mod.step, mod.Net(mod.PlainConfig())).digest == second.digest
    lib_file.write_text(LIB_SRC)
    info = load(cache, mod.step, mod.Net(mod.PlainConfig()))
    assert (info.hit, info.digest) == (True, first.digest)


# ---------------------------------------------------------------------------- (d) globals, closures
def test_global_constant_read_by_the_step_changes_key(project, tmp_path, monkeypatch):
    mod = project.model_module()
    build(tmp_path / "cache", mod.step, lambda: mod.Net(mod.PlainConfig()))
    monkeypatch.setattr(mod, "SCALE", 2.0)
    assert_refused(tmp_path / "cache", mod.step, mod.Net(mod.PlainConfig()), "step_code", "SCALE")


def test_closure_value_read_by_the_step_changes_key(project, tmp_path):
    mod = project.model_module()
    build(tmp_path / "cache", mod.make_step(1.0), lambda: mod.Net(mod.PlainConfig()))
    assert load(tmp_path / "cache", mod.make_step(1.0), mod.Net(mod.PlainConfig())).hit
    assert_refused(tmp_path / "cache", mod.make_step(0.5), mod.Net(mod.PlainConfig()), "step_code", "scale")


# ---------------------------------------------------------------------------- (e) global state
def test_default_dtype_changes_key(project, tmp_path):
    mod = project.model_module()
    build(tmp_path / "cache", mod.step, lambda: mod.Net(mod.PlainConfig()))
    model = mod.Net(mod.PlainConfig())
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert_refused(tmp_path / "cache", mod.step, model, "global_state", "default_dtype")
    finally:
        torch.set_default_dtype(before)


# ---------------------------------------------------------------------------- (f) hooks
def test_forward_hook_changes_key(project, tmp_path):
    mod = project.model_module()
    build(tmp_path / "cache", mod.step, lambda: mod.Net(mod.PlainConfig()))
    model = mod.Net(mod.PlainConfig())
    model.fc1.register_forward_hook(lambda m, args, out: out * 2)
    assert_refused(tmp_path / "cache", mod.step, model, "module_structure", "forward")


# ---------------------------------------------------------------------------- (g) tensors, lambdas
def test_tensor_attribute_shape_is_keyed_and_a_fake_one_hits_a_real_one(project, tmp_path):
    """Built from a fake tensor attribute, loaded with a real one: the same key (values are not
    in it, and a fake value cannot have been baked into the graph); another shape or dtype: a
    different key."""
    mod = project.model_module()
    cache = tmp_path / "cache"
    built = build(cache, mod.step, lambda: mod.Net(mod.PlainConfig(), extra=torch.zeros(4)))
    assert read_manifest(open_store(cache), built.digest)["guards"]["tensors"] == []
    info = load(cache, mod.step, mod.Net(mod.PlainConfig(), extra=torch.ones(4)))
    assert (info.hit, info.key) == (True, built.key)
    assert_refused(cache, mod.step, mod.Net(mod.PlainConfig(), extra=torch.zeros(5)), "module_structure", "extra")
    assert_refused(cache, mod.step, mod.Net(mod.PlainConfig(), extra=torch.zeros(4, dtype=torch.float64)),
                   "module_structure", "extra")


def test_real_tensor_values_met_by_the_key_are_guarded(project):
    """A real tensor the trace could bake in as a constant: its value is recorded and checked."""
    from spmd_aot.keying.key import compute_key
    from spmd_aot.parallel.plan import Plan
    from spmd_aot.state import TrainState

    mod = project.model_module()
    model = mod.Net(mod.PlainConfig(), extra=torch.zeros(4))

    def key():
        return compute_key(mod.step, TrainState(model, sgd(model), batch(), Plan(1)), Plan(1))

    recorded = guards.record(set(), key())
    assert [p for p, _ in recorded["tensors"]] == ["model.extra"]
    assert guards.check(recorded, key()) is None
    model.extra.add_(1.0)
    assert "tensor model.extra has another value" in guards.check(recorded, key())
    del model.extra
    assert "tensor model.extra" in guards.check(recorded, key())


def test_lambda_attribute_changes_key(project, tmp_path):
    mod = project.model_module()
    same, other = (lambda h: h * 1.0), (lambda h: h * 3.0)
    build(tmp_path / "cache", mod.step, lambda: mod.Net(mod.PlainConfig(), act=same))
    assert load(tmp_path / "cache", mod.step, mod.Net(mod.PlainConfig(), act=same)).hit
    assert_refused(tmp_path / "cache", mod.step, mod.Net(mod.PlainConfig(), act=other), "module_structure", "act")


# ---------------------------------------------------------------------------- refusals, escape hatch
class _Opaque:
    __slots__ = ()


def test_unfingerprintable_attribute_names_its_path_and_the_escape_hatch(project, tmp_path):
    import threading

    mod = project.model_module()
    model = mod.Net(mod.PlainConfig())
    model.fc1.guard = threading.Lock()
    with pytest.raises(UnsupportedError, match=r"model\.fc1\.guard: cannot fingerprint .*lock.*register_fingerprint"):
        load(tmp_path / "cache", mod.step, model, require_hit=False)
    register_fingerprint(type(threading.Lock()), lambda lock: None)
    try:
        with pytest.raises(CacheMissError):
            load(tmp_path / "cache", mod.step, model)  # keyed now: a plain miss
    finally:
        from spmd_aot.keying import fingerprint

        fingerprint._CUSTOM.pop(type(threading.Lock()))


# ---------------------------------------------------------------------------- CacheInfo
def test_a_process_that_waited_for_anothers_build_reports_cache(project, tmp_path, monkeypatch):
    """Rank 0's lookup missed, then the entry appeared while it waited for the build lock."""
    mod = project.model_module()
    cache = tmp_path / "cache"
    built = build(cache, mod.step, lambda: mod.Net(mod.PlainConfig()))
    with monkeypatch.context() as patch:
        patch.setattr(runtime_mod, "find_entry", lambda store, key: Lookup(None, None, ()))
        info = load(cache, mod.step, mod.Net(mod.PlainConfig()), require_hit=False)
    assert (info.hit, info.source, info.traces, info.digest) == (False, "cache", 0, built.digest)
    fresh = tmp_path / "fresh"
    info = load(fresh, mod.step, mod.Net(mod.PlainConfig()), require_hit=False)
    assert (info.hit, info.source, info.traces) == (False, "trace", 1)


# ---------------------------------------------------------------------------- every rank
def _rank_load(rank, world, paths, pkg, cache):
    sys.path[:0] = paths
    mod = importlib.import_module(f"{pkg}.model")
    torch.manual_seed(0)
    info = load(cache, mod.step, mod.Net(mod.DataConfig(window=8)))
    return info.hit, info.source, info.key, info.digest


def test_every_rank_hits_the_same_guarded_entry(project, tmp_path):
    mod = project.model_module()
    built = build(tmp_path / "cache", mod.step, lambda: mod.Net(mod.DataConfig(window=8)), world_size=2)
    results = run_ranks(_rank_load, 2, project.paths, project.pkg, str(tmp_path / "cache"))
    assert results == [(True, "cache", built.key, built.digest)] * 2


def test_guard_check_is_memoized_but_sees_same_size_edits(project, tmp_path):
    path = project.src / project.pkg / "helpers.py"
    before = guards.file_digest(str(path))
    assert guards.file_digest(str(path)) == before
    path.write_text(HELPERS_SRC.replace("1.0", "2.0"))  # same size
    assert guards.file_digest(str(path)) != before
    json.dumps(guards.empty())


# ---------------------------------------------------------------------------- as a new user would
TRAIN_SRC = '''
import sys

import torch
from torch import nn
from torch.nn import functional as F

import spmd_aot
import helpers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        act = getattr(helpers, "act")  # invisible to any fingerprint: only the record of what ran sees it
        return self.fc2(act(self.fc1(x)))


def step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)


def job():
    return spmd_aot.Job(step=step, model=Net, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                        batch=batch)


if __name__ == "__main__":
    model = Net()
    compiled = spmd_aot.compile(step, cache_dir=sys.argv[1], require_hit=True)
    try:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), batch())
        print("HIT", compiled.cache_info.key)
    except spmd_aot.CacheMissError as exc:
        print("MISS", exc)
'''


def test_cli_build_then_script_run_elsewhere_hits_and_a_helper_edit_is_a_named_miss(tmp_path):
    import os
    import subprocess

    project, build_cwd, run_cwd, cache = (tmp_path / n for n in ("project", "a", "b", "cache"))
    for d in (project, build_cwd, run_cwd):
        d.mkdir()
    (project / "train.py").write_text(TRAIN_SRC)
    (project / "helpers.py").write_text("import torch\n\n\ndef act(x):\n    return torch.relu(x)\n")
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(spmd_aot.__file__).parent.parent)}

    def run(args, cwd):
        proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    out = run(["-m", "spmd_aot", "build", f"{project / 'train.py'}:job", "-w", "1", "--cache-dir", str(cache)], build_cwd)
    key = open_store(cache).refs()
    assert len(key) == 1, out
    assert run([str(project / "train.py"), str(cache)], run_cwd).split() == ["HIT", next(iter(key))]
    (project / "helpers.py").write_text("import torch\n\n\ndef act(x):\n    return torch.tanh(x)\n")
    out = run([str(project / "train.py"), str(cache)], run_cwd)
    assert out.startswith("MISS") and "helpers.py changed since the entry was traced" in out, out
