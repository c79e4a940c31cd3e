"""Shard / HSDP communication per group (FSDP2's per-module all_gather and reduce_scatter):
counts and order on the stored graph, and parity with eager FSDP2 ``fully_shard`` per block."""

import pytest
import torch

import spmd_aot
from spmd_aot.entries import read_artifact
from spmd_aot.examples.models import Block, Transformer, train_step
from spmd_aot.parallel.groups import assign_groups, block_prefixes
from spmd_aot.parallel.plan import Plan
from spmd_aot.store import LocalStore
from support.multiproc import run_launches

LAYERS, D, VOCAB, CTX = 3, 16, 41, 8  # 41: uneven shards (padding) in the root group


def _model():
    return Transformer(VOCAB, D, 4, LAYERS, CTX)


def _optim(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (2, CTX), generator=g), torch.randint(0, VOCAB, (2, CTX), generator=g)


JOB = spmd_aot.Job(step=train_step, model=_model, optimizer=_optim, batch=lambda: _batch(0, 0))


class DictTransformer(Transformer):
    """The same model with its blocks in an ``nn.ModuleDict`` under ``layers``, as torchtitan
    keeps them; built in the same order from the same seed, so its parameters equal the
    ModuleList twin's."""

    def __init__(self, vocab, d_model, n_heads, n_layers, max_len):
        torch.nn.Module.__init__(self)
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(max_len, d_model)
        self.layers = torch.nn.ModuleDict({str(i): Block(d_model, n_heads) for i in range(n_layers)})
        self.ln_f = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.layers.values():
            x = block(x)
        return self.head(self.ln_f(x))


def _dict_model():
    return DictTransformer(VOCAB, D, 4, LAYERS, CTX)


DICT_JOB = spmd_aot.Job(step=train_step, model=_dict_model, optimizer=_optim, batch=lambda: _batch(0, 0))


def _collectives(tmp_path, built):
    """(kind, node) of every collective of the stored graph, in graph order."""
    gm = read_artifact(LocalStore(tmp_path), built.digest).graph_module(["0", "1"], torch.device("cpu"))
    out = []
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", "")
        if getattr(n.target, "namespace", None) == "_c10d_functional" and not name.startswith("wait_tensor"):
            out.append((name.split(".")[0], n))
    return gm, out


def _group_numels(shards: int, groups=()):
    """label -> sorted per-rank (padded shard) sizes of the group's parameters."""
    model = _model()
    plan = Plan(shards, "shard", shard_groups=groups)
    fqns = [(n, "float32") for n, _ in model.named_parameters()]
    sizes = {n: -(-p.shape[0] // shards) * p[0].numel() for n, p in model.named_parameters()}
    return {g.label: sorted(sizes[f] for f in g.fqns) for g in assign_groups(model, plan, fqns)}


def _wait(node):
    (wait,) = node.users
    assert wait.target.__name__.startswith("wait_tensor")
    return wait


def _gathered_sizes(gather):
    """Per-parameter sizes one all_gather carries: its copy-out split (view -> split_with_sizes_copy)."""
    (view,) = _wait(gather).users
    (split,) = view.users
    assert split.target.__name__.startswith("split_with_sizes_copy") and split.args[2] == 1
    return sorted(split.args[1])


def _scattered_sizes(scatter):
    """Per-parameter sizes one reduce_scatter returns: the slices of its output."""
    users = _wait(scatter).users
    assert all(u.target.__name__.startswith("slice") for u in users)
    return sorted(u.args[3] - u.args[2] for u in users)


# ---------------------------------------------------------------- which groups
def test_default_groups_are_the_blocks_and_the_root():
    model = _model()
    assert block_prefixes(model) == [f"blocks.{i}" for i in range(LAYERS)]
    groups = assign_groups(model, Plan(2, "shard"), [(n, "float32") for n, _ in model.named_parameters()])
    assert [g.label for g in groups] == ["root"] + [f"blocks.{i}" for i in range(LAYERS)]
    assert set(groups[0].fqns) == {"tok.weight", "pos.weight", "ln_f.weight", "ln_f.bias", "head.weight", "head.bias"}
    assert all(f.startswith("blocks.1.") for f in groups[2].fqns) and len(groups[2].fqns) == 11
    # FSDP2 does not reshard its root after forward; blocks are
    assert [g.reshard for g in groups] == [False] + [True] * LAYERS
    kept = assign_groups(model, Plan(2, "shard", reshard_after_forward=False),
                         [(n, "float32") for n, _ in model.named_parameters()])
    assert not any(g.reshard for g in kept)


def test_module_dict_children_are_blocks_like_module_list_children():
    model, twin = _dict_model(), _model()
    assert block_prefixes(model) == [f"layers.{i}" for i in range(LAYERS)]
    groups = assign_groups(model, Plan(2, "shard"), [(n, "float32") for n, _ in model.named_parameters()])
    twins = assign_groups(twin, Plan(2, "shard"), [(n, "float32") for n, _ in twin.named_parameters()])
    assert [g.label for g in groups] == ["root"] + [f"layers.{i}" for i in range(LAYERS)]
    assert [[f.replace("layers.", "blocks.") for f in g.fqns] for g in groups] == [list(g.fqns) for g in twins]
    # a ModuleDict of different modules is a namespace (towers, heads): its contents are looked into
    towers = torch.nn.ModuleDict({"text": _model(), "vision": _dict_model(), "head": torch.nn.Linear(2, 2)})
    assert block_prefixes(towers) == [f"text.blocks.{i}" for i in range(LAYERS)] + \
        [f"vision.layers.{i}" for i in range(LAYERS)]
    nested = torch.nn.ModuleDict({"enc": torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]),
                                  "dec": torch.nn.ModuleList([torch.nn.Linear(2, 2)])})
    assert block_prefixes(nested) == ["enc.0", "enc.1", "dec.0"]


def test_a_module_dict_model_communicates_per_block(tmp_path, shard_build):
    built = spmd_aot.build(DICT_JOB, world_size=2, placement="shard", cache_dir=tmp_path)
    _, twin = shard_build
    assert built.stats["by_kind"] == twin.stats["by_kind"]
    assert built.stats["by_kind"]["reduce_scatter_tensor"] == LAYERS + 1


def test_a_sequential_root_groups_each_layer():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    assert block_prefixes(model) == ["0", "1.0", "1.1"]


# ---------------------------------------------------------------- stored graph
@pytest.fixture(scope="module")
def shard_build(tmp_path_factory):
    """(cache dir, build result) of JOB sharded over 2 ranks with the default groups, built once
    for the tests that read its graph."""
    cache = tmp_path_factory.mktemp("shard")
    return cache, spmd_aot.build(JOB, world_size=2, placement="shard", cache_dir=cache)


def test_shard_gathers_and_reduces_once_per_group(shard_build):
    cache, built = shard_build
    groups = LAYERS + 1
    # resharded blocks are gathered twice (forward, backward); the root once (never resharded)
    assert built.stats["by_kind"] == {"all_gather_into_tensor": 2 * LAYERS + 1, "reduce_scatter_tensor": groups}
    _, colls = _collectives(cache, built)
    numels = _group_numels(2)
    gathered = sorted(_gathered_sizes(n) for kind, n in colls if kind == "all_gather_into_tensor")
    assert gathered == sorted([numels["root"]] + [numels[f"blocks.{i}"] for i in range(LAYERS)] * 2)
    scattered = sorted(_scattered_sizes(n) for kind, n in colls if kind == "reduce_scatter_tensor")
    assert scattered == sorted(numels.values())  # every parameter of the group in one collective


def test_custom_shard_groups(tmp_path):
    patterns = ("blocks.*.attn.*", "blocks.*")  # first match wins: attention of every block, the rest
    built = spmd_aot.build(JOB, world_size=2, placement="shard", cache_dir=tmp_path, shard_groups=patterns)
    assert built.stats["by_kind"] == {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 3}
    _, colls = _collectives(tmp_path, built)
    numels = _group_numels(2, patterns)
    assert sorted(numels) == ["blocks.*", "blocks.*.attn.*", "root"]
    scattered = sorted(_scattered_sizes(n) for kind, n in colls if kind == "reduce_scatter_tensor")
    assert scattered == sorted(numels.values())


@pytest.fixture(scope="module")
def hsdp_build(tmp_path_factory):
    """(cache dir, build result) of JOB as HSDP on a (2, 2) mesh."""
    cache = tmp_path_factory.mktemp("hsdp")
    return cache, spmd_aot.build(JOB, world_size=4, placement="shard", mesh_shape=(2, 2), cache_dir=cache)


def test_hsdp_reduces_each_group_over_the_replicas_once(hsdp_build):
    _, built = hsdp_build
    groups = LAYERS + 1
    assert built.stats["by_kind"] == {"all_gather_into_tensor": 2 * LAYERS + 1, "reduce_scatter_tensor": groups,
                                      "all_reduce": groups}


def test_keeping_parameters_after_forward_gathers_once(tmp_path, shard_build):
    built = spmd_aot.build(JOB, world_size=2, placement="shard", cache_dir=tmp_path, reshard_after_forward=False)
    assert built.stats["by_kind"] == {"all_gather_into_tensor": LAYERS + 1, "reduce_scatter_tensor": LAYERS + 1}
    _, resharded = shard_build
    assert resharded.stats["peak_bytes"] < built.stats["peak_bytes"]


def _compute_ops(nodes):
    return [n for n in nodes if getattr(n.target, "__name__", "").split(".")[0] in ("mm", "addmm", "bmm")]


def test_next_group_is_gathered_while_the_current_one_computes(shard_build):
    gm, colls = _collectives(*shard_build)
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    gathers = [n for kind, n in colls if kind == "all_gather_into_tensor"]
    seen, forward, backward = set(), [], []
    for g in gathers:  # a group's first gather is its forward one, a second its backward re-gather
        params = _placeholders(g)
        (backward if params in seen else forward).append(g)
        seen.add(params)
    assert len(forward) == LAYERS + 1 and len(backward) == LAYERS
    assert _placeholders(backward[0]) == _placeholders(forward[-1])  # backward starts with the last block
    for phase in (forward, backward):
        for current, following in zip(phase, phase[1:]):
            # group k+1's all_gather is issued after group k's arrives and before any of its compute
            waited = _wait(current)
            assert pos[waited] < pos[following]
            uses = [u for u in nodes[pos[waited]:] if pos[u] > pos[waited] and _reads(u, waited)]
            first_use = min(pos[u] for u in uses)
            assert pos[following] < first_use
            assert not _compute_ops(nodes[pos[waited]:pos[following]])
            assert first_use < pos[_wait(following)]  # group k computes while k+1's transfer runs


def _placeholders(node):
    """The graph inputs a node is computed from (for a gather: its group's parameter shards)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return frozenset(n.name for n in seen if n.op == "placeholder")


def _reads(node, source):
    """Whether ``node`` reads ``source`` through views/copies of the gathered buffer."""
    seen, stack = set(), [source]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u is node:
                return True
            if u not in seen and getattr(u.target, "__name__", "").split(".")[0] in ("view", "split_with_sizes_copy",
                                                                                     "getitem"):
                seen.add(u)
                stack.append(u)
    return False


# ---------------------------------------------------------------- parity with eager FSDP2
STEPS = 3


def _parity_worker(rank, world, caches, variants):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from support import features

    out = {}
    for name, options in variants.items():
        shape = tuple(options.get("mesh_shape") or (world,))
        options = dict(options)
        make = _dict_model if options.pop("module_dict", False) else _model
        torch.manual_seed(0)
        ref = make()
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        for block in (ref.layers.values() if make is _dict_model else ref.blocks):
            fully_shard(block, mesh=mesh, reshard_after_forward=options.get("reshard_after_forward", True))
        fully_shard(ref, mesh=mesh)
        ref_optim = _optim(ref)
        ref_losses = [train_step(ref, ref_optim, _batch(rank, s)).detach() for s in range(STEPS)]
        torch.manual_seed(0)
        model = make()
        optim = _optim(model)
        fn = spmd_aot.compile(train_step, cache_dir=caches[name], placement="shard", **options)
        losses = [fn(model, optim, _batch(rank, s)).detach() for s in range(STEPS)]
        out[name] = features.max_diffs(ref, ref_optim, model, optim, ref_losses, losses), fn.cache_info.hit
    return out


PARITY_VARIANTS = {
    2: {"shard": {}, "custom_groups_kept": {"shard_groups": ("blocks.*.mlp.*", "blocks.*"),
                                            "reshard_after_forward": False},
        "module_dict": {"module_dict": True}},
    4: {"hsdp": {"mesh_shape": (2, 2)}},
}


@pytest.fixture(scope="module")
def parity(tmp_path_factory, shard_build, hsdp_build):
    """world -> per-rank {variant: (diffs, cache hit)}; both worlds' ranks run at the same time.
    "shard" and "hsdp" load the artifacts built above (offline, as CI would); the job that keeps
    its parameters and the ModuleDict model trace their own at the first call."""
    caches = {"shard": str(shard_build[0]), "hsdp": str(hsdp_build[0]),
              "custom_groups_kept": str(tmp_path_factory.mktemp("custom_groups_kept")),
              "module_dict": str(tmp_path_factory.mktemp("module_dict"))}
    launches = [(_parity_worker, world, caches, variants) for world, variants in PARITY_VARIANTS.items()]
    return dict(zip(PARITY_VARIANTS, run_launches(*launches, timeout=400)))


@pytest.mark.parametrize("world,variant", [(w, v) for w, vs in PARITY_VARIANTS.items() for v in vs])
def test_grouped_shard_matches_fsdp2_per_block(parity, world, variant):
    for rank, per_rank in enumerate(parity[world]):
        diffs, hit = per_rank[variant]
        assert max(diffs.values()) <= 1e-5, f"rank {rank} {variant}: {diffs}"
        assert hit == (variant not in ("custom_groups_kept", "module_dict")), f"rank {rank} {variant}: cache hit {hit}"
