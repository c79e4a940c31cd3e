"""Tests for spmd_aot.keying.key: the cache key holds everything that changes the graph, and nothing
that differs between ranks, machines, processes or the build and run paths of one job."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import types
import uuid

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import spmd_aot.keying.key as key_mod
from spmd_aot.errors import SpmdAotError
from spmd_aot.examples import models as example_models
from spmd_aot.examples.models import MLP, Transformer, train_step
from spmd_aot.keying.key import INGREDIENTS, CacheKey, compute_key
from spmd_aot.parallel.plan import Plan
from spmd_aot.state import TrainState, initialize_optimizer_state

REPO = pathlib.Path(__file__).resolve().parents[2]
ALL_INGREDIENTS = {name for name, _ in INGREDIENTS}


# ---------------------------------------------------------------------------- helpers
class Net(nn.Module):
    """A small model with a dropout, a plain config attribute and a registered buffer."""

    def __init__(self, p=0.1, n_heads=2, buf_shape=(4,), buf_dtype=torch.float32, hidden=16):
        super().__init__()
        self.fc1 = nn.Linear(8, hidden)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(hidden, 4)
        self.n_heads = n_heads
        self.register_buffer("scale", torch.ones(buf_shape, dtype=buf_dtype))

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x)))) * self.scale.sum()


def net_batch(batch_size=4, seed=0, x_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 8, generator=g).to(x_dtype), torch.randint(0, 4, (batch_size,), generator=g)


def mlp_batch(batch_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def sgd(m, **kw):
    return torch.optim.SGD(m.parameters(), **{"lr": 0.05, "momentum": 0.9, **kw})


def adamw(m, **kw):
    return torch.optim.AdamW(m.parameters(), **{"lr": 1e-2, "weight_decay": 0.1, **kw})


def key_of(model, optim, batch, plan=None, step=train_step, init=True, **kw) -> CacheKey:
    if init:
        initialize_optimizer_state(optim)
    return compute_key(step, TrainState(model, optim, batch, plan or Plan(2)), plan or Plan(2), **kw)


def net_key(seed=0, net_kw=None, optim=adamw, optim_kw=None, batch=None, **kw) -> CacheKey:
    torch.manual_seed(seed)
    model = Net(**(net_kw or {}))
    return key_of(model, optim(model, **(optim_kw or {})), batch if batch is not None else net_batch(seed=seed), **kw)


def mlp_key(seed=0, optim=sgd, **kw) -> CacheKey:
    torch.manual_seed(seed)
    model = MLP(32, 64, 10)
    return key_of(model, optim(model), mlp_batch(seed=seed), **kw)


def diff(a: CacheKey, b: CacheKey) -> set[str]:
    assert set(a.ingredients) == set(b.ingredients) == ALL_INGREDIENTS
    return {n for n in a.ingredients if a.ingredients[n] != b.ingredients[n]}


def assert_only(a: CacheKey, b: CacheKey, *names: str) -> None:
    changed = diff(a, b)
    assert changed == set(names), (
        f"expected only {sorted(names)} to change, got {sorted(changed)}: "
        + "; ".join(f"{n}: {a.values[n]!r} -> {b.values[n]!r}" for n in sorted(changed))
    )
    assert a.key != b.key


def assert_same(a: CacheKey, b: CacheKey) -> None:
    assert diff(a, b) == set(), {n: (a.values[n], b.values[n]) for n in diff(a, b)}
    assert a.key == b.key


def import_file(monkeypatch, path: pathlib.Path, name: str | None = None):
    """Import ``path`` as a fresh module (registered in sys.modules for the test's duration)."""
    name = name or f"_key_test_{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def pass_a(gm):
    return gm


def pass_b(gm):
    return gm


def pass_scaled(gm, factor=1):
    return gm


# ---------------------------------------------------------------------------- determinism
def test_key_shape_and_determinism_in_one_process():
    a, b = mlp_key(), mlp_key()
    assert isinstance(a, CacheKey)
    assert len(a.key) == 64 and int(a.key, 16) >= 0
    assert list(a.ingredients) == [n for n, _ in INGREDIENTS]
    assert set(a.values) == ALL_INGREDIENTS
    json.dumps(a.values)  # the values go into the manifest: must be plain JSON
    assert_same(a, b)
    # the same objects, keyed twice
    torch.manual_seed(0)
    model = Transformer(vocab=64, d_model=32, n_heads=4, n_layers=2, max_len=8)
    optim = adamw(model)
    batch = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    assert_same(key_of(model, optim, batch), key_of(model, optim, batch))


def test_tensor_values_do_not_change_key():
    base = net_key(seed=0)
    assert_same(base, net_key(seed=123))  # re-seeded parameters and batch
    # different batch values, same shapes/dtypes
    torch.manual_seed(0)
    model = Net()
    optim = adamw(model)
    k1 = key_of(model, optim, net_batch(seed=1))
    k2 = key_of(model, optim, (torch.full((4, 8), 7.0), torch.zeros(4, dtype=torch.long)))
    assert_same(k1, k2)
    assert_same(base, k1)
    # different parameter, buffer and optimizer-state values on the same objects
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
        model.scale.fill_(5.0)
        for st in optim.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(2.5)
    assert_same(base, key_of(model, optim, net_batch(seed=1)))


def test_wall_time_env_hostname_cwd_and_process_group_do_not_change_key(monkeypatch, tmp_path):
    base = net_key()
    for var, value in [("RANK", "3"), ("LOCAL_RANK", "1"), ("MASTER_PORT", "29517"),
                       ("MASTER_ADDR", "10.1.2.3"), ("WORLD_SIZE", "8"), ("HOSTNAME", "elsewhere"),
                       ("TORCHELASTIC_RUN_ID", "run-42")]:
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(socket, "gethostname", lambda: "another-host")
    monkeypatch.chdir(tmp_path)
    assert_same(base, net_key())
    monkeypatch.setattr(time, "time", lambda: 4_000_000_000.0)
    assert_same(base, net_key())
    # a live process group (named or not) is per-process state, not part of the job
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.new_group([0], group_desc="some_group")
        assert_same(base, net_key())
    finally:
        dist.destroy_process_group()


_STEP_FILE = '''
import json, os, sys
import torch
from torch import nn
from torch.nn import functional as F
from spmd_aot.keying.key import compute_key
from spmd_aot.parallel.plan import Plan
from spmd_aot.state import TrainState, initialize_optimizer_state


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 4)
        self.register_buffer("scale", torch.ones(4))
        self.names = {"alpha", "beta", "gamma", "delta", "epsilon"}  # set order follows the hash seed
        self.fc1.register_forward_hook(lambda m, a, out: out)  # hook ids are per process

    def forward(self, x):
        if "relu" in {"relu", "gelu", "silu", "tanh"}:  # a frozenset constant in the bytecode
            x = torch.relu(self.fc1(x))
        return self.fc2(self.drop(x)) * self.scale


def step(model, optim, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def make(seed):
    torch.manual_seed(seed)
    model = TinyNet()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    batch = {"x": torch.randn(8, 16), "y": torch.randint(0, 4, (8,))}
    initialize_optimizer_state(optim)
    return model, optim, batch


def key_json(fake, seed):
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode(), torch.device("cpu"):
            model, optim, batch = make(seed)
    else:
        model, optim, batch = make(seed)
    k = compute_key(step, TrainState(model, optim, batch, Plan(2)), Plan(2))
    return json.dumps({"key": k.key, "ingredients": k.ingredients, "values": k.values})


if __name__ == "__main__":
    print("KEY " + key_json(fake=False, seed=int(sys.argv[1])))
'''


def _parse_key(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KEY ")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0][4:])


def test_key_equal_across_processes_machines_paths_and_module_names(tmp_path, monkeypatch):
    """Offline build (fake tensors, file imported as a target module) on "one machine" versus
    runtime (real tensors, the same file run as ``__main__`` from another folder) on "another"."""
    dir_a, dir_b, cwd_a, cwd_b = (tmp_path / n for n in ("build_copy", "run_copy", "cwd_a", "cwd_b"))
    for d in (dir_a, dir_b, cwd_a, cwd_b):
        d.mkdir()
    (dir_a / "train.py").write_text(_STEP_FILE)
    (dir_b / "train.py").write_text(_STEP_FILE)

    base_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR", "HOSTNAME", "PYTHONHASHSEED")}
    base_env["PYTHONPATH"] = str(REPO)
    env_a = {**base_env, "HOSTNAME": "build-box", "PYTHONHASHSEED": "1", "RANK": "0", "MASTER_PORT": "29500"}
    env_b = {**base_env, "HOSTNAME": "gpu-node-17", "PYTHONHASHSEED": "2", "RANK": "1", "LOCAL_RANK": "1",
             "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "31337"}
    builder_code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("_spmd_aot_target_train", {str(dir_a / "train.py")!r})
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        print("KEY " + mod.key_json(fake=True, seed=0))
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", builder_code], cwd=cwd_a, env=env_a,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        subprocess.Popen([sys.executable, str(dir_b / "train.py"), "7"], cwd=cwd_b, env=env_b,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        results.append(_parse_key(subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    build, run = results
    differing = {n: (build["values"][n], run["values"][n])
                 for n in build["ingredients"] if build["ingredients"][n] != run["ingredients"][n]}
    assert differing == {}
    assert build["key"] == run["key"]

    # and this process (yet another module name and path for the same content) agrees
    mod = import_file(monkeypatch, dir_b / "train.py", "some.other.name")
    here = json.loads(mod.key_json(fake=False, seed=3))
    assert here["key"] == build["key"]


def test_same_file_under_another_path_and_module_name_gives_same_key(tmp_path, monkeypatch):
    copy = tmp_path / "elsewhere" / "renamed_models.py"
    copy.parent.mkdir()
    shutil.copyfile(example_models.__file__, copy)
    mod = import_file(monkeypatch, copy)
    assert mod.MLP is not MLP and mod.train_step is not train_step
    torch.manual_seed(0)
    m = mod.MLP(32, 64, 10)
    assert_same(mlp_key(), key_of(m, sgd(m), mlp_batch(), step=mod.train_step))


# ---------------------------------------------------------------------------- build == runtime
@pytest.mark.parametrize("model_name,optim_fn", [("mlp", sgd), ("mlp", adamw), ("transformer", sgd),
                                                 ("transformer", adamw), ("net", adamw)])
def test_fake_tensors_and_real_tensors_give_same_key(model_name, optim_fn):
    def make():
        if model_name == "mlp":
            model, batch = MLP(32, 64, 10), mlp_batch()
        elif model_name == "transformer":
            model = Transformer(vocab=64, d_model=32, n_heads=4, n_layers=2, max_len=8)
            batch = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
        else:
            model, batch = Net(), net_batch()
        optim = optim_fn(model)
        initialize_optimizer_state(optim)
        return model, optim, batch

    with FakeTensorMode(), torch.device("cpu"):
        fake = make()
    assert all(type(p).__name__ == "FakeTensor" for p in fake[0].parameters())
    real = make()
    assert not any(type(p).__name__ == "FakeTensor" for p in real[0].parameters())
    k_fake = compute_key(train_step, TrainState(*fake, Plan(2)), Plan(2))
    k_real = compute_key(train_step, TrainState(*real, Plan(2)), Plan(2))
    assert_same(k_fake, k_real)
    assert k_fake.values["optimizer"]["state"]  # state was created, and is part of both keys


# ---------------------------------------------------------------------------- one test per ingredient
def test_step_code_in_another_file_changes_key(tmp_path, monkeypatch):
    f = tmp_path / "my_steps.py"
    f.write_text(textwrap.dedent("""
        from torch.nn import functional as F

        def train_step(model, optim, batch):
            x, y = batch
            loss = F.cross_entropy(model(x), y) * 0.5
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss
    """))
    mod = import_file(monkeypatch, f)
    base = mlp_key()
    other = mlp_key(step=mod.train_step)
    assert_only(base, other, "step_code")
    # same name, same body text, different file: still a different step (the file is hashed)
    assert base.values["step_code"]["name"] == other.values["step_code"]["name"] == "train_step"


def test_editing_a_helper_in_the_step_file_changes_key(tmp_path, monkeypatch):
    f = tmp_path / "steps_with_helper.py"
    src = textwrap.dedent("""
        from torch.nn import functional as F

        def scale(loss):
            return loss * 1.0

        def step(model, optim, batch):
            x, y = batch
            loss = scale(F.cross_entropy(model(x), y))
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss
    """)
    f.write_text(src)
    k1 = mlp_key(step=import_file(monkeypatch, f).step)
    f.write_text(src.replace("loss * 1.0", "loss * 2.0 + 0.0"))
    k2 = mlp_key(step=import_file(monkeypatch, f).step)
    assert_only(k1, k2, "step_code")


_MODEL_SRC = textwrap.dedent("""
    import torch
    from torch import nn

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x)

    class EditedNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return torch.relu(self.inner(x))
""")


def _edited_key(monkeypatch, path):
    mod = import_file(monkeypatch, path)
    torch.manual_seed(0)
    model = mod.EditedNet()
    return key_of(model, adamw(model), net_batch())


def test_editing_model_forward_source_changes_key(tmp_path, monkeypatch):
    path = tmp_path / "edited_model.py"
    path.write_text(_MODEL_SRC)
    k1 = _edited_key(monkeypatch, path)
    assert_same(k1, _edited_key(monkeypatch, path))  # re-importing unchanged source: same key

    path.write_text(_MODEL_SRC.replace("return torch.relu(self.inner(x))", "return torch.tanh(self.inner(x)) * 2"))
    k2 = _edited_key(monkeypatch, path)
    assert_only(k1, k2, "model_code")

    # editing the forward of a submodule class (same file) changes it too
    path.write_text(_MODEL_SRC.replace("return self.lin(x)", "return self.lin(x) + 1.0"))
    k3 = _edited_key(monkeypatch, path)
    assert_only(k1, k3, "model_code")
    assert k2.key != k3.key


@pytest.mark.parametrize("change", ["dropout_p", "n_heads_attr", "eval_mode"])
def test_module_structure_changes_key(change):
    base = net_key()
    if change == "dropout_p":
        other = net_key(net_kw={"p": 0.2})
    elif change == "n_heads_attr":
        other = net_key(net_kw={"n_heads": 4})
    else:
        torch.manual_seed(0)
        model = Net().eval()
        other = key_of(model, adamw(model), net_batch())
    assert_only(base, other, "module_structure")


def test_transformer_n_heads_changes_key():
    def k(n_heads):
        torch.manual_seed(0)
        model = Transformer(vocab=64, d_model=32, n_heads=n_heads, n_layers=2, max_len=8)
        return key_of(model, adamw(model), (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))))

    assert_only(k(4), k(2), "module_structure")  # same parameter shapes, different graph


def test_parameter_shapes_change_key():
    base = net_key()
    # hidden width: parameter shapes (and so optimizer state shapes and Linear's attributes)
    assert_only(base, net_key(net_kw={"hidden": 32}), "parameters", "module_structure", "optimizer")
    # a parameter replaced by one of another shape, attributes untouched
    torch.manual_seed(0)
    model = Net()
    model.fc2.bias = nn.Parameter(torch.zeros(1))
    assert_only(base, key_of(model, adamw(model), net_batch()), "parameters", "optimizer")


def test_parameter_dtypes_change_key():
    base = net_key(optim=sgd, optim_kw={"momentum": 0.0})
    torch.manual_seed(0)
    model = Net()
    model.fc1.double()
    other = key_of(model, sgd(model, momentum=0.0), net_batch())
    assert "float64" in json.dumps(other.values["parameters"])
    # plain SGD keeps no tensor state, so only the parameters ingredient moves
    assert_only(base, other, "parameters")
    # with AdamW the state follows the parameter dtype
    torch.manual_seed(0)
    model = Net().double()
    assert_only(net_key(), key_of(model, adamw(model), net_batch()), "parameters", "buffers", "optimizer")


def test_requires_grad_changes_key():
    """A frozen parameter is a different parameter set, and it has no optimizer state (as in
    eager), so the optimizer's state layout changes with it."""
    torch.manual_seed(0)
    model = Net()
    model.fc1.bias.requires_grad_(False)
    assert_only(net_key(), key_of(model, adamw(model), net_batch()), "parameters", "optimizer")


def test_buffer_shape_and_dtype_change_key():
    base = net_key()
    assert_only(base, net_key(net_kw={"buf_shape": (1,)}), "buffers")
    assert_only(base, net_key(net_kw={"buf_dtype": torch.float64}), "buffers")
    assert_only(base, net_key(net_kw={"buf_dtype": torch.bfloat16}), "buffers")


def test_optimizer_class_changes_key():
    a = net_key(optim=lambda m: torch.optim.SGD(m.parameters(), lr=0.01))
    b = net_key(optim=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01))
    assert_only(a, b, "optimizer")
    assert a.values["optimizer"]["class"] != b.values["optimizer"]["class"]


def test_custom_optimizer_class_is_identified_by_code():
    class MySGD(torch.optim.SGD):
        pass

    # (a custom class must bring its own state: initialize_optimizer_state refuses it)
    base = net_key(optim=lambda m: torch.optim.SGD(m.parameters(), lr=0.01), init=False)
    other = net_key(optim=lambda m: MySGD(m.parameters(), lr=0.01), init=False)
    assert_only(base, other, "optimizer")
    assert "file" in other.values["optimizer"]["class"] and "code" in other.values["optimizer"]["class"]


@pytest.mark.parametrize("optim_fn,kw", [
    (sgd, {"momentum": 0.0}), (sgd, {"weight_decay": 1e-4}), (sgd, {"nesterov": True}),
    (adamw, {"weight_decay": 0.0}), (adamw, {"amsgrad": True}), (adamw, {"fused": True}),
    (adamw, {"foreach": False}),
])
def test_structural_hyperparameters_change_key(optim_fn, kw):
    """Flags, and zero against nonzero momentum or weight decay (another path), are constants."""
    base = net_key(optim=optim_fn)
    assert_same(base, net_key(optim=optim_fn))
    assert_only(base, net_key(optim=optim_fn, optim_kw=kw), "optimizer")


@pytest.mark.parametrize("optim_fn,kw", [
    (sgd, {"momentum": 0.5}), (sgd, {"momentum": 0.5, "weight_decay": 1e-3}),
    (adamw, {"betas": (0.85, 0.95)}), (adamw, {"eps": 1e-6}), (adamw, {"weight_decay": 0.3}),
])
def test_hyperparameter_inputs_are_not_key_ingredients(optim_fn, kw):
    """What a scheduler moves (OneCycleLR: betas, momentum) is a step input, not in the key
    (``state.hyperparameter_inputs``); SGD's weight decay is an input once nonzero."""
    base = net_key(optim=optim_fn, optim_kw={"weight_decay": 1e-4} if optim_fn is sgd else {})
    assert_same(base, net_key(optim=optim_fn, optim_kw={"weight_decay": 1e-4, **kw} if optim_fn is sgd else kw))


@pytest.mark.parametrize("optim_fn", [sgd, adamw])
def test_learning_rate_is_a_graph_input_not_a_key_ingredient(optim_fn):
    """Schedulers change lr between steps: that must not rebuild (issue: LR as an input)."""
    base = net_key(optim=optim_fn)
    assert_same(base, net_key(optim=optim_fn, optim_kw={"lr": 0.1 + 1e-17 + 2 ** -56}))
    torch.manual_seed(0)
    model = Net()
    optim = optim_fn(model)
    initialize_optimizer_state(optim)
    torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=1.0, total_steps=10, cycle_momentum=False)
    assert "initial_lr" in optim.param_groups[0]  # the scheduler's own bookkeeping
    assert_same(base, key_of(model, optim, net_batch()))


def test_param_groups_change_key():
    torch.manual_seed(0)
    m = Net()
    two_groups = torch.optim.AdamW([{"params": list(m.fc1.parameters()), "lr": 1e-3},
                                    {"params": list(m.fc2.parameters())}], lr=1e-2, weight_decay=0.1)
    assert_only(net_key(), key_of(m, two_groups, net_batch()), "optimizer")


def test_optimizer_state_structure_changes_key():
    base = net_key()

    def with_state(edit):
        torch.manual_seed(0)
        model = Net()
        optim = adamw(model)
        initialize_optimizer_state(optim)
        edit(optim.state[model.fc1.weight])
        return key_of(model, optim, net_batch(), init=False)

    assert_same(base, with_state(lambda st: None))
    assert_only(base, with_state(lambda st: st.update(exp_avg=st["exp_avg"].double())), "optimizer")
    assert_only(base, with_state(lambda st: st.update(step=st["step"].reshape(1))), "optimizer")
    assert_only(base, with_state(lambda st: st.update(extra=torch.zeros(3))), "optimizer")
    assert_only(base, with_state(lambda st: st.update(step=1.0)), "optimizer")  # non-tensor step
    # no state at all (not initialized) vs initialized
    torch.manual_seed(0)
    model = Net()
    assert_only(base, key_of(model, adamw(model), net_batch(), init=False), "optimizer")


def test_batch_structure_changes_key():
    x, y = net_batch()
    base = net_key(batch=(x, y))
    assert_only(base, net_key(batch={"x": x, "y": y}), "batch")
    assert_only(base, net_key(batch=[x, y]), "batch")
    assert_only(base, net_key(batch=(y, x)), "batch")
    assert_only(net_key(batch={"x": x, "y": y}), net_key(batch={"inp": x, "y": y}), "batch")


def test_batch_shapes_and_dtypes_change_key():
    base = net_key(batch=net_batch(batch_size=4))
    assert_only(base, net_key(batch=net_batch(batch_size=8)), "batch")
    assert_only(base, net_key(batch=net_batch(x_dtype=torch.float64)), "batch")
    x, y = net_batch()
    assert_only(base, net_key(batch=(x, y.int())), "batch")
    assert_only(base, net_key(batch=(x.reshape(4, 2, 4), y)), "batch")


def test_world_size_changes_key():
    a = net_key(plan=Plan(2))
    assert_only(a, net_key(plan=Plan(4)), "parallel")
    assert_only(net_key(plan=Plan(1)), a, "parallel")


def test_mesh_shape_changes_key():
    flat = net_key(plan=Plan(4, "shard", mesh_shape=(4,)))
    assert_same(flat, net_key(plan=Plan(4, "shard")))  # the default mesh is the 1-D world
    assert_only(flat, net_key(plan=Plan(4, "shard", mesh_shape=(2, 2))), "parallel")
    assert_only(net_key(plan=Plan(4, "shard", mesh_shape=(2, 2))),
                net_key(plan=Plan(4, "shard", mesh_shape=(1, 4))), "parallel")
    with pytest.raises(SpmdAotError, match="mesh shape"):
        Plan(4, mesh_shape=(3,))
    with pytest.raises(SpmdAotError, match="2-D meshes"):
        Plan(4, "replicate", mesh_shape=(2, 2))


def test_placement_is_in_key_and_unknown_placement_rejected():
    k = net_key(plan=Plan(2, placement="replicate"))
    assert k.values["parallel"]["placement"] == "replicate"
    assert_same(k, net_key(plan=Plan(2)))
    assert_only(k, net_key(plan=Plan(2, placement="shard")), "parallel")
    for bad in ("fsdp", "Replicate", ""):
        with pytest.raises(SpmdAotError, match="placement"):
            Plan(2, placement=bad)


def test_param_placement_overrides_change_key():
    k = net_key(plan=Plan(2, placement="shard"))
    keep_bias = net_key(plan=Plan(2, placement="shard", param_placements={"*.bias": "replicate"}))
    assert_only(k, keep_bias, "parallel")
    with pytest.raises(SpmdAotError, match="param_placements"):
        Plan(2, placement="shard", param_placements={"*": "tensor-parallel"})


def test_tp_plan_changes_key_and_is_one_text_form():
    plain = net_key(plan=Plan(2))
    colwise = net_key(plan=Plan(2, tp_plan={"fc1": "colwise", "fc2": "rowwise"}))
    assert_only(plain, colwise, "parallel")
    assert colwise.values["parallel"]["tp_plan"] == [["fc1", "colwise"], ["fc2", "rowwise"]]
    assert "tp_plan" not in plain.values["parallel"]  # plans without TP keep their text and keys
    assert_only(colwise, net_key(plan=Plan(2, tp_plan={"fc1": "rowwise", "fc2": "rowwise"})), "parallel")
    plan = Plan(4, "shard", mesh_shape=(2, 2), tp_plan={"fc1": "colwise"})
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(SpmdAotError, match="tp_plan"):
        Plan(2, tp_plan={"fc1": "sequence"})
    with pytest.raises(SpmdAotError, match=r"mesh_shape=\(dp_shard, tp\)"):
        Plan(4, "shard", tp_plan={"fc1": "colwise"})  # FSDP x TP needs a dimension for each
    with pytest.raises(SpmdAotError, match="2-D meshes"):
        Plan(8, "replicate", mesh_shape=(2, 2, 2), tp_plan={"fc1": "colwise"})
    assert Plan(4, "replicate", mesh_shape=(2, 2), tp_plan={"fc1": "colwise"}).mesh_roles == ("dp_replicate", "tp")
    assert Plan(8, "shard", mesh_shape=(2, 2, 2), tp_plan={"fc1": "colwise"}).mesh_roles == \
        ("dp_replicate", "dp_shard", "tp")


def test_device_type_changes_key():
    cpu = net_key(plan=Plan(2, device_type="cpu"))
    assert_only(cpu, net_key(plan=Plan(2, device_type="cuda")), "device_type")


def test_torch_version_local_suffix_ignored_release_not(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    cpu = net_key()
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    assert_same(cpu, net_key())
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    assert_same(cpu, net_key())
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    assert_only(cpu, net_key(), "torch_release")
    monkeypatch.setattr(torch, "__version__", "2.13.1+cpu")
    assert_only(cpu, net_key(), "torch_release")


def test_format_version_changes_key(monkeypatch):
    base = net_key()
    monkeypatch.setattr(key_mod, "FORMAT_VERSION", key_mod.FORMAT_VERSION + 1)
    assert_only(base, net_key(), "format_version")


def test_transformations_change_key():
    none = net_key()
    assert_same(none, net_key(transformations=()))
    a = net_key(transformations=[pass_a])
    b = net_key(transformations=[pass_b])
    assert_only(none, a, "transformations")
    assert_only(a, b, "transformations")
    assert_same(a, net_key(transformations=[pass_a]))
    ab = net_key(transformations=[pass_a, pass_b])
    assert_only(a, ab, "transformations")
    assert_only(ab, net_key(transformations=[pass_b, pass_a]), "transformations")  # order matters
    p1 = net_key(transformations=[functools.partial(pass_scaled, factor=1)])
    p2 = net_key(transformations=[functools.partial(pass_scaled, factor=2)])
    assert_only(p1, p2, "transformations")


def test_transformation_from_another_file_edited_changes_key(tmp_path, monkeypatch):
    f = tmp_path / "my_pass.py"
    f.write_text("def my_pass(gm):\n    return gm\n")
    k1 = net_key(transformations=[import_file(monkeypatch, f).my_pass])
    f.write_text("def my_pass(gm):\n    gm.recompile()\n    return gm\n")
    k2 = net_key(transformations=[import_file(monkeypatch, f).my_pass])
    assert_only(k1, k2, "transformations")


def test_extra_sources_change_key(tmp_path, monkeypatch):
    f = tmp_path / "helpers_elsewhere.py"
    f.write_text("def helper(x):\n    return x * 2\n")
    none = net_key()
    k1 = net_key(extra_sources=[import_file(monkeypatch, f).helper])
    assert_only(none, k1, "transformations")
    f.write_text("def helper(x):\n    return x * 3 + 1\n")
    k2 = net_key(extra_sources=[import_file(monkeypatch, f).helper])
    assert_only(k1, k2, "transformations")


def test_spmd_aot_code_ingredient_hashes_graph_producing_files():
    k = net_key()
    expected = key_mod.spmd_aot_code()
    assert k.values["spmd_aot_code"] == expected and len(expected) == 64


def test_spmd_aot_code_is_every_graph_producing_file_in_path_order():
    """The walk skips the folders left out of the key; the digest is still that of every other
    ``*.py`` of the package, by relative path, and of the chosen op list."""
    import hashlib
    import pathlib

    from spmd_aot.format.allowlist import chosen_list

    root = pathlib.Path(key_mod.__file__).parent.parent
    left_out = key_mod._NOT_GRAPH_PRODUCING
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix()
        if "__pycache__" in rel or any(rel == part or rel.startswith(part + "/") for part in left_out):
            continue
        h.update(rel.encode() + b"\0" + path.read_bytes())
    h.update(b"format/" + chosen_list().identity())
    assert key_mod.spmd_aot_code() == h.hexdigest()
    assert "keying/key.py" in {rel for rel, _ in key_mod._package_sources()}
    assert not any(rel.startswith(("cli/", "store/")) or rel == "hints.py" for rel, _ in key_mod._package_sources())


# ---------------------------------------------------------------------------- code without files, lambdas, in-place edits
def test_model_class_without_source_file_forward_edit_changes_key(monkeypatch):
    src = textwrap.dedent("""
        import torch
        from torch import nn

        class ReplNet(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 4)

            def forward(self, x):
                return self.lin(x) OP
    """)

    def key_for(op):
        name = f"_repl_{uuid.uuid4().hex[:8]}"
        module = types.ModuleType(name)  # like __main__ under `python -c` or a notebook: no __file__
        monkeypatch.setitem(sys.modules, name, module)
        exec(compile(src.replace("OP", op), "<stdin>", "exec"), module.__dict__)
        torch.manual_seed(0)
        model = module.ReplNet()
        return key_of(model, adamw(model), net_batch())

    assert_only(key_for("* 1.0"), key_for(".relu()"), "model_code")


def test_two_different_lambdas_in_one_file_differ():
    t1 = lambda gm: gm  # noqa: E731
    t2 = lambda gm: gm.recompile()  # noqa: E731
    assert_only(net_key(transformations=[t1]), net_key(transformations=[t2]), "transformations")


def test_same_size_edit_with_same_mtime_changes_key(tmp_path, monkeypatch):
    path = tmp_path / "same_size.py"
    path.write_text(_MODEL_SRC)
    st = path.stat()
    k1 = _edited_key(monkeypatch, path)
    edited = _MODEL_SRC.replace("torch.relu(", "torch.tanh(")
    assert len(edited) == len(_MODEL_SRC)
    path.write_text(edited)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # e.g. a coarse-timestamp filesystem
    assert_only(k1, _edited_key(monkeypatch, path), "model_code")


# ---------------------------------------------------------------------------- deep fingerprint
class PlainCfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _cfg_key(**cfg):
    torch.manual_seed(0)
    model = Net()
    model.cfg = PlainCfg(**cfg)
    model.fc1.parent_cfg = model.cfg  # shared: met twice, described once
    return key_of(model, adamw(model), net_batch())


def test_config_objects_private_attributes_and_nested_values_change_key():
    base = _cfg_key(window=4, inner=PlainCfg(kind="a"), table={"x": [1, 2.5]}, tags={"b", "a"})
    assert_same(base, _cfg_key(window=4, inner=PlainCfg(kind="a"), table={"x": [1, 2.5]}, tags={"a", "b"}))
    for change in ({"window": 8}, {"inner": PlainCfg(kind="b")}, {"table": {"x": [1, 2.0]}},
                   {"tags": {"a"}}, {"table": {"y": [1, 2.5]}}):
        cfg = dict(window=4, inner=PlainCfg(kind="a"), table={"x": [1, 2.5]}, tags={"b", "a"}, **{})
        cfg.update(change)
        assert_only(base, _cfg_key(**cfg), "module_structure")
    torch.manual_seed(0)
    model = Net()
    model._window = 4  # private attributes count too
    other = Net()
    other._window = 8
    assert_only(key_of(model, adamw(model), net_batch()), key_of(other, adamw(other), net_batch()),
                "module_structure")


def test_cycles_bound_methods_and_partials_are_fingerprinted():
    def key_with(scale):
        torch.manual_seed(0)
        model = Net()
        model.fc2.helper = PlainCfg(scale=scale, back=model.fc2, root=model)  # cycles back
        model.fc2.fn = model.fc2.helper.__dict__.get  # a bound builtin method of a dict
        model.fc1.act = functools.partial(torch.clamp, min=scale)
        return key_of(model, adamw(model), net_batch())

    assert_same(key_with(0.0), key_with(0.0))
    assert_only(key_with(0.0), key_with(1.0), "module_structure")


def test_hooks_change_key_but_hook_ids_do_not():
    def hook(module, args, out):
        return out

    torch.manual_seed(0)
    a = Net()
    a.fc1.register_forward_hook(hook)
    for _ in range(3):
        nn.Linear(1, 1).register_forward_hook(hook)  # moves the global hook id counter
    b = Net()
    b.fc1.register_forward_hook(hook)
    assert_same(key_of(a, adamw(a), net_batch()), key_of(b, adamw(b), net_batch()))
    b.fc1.register_forward_pre_hook(lambda m, args: None)
    assert_only(key_of(a, adamw(a), net_batch()), key_of(b, adamw(b), net_batch()), "module_structure")
    c = Net()
    c.fc2.register_full_backward_hook(lambda m, gi, go: None)
    assert_only(net_key(), key_of(c, adamw(c), net_batch()), "module_structure")


def test_global_module_and_optimizer_hooks_and_modes_change_key():
    from torch.nn.modules.module import register_module_forward_hook

    base = net_key()
    handle = register_module_forward_hook(lambda m, a, out: out)
    try:
        assert_only(base, net_key(), "global_state")
    finally:
        handle.remove()
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: None)
    try:
        assert_only(base, net_key(), "global_state")
    finally:
        handle.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_only(base, net_key(), "global_state")
    with torch.no_grad():
        assert_only(base, net_key(), "global_state")
    torch.use_deterministic_algorithms(True)
    try:
        assert_only(base, net_key(), "global_state")
    finally:
        torch.use_deterministic_algorithms(False)
    assert_same(base, net_key())


def test_step_globals_and_user_module_attributes_change_key(tmp_path, monkeypatch):
    (tmp_path / "cfg_mod_for_key.py").write_text("WEIGHT = 1.0\n")
    f = tmp_path / "steps_reading_globals.py"
    f.write_text(textwrap.dedent("""
        from torch.nn import functional as F
        import cfg_mod_for_key as cfg
        SCALE = 1.0

        def step(model, optim, batch):
            x, y = batch
            loss = F.cross_entropy(model(x), y) * SCALE * cfg.WEIGHT
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = import_file(monkeypatch, f)
    base = mlp_key(step=mod.step)
    monkeypatch.setattr(mod, "SCALE", 2.0)
    assert_only(base, mlp_key(step=mod.step), "step_code")
    monkeypatch.setattr(mod, "SCALE", 1.0)
    monkeypatch.setattr(sys.modules["cfg_mod_for_key"], "WEIGHT", 3.0)
    assert_only(base, mlp_key(step=mod.step), "step_code")
    monkeypatch.setattr(sys.modules["cfg_mod_for_key"], "WEIGHT", 1.0)
    assert_same(base, mlp_key(step=mod.step))
    # a dotted import: pkg.sub.VALUE
    (tmp_path / "cfgpkg_for_key").mkdir()
    (tmp_path / "cfgpkg_for_key" / "__init__.py").write_text("")
    (tmp_path / "cfgpkg_for_key" / "sub.py").write_text("VALUE = 1.0\n")
    g = tmp_path / "steps_dotted.py"
    g.write_text(textwrap.dedent("""
        from torch.nn import functional as F
        import cfgpkg_for_key.sub

        def step(model, optim, batch):
            x, y = batch
            loss = F.cross_entropy(model(x), y) * cfgpkg_for_key.sub.VALUE
            loss.backward()
            optim.step()
            optim.zero_grad()
            return loss
    """))
    dotted = import_file(monkeypatch, g)
    base = mlp_key(step=dotted.step)
    monkeypatch.setattr(sys.modules["cfgpkg_for_key.sub"], "VALUE", 2.0)
    assert_only(base, mlp_key(step=dotted.step), "step_code")


def test_too_deep_or_opaque_values_stop_the_key_naming_their_path():
    import threading

    torch.manual_seed(0)
    model = Net()
    deep = []
    for _ in range(100):
        deep = [deep]
    model.fc1.deep = deep
    with pytest.raises(SpmdAotError, match=r"model\.fc1\.deep\[0\].*deeper than"):
        key_of(model, adamw(model), net_batch())
    del model.fc1.deep
    model.drop.cfg = PlainCfg(lock=threading.Lock())
    with pytest.raises(SpmdAotError, match=r"model\.drop\.cfg\.lock: cannot fingerprint _thread\.lock.*register_fingerprint"):
        key_of(model, adamw(model), net_batch())


def test_spmd_aot_code_walks_the_package(tmp_path, monkeypatch):
    copy = tmp_path / "spmd_aot"
    shutil.copytree(pathlib.Path(key_mod.__file__).parent.parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(key_mod, "_PACKAGE_DIR", copy)
    base = key_mod.spmd_aot_code()
    assert base == key_mod.spmd_aot_code()
    for message_only in ("cli/app.py", "hints.py", "keying/explain.py", "runtime/device_check.py"):
        (copy / message_only).write_text((copy / message_only).read_text() + "\n# a comment\n")
        assert key_mod.spmd_aot_code() == base, message_only  # talks to people only
    for graph_producing in ("parallel/plan.py", "passes/cleanup.py", "new_module.py", "tracing/new_module.py"):
        path = copy / graph_producing
        path.write_text((path.read_text() if path.exists() else "") + "\n# edited\n")
        assert key_mod.spmd_aot_code() != base, graph_producing
        base = key_mod.spmd_aot_code()


def test_every_environment_variable_the_package_reads_is_classified():
    import re

    names = set()
    for f in pathlib.Path(key_mod.__file__).parent.parent.rglob("*.py"):
        text = f.read_text()
        names.update(re.findall(r'"((?:SPMD_AOT|AWS|XDG)_[A-Z0-9_]+)"', text))
        names.update(re.findall(r'environ(?:\.get)?\(\s*"([A-Z0-9_]+)"', text))
        names.update(re.findall(r'environ\[\s*"([A-Z0-9_]+)"', text))
    names -= {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
              "AWS_REGION"}  # read by boto3 for the remote store, not by us
    unclassified = names - set(key_mod.ENVIRONMENT_NOT_IN_KEY)
    assert not unclassified, f"classify these in key.ENVIRONMENT_NOT_IN_KEY (or key them): {unclassified}"


def test_plain_references_to_parameters_are_not_value_guarded_and_fake_equals_real():
    def make():
        model = Net()
        model.cfg = PlainCfg(tied=model.fc1.weight, table=torch.zeros(3))
        optim = adamw(model)
        initialize_optimizer_state(optim)
        return model, optim, net_batch()

    with FakeTensorMode(), torch.device("cpu"):
        fake = make()
    real = make()
    k_fake = compute_key(train_step, TrainState(*fake, Plan(2)), Plan(2))
    k_real = compute_key(train_step, TrainState(*real, Plan(2)), Plan(2))
    assert_same(k_fake, k_real)
    assert sorted(k_real.tensors) == ["model.cfg.table"]  # a parameter is an input, never a constant
