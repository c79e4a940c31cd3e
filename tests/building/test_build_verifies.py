"""A build stores only what loads: every artifact a build stores passes ``spmd-aot verify`` (the
checks every load runs), over the example models and a packed-QKV model, for every placement;
a graph that fails those checks is a build error and nothing is stored under its key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spmd_aot
from spmd_aot.cli.app import main
from spmd_aot.examples.models import MLP, train_step
from spmd_aot.format import contracts
from spmd_aot.format.contracts.table import CONTRACTS, Contract
from spmd_aot.store import LocalStore
from support.jobs import MLP_JOB_FILE, MODELS, make_batch

aten = torch.ops.aten
VOCAB, D, HEAD_DIM = 32, 16, 4


# ---------------------------------------------------------------------------- a packed-QKV model
class PackedAttention(nn.Module):
    """One linear makes q, k and v (nanoGPT's ``c_attn``, GPT-NeoX, Phi-3); heads are counted
    from the tensor (so tensor parallelism may split them) and made contiguous before SDPA. Under
    the packed TP plan (``colwise_gather_output`` / ``rowwise_split_input``) the gradient reaching
    SDPA's backward is laid out by the output projection's gather: not stride 1 in its last dim."""

    def __init__(self, d: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        heads = q.shape[-1] // self.head_dim
        split = lambda z: z.view(b, t, heads, self.head_dim).transpose(1, 2).contiguous()  # noqa: E731
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return self.out(out.transpose(1, 2).reshape(b, t, -1))


class PackedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.attn = PackedAttention(D, HEAD_DIM)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.tok(idx)
        x = x + self.attn(x)
        return self.head(x + self.down(F.gelu(self.up(x))))


def _token_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# name -> (job, the TP plan its TP placements use)
JOBS = {
    "mlp": (spmd_aot.Job(step=train_step, model=MODELS["mlp"], optimizer=_sgd, batch=lambda: make_batch("mlp")),
            {"fc1": "colwise", "fc2": "rowwise"}),
    "transformer": (spmd_aot.Job(step=train_step, model=MODELS["transformer"], optimizer=_sgd,
                                 batch=lambda: make_batch("transformer")),
                    {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}),
    "packed_qkv": (spmd_aot.Job(step=train_step, model=PackedQKV, optimizer=_sgd, batch=_token_batch),
                   {"attn.qkv": "colwise_gather_output", "attn.out": "rowwise_split_input",
                    "up": "colwise", "down": "rowwise"}),
}
# name -> (world size, options without the TP plan, whether the TP plan applies)
PLACEMENTS = {
    "replicate": (2, {"placement": "replicate"}, False),
    "shard": (2, {"placement": "shard"}, False),
    "tp": (2, {"placement": "replicate"}, True),
    "shard_x_tp": (4, {"placement": "shard", "mesh_shape": (2, 2)}, True),
}


@pytest.mark.parametrize("model", list(JOBS))
def test_every_placement_of_a_build_passes_verify(tmp_path, capsys, model):
    job, tp_plan = JOBS[model]
    for world, options, tp in PLACEMENTS.values():
        spmd_aot.build(job, world_size=world, cache_dir=str(tmp_path), **options, **({"tp_plan": tp_plan} if tp else {}))
    capsys.readouterr()
    assert main(["verify", "--cache-dir", str(tmp_path)]) == 0, capsys.readouterr().out
    assert f"{len(PLACEMENTS)} artifacts checked, 0 problems" in capsys.readouterr().out


def _packed_tp_worker(rank, world, cache_dir, steps):
    """The loaded TP step against the unsplit model trained eagerly in this process (the TP ranks
    share one batch): the largest loss and parameter differences."""
    from support.features import full

    models, losses = [], []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = PackedQKV()
        optim = _sgd(model)
        fn = spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True, placement="replicate",
                              tp_plan=JOBS["packed_qkv"][1]) if compiled else train_step
        losses.append([fn(model, optim, _token_batch()).item() for _ in range(steps)])
        models.append(dict(model.named_parameters()))
    eager, loaded = models
    return (max(abs(a - b) for a, b in zip(*losses)),
            max((full(loaded[name]) - p).abs().max().item() for name, p in eager.items()))


def test_the_packed_qkv_tp_build_loads_on_gloo_ranks_and_matches_eager(tmp_path):
    """The artifact the packed TP plan stores (a strided grad_out into SDPA's backward) loads on
    every rank and trains as the unsplit model does (gathered q, k, v: the same function)."""
    from support.multiproc import run_ranks

    job, tp_plan = JOBS["packed_qkv"]
    spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path), placement="replicate", tp_plan=tp_plan)
    for loss, param in run_ranks(_packed_tp_worker, 2, str(tmp_path), 5):
        assert loss <= 1e-5 and param <= 1e-5, (loss, param)


# ---------------------------------------------------------------------------- SDPA's grad_out contract
B, H, L, E = 2, 4, 16, 8
FLASH, FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu.default, \
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _laid_out_as_gathered(t):
    """``t``'s values in the layout the packed TP plan's gather gives (strides [16, 256, 1, 32])."""
    return t.permute(1, 3, 0, 2).contiguous().permute(2, 0, 3, 1)


def test_flash_attention_backward_takes_a_strided_grad_out_as_its_kernel_does():
    """The CPU kernel copies ``grad_out`` to a contiguous tensor before its gemms, so any strides
    give the contiguous call's results exactly; the contract admits them."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    out, lse = FLASH(q, k, v, 0.0, True)
    g = torch.randn(B, H, L, E)
    for strided in (_laid_out_as_gathered(g), g[..., :1].expand(B, H, L, E), g.transpose(2, 3).contiguous().transpose(2, 3)):
        assert strided.stride(-1) != 1
        args = (strided, q, k, v, out, lse, 0.0, True)
        contracts.check_call(FLASH_BACKWARD, args, {})
        want = FLASH_BACKWARD(strided.contiguous(), *args[1:])
        assert all(torch.equal(a, b) for a, b in zip(FLASH_BACKWARD(*args), want))


@pytest.mark.parametrize("argument", ["out", "query"])
def test_flash_attention_still_refuses_rows_it_reads_as_vectors(argument):
    """``out`` and ``query`` are read as dense rows: with other strides the kernel computes garbage
    (and, with a broadcast last dim, reads past the tensor), so the contract refuses them."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    out, lse = FLASH(q, k, v, 0.0, True)
    given = {"query": q, "out": out}
    given[argument] = _laid_out_as_gathered(given[argument])
    args = (torch.randn(B, H, L, E), given["query"], k, v, given["out"], lse, 0.0, True)
    with pytest.raises(contracts.Broken, match=f"argument '{argument}' must have stride 1 in its last dimension"):
        contracts.check_call(FLASH_BACKWARD, args, {})


# ---------------------------------------------------------------------------- a failing graph is not stored
@pytest.fixture
def mm_contract_fails(monkeypatch):
    """``aten::mm``'s contract refusing every call: a graph the load check refuses."""
    def refuse(a):
        raise contracts.Broken("self", "is refused by this test's contract")
    original = CONTRACTS["aten::mm.default"]
    monkeypatch.setitem(CONTRACTS, "aten::mm.default", Contract(refuse, original.alias_ok, original.family))


def test_a_build_the_load_check_refuses_raises_and_stores_nothing(tmp_path, mm_contract_fails):
    job = spmd_aot.Job(step=train_step, model=lambda: MLP(32, 64, 10), optimizer=_sgd, batch=lambda: make_batch("mlp"))
    with pytest.raises(spmd_aot.UnsupportedError) as info:
        spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path))
    message = str(info.value)
    assert "fails the check every load runs, so nothing was stored under key" in message, message
    assert "(mm.default) breaks its op's argument contract: argument 'self' is refused by this test's contract" \
        in message, message
    store = LocalStore(str(tmp_path))
    assert store.refs() == {}
    assert list(store.blobs()) == []


def test_the_cli_build_exits_2_naming_the_op_and_stores_no_ref(tmp_path, capsys, mm_contract_fails):
    job_file = tmp_path / "mlp_job.py"
    job_file.write_text(MLP_JOB_FILE)
    cache = tmp_path / "cache"
    assert main(["build", f"{job_file}:job", "-w", "2", "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "mm.default" in err and "argument 'self' is refused" in err, err
    assert not (cache.exists() and LocalStore(str(cache)).refs())


# ---------------------------------------------------------------------------- an existing entry a load refuses
def test_a_build_does_not_report_a_cached_entry_the_load_check_refuses(tmp_path, monkeypatch):
    """An entry stored earlier (by an older spmd-aot, or a writer of the cache) that a load would
    refuse does not count as cached: the build traces again; when the new graph fails too, it raises."""
    job = spmd_aot.Job(step=train_step, model=lambda: MLP(32, 64, 10), optimizer=_sgd, batch=lambda: make_batch("mlp"))
    first = spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path))
    assert first.traced
    original = CONTRACTS["aten::mm.default"]

    def refuse(a):
        raise contracts.Broken("self", "is refused by this test's contract")
    monkeypatch.setitem(CONTRACTS, "aten::mm.default", Contract(refuse, original.alias_ok, original.family))
    with pytest.raises(spmd_aot.UnsupportedError, match="fails the check every load runs"):
        spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path))
    assert LocalStore(str(tmp_path)).refs() == {first.key: first.digest}  # nothing replaced it
    monkeypatch.setitem(CONTRACTS, "aten::mm.default", original)
    again = spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path))
    assert not again.traced and again.digest == first.digest


def test_an_existing_entry_the_load_check_refuses_is_rebuilt(tmp_path, monkeypatch, caplog):
    from spmd_aot.building import pipeline
    from spmd_aot.errors import UnsafeArtifactError

    job = spmd_aot.Job(step=train_step, model=lambda: MLP(32, 64, 10), optimizer=_sgd, batch=lambda: make_batch("mlp"))
    first = spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path))
    checked, real = [], pipeline.check_entry

    def refused_once(store, key, digest):  # the stored entry fails the load check; a new one passes
        checked.append(digest)
        if len(checked) == 1:
            raise UnsafeArtifactError(f"node mm (mm.default) breaks its op's argument contract (in {digest[:12]})")
        return real(store, key, digest)
    monkeypatch.setattr(pipeline, "check_entry", refused_once)
    with caplog.at_level("WARNING", logger="spmd_aot.building.pipeline"):
        again = spmd_aot.build(job, world_size=2, cache_dir=str(tmp_path))
    assert again.traced and checked == [first.digest]
    assert "is damaged (node mm (mm.default) breaks its op's argument contract" in caplog.text
    assert LocalStore(str(tmp_path)).refs()[again.key] == again.digest
