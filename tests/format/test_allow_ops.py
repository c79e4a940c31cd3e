"""Opting in to overloads beyond the allowlist: the build's opt-in is recorded in the entry, and a
job loads such an entry only when it opts in to the same overloads itself (a writer of the cache
cannot widen the list); refused families and unknown names cannot be opted in to."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_aot
from spmd_aot.format.allowlist import ENV_ALLOW_OPS, allowed_ops
from spmd_aot.entries import read_manifest
from spmd_aot.cli.app import main as cli
from spmd_aot.errors import OpNotAllowedError, SpmdAotError, UnsafeArtifactError
from spmd_aot.store import LocalStore

EXTRA = "aten::erfinv.default"  # an ordinary elementwise op that is not on the list


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.erfinv(torch.tanh(self.lin(x)) * 0.5)


def step(model, optim, batch):
    loss = model(batch).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def make_model():
    torch.manual_seed(0)
    return Net()


JOB = spmd_aot.Job(step=step, model=make_model, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                   batch=lambda: torch.randn(2, 4))
JOB_FILE = '''\
from test_allow_ops import JOB as job
'''


def test_the_op_is_off_the_list():
    assert EXTRA not in allowed_ops()


def test_build_without_opt_in_names_the_op_and_how(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_ALLOW_OPS, raising=False)
    with pytest.raises(UnsafeArtifactError, match=rf"{EXTRA}.*allow_ops=\['{EXTRA}'\].*--allow-op"):
        spmd_aot.build(JOB, world_size=1, cache_dir=tmp_path)


def test_opted_in_entry_loads_only_for_a_job_that_opts_in(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_ALLOW_OPS, raising=False)
    built = spmd_aot.build(JOB, world_size=1, cache_dir=tmp_path, allow_ops=[EXTRA])
    store = LocalStore(tmp_path)
    assert read_manifest(store, built.digest)["stats"]["opted_in_ops"] == [EXTRA]

    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    refusing = spmd_aot.compile(step, cache_dir=tmp_path)
    with pytest.raises(OpNotAllowedError, match=rf"allow_ops=\['{EXTRA}'\]"):
        refusing(model, optim, torch.randn(2, 4))
    assert store.get_ref(built.key) == built.digest  # the entry is kept, not rebuilt over

    ref = make_model()
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    ref_losses = [step(ref, ref_optim, b).item() for b in batches]
    compiled = spmd_aot.compile(step, cache_dir=tmp_path, require_hit=True, allow_ops=[EXTRA])
    losses = [compiled(model, optim, b).item() for b in batches]
    assert compiled.cache_info.traces == 0
    assert max(abs(a - b) for a, b in zip(ref_losses, losses)) <= 1e-6
    assert (model.lin.weight - ref.lin.weight).abs().max().item() <= 1e-6

    # the environment variable is the same opt-in, for jobs started by torchrun
    monkeypatch.setenv(ENV_ALLOW_OPS, EXTRA)
    by_env = spmd_aot.compile(step, cache_dir=tmp_path, require_hit=True)
    fresh = make_model()
    by_env(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), batches[0])
    assert by_env.cache_info.traces == 0


@pytest.mark.parametrize("name,why", [
    ("aten::as_strided_.default", "can never be allowed"),
    ("aten::_reshape_alias.default", "can never be allowed"),
    ("aten::set_.source_Tensor", "can never be allowed"),
    ("aten::no_such_op.default", "does not exist"),
    ("erfinv", "not an operator overload name"),
])
def test_refused_and_unknown_names_cannot_be_opted_in(tmp_path, name, why):
    with pytest.raises(SpmdAotError, match=why):
        spmd_aot.build(JOB, world_size=1, cache_dir=tmp_path, allow_ops=[name])
    with pytest.raises(SpmdAotError, match=why):
        spmd_aot.compile(step, allow_ops=[name])


def test_cli_build_and_verify_take_the_same_opt_in(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(ENV_ALLOW_OPS, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "allow_job.py").write_text(JOB_FILE)
    cache = str(tmp_path / "cache")
    assert cli(["build", "allow_job:job", "-w", "1", "--cache-dir", cache]) == 2
    assert EXTRA in capsys.readouterr().err
    assert cli(["build", "allow_job:job", "-w", "1", "--cache-dir", cache, "--allow-op", EXTRA]) == 0
    assert cli(["verify", "--cache-dir", cache]) == 1  # without the opt-in the graph is refused
    assert EXTRA in capsys.readouterr().out
    assert cli(["verify", "--cache-dir", cache, "--allow-op", EXTRA]) == 0


def _build_time_refusal(op) -> str:
    import torch.fx

    from spmd_aot.format.serialize import encode_graph

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(op, (x,) + ((0, 1) if op is torch.ops.aten.transpose_.default else ())))
    with pytest.raises(UnsafeArtifactError) as info:
        encode_graph(graph, {})
    return str(info.value)


@pytest.mark.parametrize("op", [torch.ops.aten._reshape_alias.default, torch.ops.aten.transpose_.default,
                                torch.ops.aten.erfinv.default])
def test_a_refusal_offers_an_opt_in_only_where_the_opt_in_is_accepted(op):
    """No dead end: the build-time message offers allow_ops only for an op that opt_in_names
    then accepts; for a refused family it says no opt-in can allow it."""
    from spmd_aot.format.allowlist import opt_in_names

    name = f"{op.namespace}::{op._opname}.{op._overloadname}"
    text = _build_time_refusal(op)
    if "allow_ops=" in text:
        assert "no opt-in can allow" not in text
        assert opt_in_names([name]) == {name}
    else:
        assert "no opt-in can allow" in text and "--allow-op" not in text, text
        with pytest.raises(SpmdAotError, match="can never be allowed"):
            opt_in_names([name])
    assert ("allow_ops=" in text) == (op is torch.ops.aten.erfinv.default)
