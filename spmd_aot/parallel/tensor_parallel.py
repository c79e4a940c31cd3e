"""Tensor parallelism (Megatron style) on the last mesh dimension, in the vocabulary of
``torch.distributed.tensor.parallel.parallelize_module``.

A plan maps module FQN patterns (fnmatch, first match wins) to a style, e.g.
``{"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}``. One class per style owns
its text form (``name``), which tensor dimension of each of the module's parameters is split
over the TP ranks (``param_dims``), the collectives one call of the module needs (``budget``)
and the module's forward on local tensors while the step is traced.

As everywhere in spmd-aot the model computes on local tensors; a planned ``nn.Linear`` reads
its TP-local weight and bias (``_ComputeOnAccess`` in ``trace.py``), and its forward is
swapped, while tracing only, for the style's:

- ``colwise`` (``ColwiseParallel``): weight and bias split on dim 0 (output features). The
  input is *copied to the TP region*: identity in forward, ``all_reduce(sum)`` of its gradient
  over the TP ranks in backward; modules reading the same input tensor (``q``, ``k``, ``v``)
  share one copy, hence one all_reduce. The output is the local slice of the features
  (``use_local_output=True``).
- ``rowwise`` (``RowwiseParallel``): weight split on dim 1 (input features), bias whole. The
  input is the local slice of the features (a colwise output); the product is a partial sum,
  ``all_reduce(sum)`` over the TP ranks in forward (identity in backward), then the bias is
  added once.
- ``embedding_rowwise`` (``RowwiseParallel`` on an ``nn.Embedding``): weight split on dim 0
  (the vocabulary), ids whole. Each rank looks up the ids its rows hold and zeros the others;
  the partial outputs are ``all_reduce(sum)``-ed. Which ids are this rank's depends on its TP
  index, which one graph for every rank cannot hold as a constant: ``rank_index`` cuts it
  from ``arange(tp)`` with one ``reduce_scatter(max)`` per step.

Sequence parallel (Megatron-SP, as torchtitan plans it) keeps the residual stream split on
dim 1 (the sequence) over the TP ranks between the model's entry and exit, so norms compute on
``1/tp`` of the tokens and the TP layers trade each all_reduce for a reduce_scatter and an
all_gather:

- ``seq_shard_output`` (``PrepareModuleOutput(output_layouts=Replicate(),
  desired_output_layouts=Shard(1))``, the entry, e.g. on the embedding): the module runs whole;
  its output, the same on every TP rank, is cut to this rank's sequence shard. One graph serves
  every rank, so the graph cannot slice by rank index: the cut is a ``reduce_scatter(max)`` of
  the identical copies (exact). Backward: the gradient all_gathered.
- ``sequence_parallel`` (``SequenceParallel``): an ``nn.LayerNorm``/``nn.RMSNorm`` on the
  local sequence shard; its whole parameters' gradients are then partial over TP: one
  ``all_reduce(sum)`` per norm (weight and bias together) in backward.
- ``colwise_seq`` (``ColwiseParallel(input_layouts=Shard(1))``): colwise whose input is the
  sequence shard: all_gathered over the sequence in forward, the gradient reduce_scattered in
  backward; readers of one input tensor (``q``, ``k``, ``v``) share one gather, as a
  ``PrepareModuleInput`` on the attention module would.
- ``rowwise_seq`` (``RowwiseParallel(output_layouts=Shard(1))``): rowwise whose partial output
  is reduce_scattered over the sequence (all_gather of the gradient in backward), the bias added
  to the shard; the bias gradient is summed from the gathered output gradient (no collective).
- ``seq_gather_input`` (``PrepareModuleInput(input_layouts=Shard(1),
  desired_input_layouts=Replicate())``, the exit, e.g. on the output head): the module's first
  input all_gathered over the sequence; backward: the gradient, the same on every TP rank, cut
  to the shard (``reduce_scatter(max)``).

The sequence length (dim 1 of the entry's output) must divide by the TP size. Between entry
and exit a module sees local sequence shards: one that reshapes by the sequence length must
read it from a gathered tensor (``q.shape[1]``, a ``colwise_seq`` output), not from its input.
Sequence styles check that their inputs have the length they expect (a shard or the whole
sequence, as the entry recorded it) and refuse a module reached with the other.

A module that splits heads must use its local head count: compute it from the local tensor
(``n_heads = q.shape[-1] // self.head_dim``, as torchtitan's ``n_local_heads``), not from
``self.q.out_features`` or a global ``n_heads`` attribute. Parameters of unplanned modules
are whole on every TP rank; their gradients agree across TP ranks because colwise inputs and
rowwise outputs are whole.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedError
from .axis_interface import Axis
from .tp_autograd import CopyToTP, GatherSeq, ReduceFromTP, ScatterSeq, SumGradsOverTP
from .tp_plan import SPLIT_DIMS, first_match
from ..passes.collectives import label_collective

__all__ = ["TP_STYLES", "TPStyle", "Colwise", "Rowwise", "ColwiseSeq", "RowwiseSeq", "SequenceParallel",
           "SeqShardOutput", "SeqGatherInput", "ColwiseGatherOutput", "RowwiseSplitInput", "EmbeddingColwise",
           "EmbeddingRowwise", "ReplicatedWithGradAllreduce", "TensorParallel", "planned_modules", "style_for", "AXIS"]

TP_STYLES: dict[str, TPStyle] = {}  # name -> style object, in definition order


class TPStyle:
    """The interface of a style; a style holds no state."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # parameter of the module -> tensor dimension split over TP (None: whole on every TP rank),
    # from the plan text's table (``parallel/tp_plan.py``: the plan value lays parameters out)
    param_dims: ClassVar[dict[str, int | None]]
    # the most collectives of each kind one call of the module adds to the step
    budget: ClassVar[dict[str, int]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.param_dims = SPLIT_DIMS[cls.name]
        TP_STYLES[cls.name] = cls()

    def check(self, fqn: str, module: nn.Module) -> None:
        """Refuse a module this style cannot serve (default: ``nn.Linear`` with its own forward)."""
        if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
            raise UnsupportedError(
                f"tp_plan puts {fqn} ({type(module).__qualname__}) {self.name}; {self.name} splits "
                "nn.Linear modules (with nn.Linear's own forward) only")

    def forward(self, tp: TensorParallel, fqn: str, module: nn.Module, *args, **kwargs):
        raise NotImplementedError


class Colwise(TPStyle):
    name = "colwise"
    summary = "nn.Linear split on output features; input copied to the TP region, output local"
    budget = {"all_reduce": 1}

    def forward(self, tp, fqn, module, x):
        tp.refuse_in_sequence_region(fqn, self.name)
        return F.linear(tp.copied_in(x, fqn), module.weight, module.bias)


class Rowwise(TPStyle):
    name = "rowwise"
    summary = "nn.Linear split on input features; partial output all_reduced over TP, bias added once"
    budget = {"all_reduce": 1}

    def forward(self, tp, fqn, module, x):
        tp.refuse_in_sequence_region(fqn, self.name)
        out = ReduceFromTP.apply(F.linear(x, module.weight), tp, [fqn])
        bias = module.bias
        return out if bias is None else out + bias


class ColwiseSeq(Colwise):
    name = "colwise_seq"
    summary = "colwise with a sequence-sharded input: all_gathered over the sequence (shared by its readers)"
    budget = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}

    def forward(self, tp, fqn, module, x):
        tp.expect_sequence(x, fqn, self.name, sharded=True)
        return F.linear(tp.gathered_in(x, fqn), module.weight, module.bias)


class RowwiseSeq(Rowwise):
    name = "rowwise_seq"
    summary = "rowwise with a sequence-sharded output: partial output reduce_scattered over the sequence"
    budget = {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}

    def forward(self, tp, fqn, module, x):
        tp.expect_sequence(x, fqn, self.name, sharded=False)
        return ScatterSeq.apply(F.linear(x, module.weight), module.bias, tp, fqn, "sum")


class SequenceParallel(TPStyle):
    name = "sequence_parallel"
    summary = "nn.LayerNorm/nn.RMSNorm on the local sequence shard; parameter gradients all_reduced over TP"
    budget = {"all_reduce": 1}

    def check(self, fqn, module):
        if not isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or \
                type(module).forward not in (nn.LayerNorm.forward, nn.RMSNorm.forward):
            raise UnsupportedError(
                f"tp_plan puts {fqn} ({type(module).__qualname__}) {self.name}; {self.name} runs "
                "nn.LayerNorm and nn.RMSNorm (with their own forward) on sequence shards only")

    def forward(self, tp, fqn, module, x):
        tp.expect_sequence(x, fqn, self.name, sharded=True)
        names = [n for n in ("weight", "bias") if getattr(module, n, None) is not None]
        params = dict(zip(names, SumGradsOverTP.apply(tp, fqn, names, *(getattr(module, n) for n in names))))
        if isinstance(module, nn.LayerNorm):
            return F.layer_norm(x, module.normalized_shape, params.get("weight"), params.get("bias"), module.eps)
        return F.rms_norm(x, module.normalized_shape, params.get("weight"), module.eps)


class SeqShardOutput(TPStyle):
    name = "seq_shard_output"
    summary = "the model's entry: the module's (whole) output cut to this rank's sequence shard"
    budget = {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}

    def check(self, fqn, module):
        pass

    def forward(self, tp, fqn, module, *args, **kwargs):
        out = type(module).forward(module, *args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[1] % tp.size:
            what = f"shape {list(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
            raise UnsupportedError(
                f"tp_plan puts {fqn} {self.name}, but it returns {what}; the entry of sequence parallel "
                f"returns one tensor whose dim 1 (the sequence) divides by the TP size {tp.size}")
        tp.seq, tp.in_sequence_region = out.shape[1], True
        return ScatterSeq.apply(out, None, tp, fqn, "max")


class SeqGatherInput(TPStyle):
    name = "seq_gather_input"
    summary = "the model's exit: the module's first input all_gathered over the sequence; the module runs whole"
    budget = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}

    def check(self, fqn, module):
        pass

    def forward(self, tp, fqn, module, x, *args, **kwargs):
        tp.expect_sequence(x, fqn, self.name, sharded=True)
        tp.in_sequence_region = False
        return type(module).forward(module, GatherSeq.apply(x, tp, [fqn], "max"), *args, **kwargs)



class ColwiseGatherOutput(Colwise):
    name = "colwise_gather_output"
    summary = "colwise whose output features are all_gathered over TP (whole on every TP rank; HF colwise_rep)"
    budget = {"all_reduce": 1, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}

    def forward(self, tp, fqn, module, x):
        tp.refuse_in_sequence_region(fqn, self.name)
        local = F.linear(tp.copied_in(x, fqn), module.weight, module.bias)
        # backward: the output gradient is the same on every TP rank; each keeps its features
        return GatherSeq.apply(local, tp, [fqn], "max", -1, "output")


class RowwiseSplitInput(Rowwise):
    name = "rowwise_split_input"
    summary = "rowwise whose input is whole: cut to this rank's features first (HF rowwise_rep)"
    budget = {"reduce_scatter_tensor": 1, "all_gather_into_tensor": 1, "all_reduce": 1}

    def forward(self, tp, fqn, module, x):
        tp.refuse_in_sequence_region(fqn, self.name)
        # the whole input is the same on every TP rank: reduce_scatter(max) cuts it exactly;
        # backward: the features' gradients all_gathered
        local = ScatterSeq.apply(x, None, tp, fqn, "max", -1, "input")
        out = ReduceFromTP.apply(F.linear(local, module.weight), tp, [fqn])
        return out if module.bias is None else out + module.bias


class EmbeddingColwise(TPStyle):
    name = "embedding_colwise"
    summary = "nn.Embedding split on the embedding dim; the looked-up features all_gathered over TP"
    budget = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}

    def check(self, fqn, module):
        if not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward:
            raise UnsupportedError(
                f"tp_plan puts {fqn} ({type(module).__qualname__}) {self.name}; {self.name} splits "
                "nn.Embedding modules (with nn.Embedding's own forward) only")

    def forward(self, tp, fqn, module, ids):
        tp.refuse_in_sequence_region(fqn, self.name)
        local = F.embedding(ids, module.weight, module.padding_idx, module.max_norm, module.norm_type,
                            module.scale_grad_by_freq, module.sparse)
        return GatherSeq.apply(local, tp, [fqn], "max", -1, "output")


class EmbeddingRowwise(TPStyle):
    name = "embedding_rowwise"
    summary = ("nn.Embedding split on the vocabulary (RowwiseParallel on an embedding): each rank looks "
               "up the ids in its rows, zeros elsewhere, the partial outputs all_reduced over TP")
    # the output all_reduce, and the cut that gives this rank its share's first id (once per step)
    budget = {"all_reduce": 1, "reduce_scatter_tensor": 1}

    def check(self, fqn, module):
        EmbeddingColwise.check(self, fqn, module)
        for attr, why in (("max_norm", "renormalizes the looked-up rows in place"),
                          ("scale_grad_by_freq", "scales gradients by counts over the whole vocabulary"),
                          ("sparse", "makes sparse gradients")):
            if getattr(module, attr):
                raise UnsupportedError(
                    f"tp_plan puts {fqn} (nn.Embedding with {attr}={getattr(module, attr)!r}) {self.name}, "
                    f"but {attr} {why}, which a vocabulary shard cannot do alone; plan it 'embedding_colwise' "
                    "(split on the embedding dim) or leave it out of the plan")

    def forward(self, tp, fqn, module, ids):
        tp.refuse_in_sequence_region(fqn, self.name)
        weight = module.weight
        rows = weight.shape[0]  # this rank's share of the vocabulary: ids [start, start + rows)
        local = ids - tp.rank_index(fqn) * rows
        outside = (local < 0) | (local >= rows)
        looked = F.embedding(local.masked_fill(outside, 0), weight)
        if module.padding_idx is not None:  # its row is looked up but gets no gradient
            looked = torch.where((ids == module.padding_idx).unsqueeze(-1), looked.detach(), looked)
        # zero where another rank holds the id: the sum over TP is the whole lookup, and the
        # gradient reaches only the rows this rank holds
        return ReduceFromTP.apply(looked.masked_fill(outside.unsqueeze(-1), 0), tp, [fqn])


class ReplicatedWithGradAllreduce(TPStyle):
    name = "replicated_with_grad_allreduce"
    summary = ("the module runs whole on TP-local activations (e.g. per-head norms between colwise and "
               "rowwise); its parameters' gradients, partial over TP, all_reduced")
    budget = {"all_reduce": 1}

    def check(self, fqn, module):
        if next(module.parameters(recurse=False), None) is None:
            raise UnsupportedError(f"tp_plan puts {fqn} ({type(module).__qualname__}) {self.name}, but "
                                   "it has no parameters of its own: leave it out of the plan")

    def forward(self, tp, fqn, module, *args, **kwargs):
        names = [n for n, _ in module.named_parameters(recurse=False)]
        summed = SumGradsOverTP.apply(tp, fqn, names, *(getattr(module, n) for n in names))
        shadow = vars(module)  # instance attributes win over nn.Module.__getattr__'s parameters
        shadow.update(zip(names, summed))
        try:
            return type(module).forward(module, *args, **kwargs)
        finally:
            for n in names:
                shadow.pop(n, None)


def style_for(tp_plan, fqn: str) -> TPStyle | None:
    """The style of module ``fqn`` under ``tp_plan`` ((pattern, style name) pairs), or None."""
    match = first_match(tp_plan, fqn)
    return TP_STYLES[match[1]] if match else None


def planned_modules(model: nn.Module, tp_plan) -> list[tuple[str, nn.Module, TPStyle]]:
    """(FQN, module, style) of every module the plan names; refuses patterns that match no
    module and modules a style cannot split."""
    found, used = [], set()
    for fqn, module in model.named_modules():
        match = first_match(tp_plan, fqn)
        if match:
            used.add(match[0])
            found.append((fqn, module, TP_STYLES[match[1]]))
    unused = [pattern for pattern, _ in tp_plan if pattern not in used]
    if unused:
        own = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        theirs = all(p in own or (prefix and p.startswith(prefix + ".") and p[len(prefix) + 1:] in own)
                     for p in unused)
        fix = ("; they are the model's own plan's (config.base_model_tp_plan), written for its architecture: "
               "pass tp_plan='hf', which skips the patterns the model lacks as transformers does, or drop "
               "them") if own and theirs else ""
        raise UnsupportedError(
            f"tp_plan pattern(s) {unused} match no module of {type(model).__qualname__}; patterns "
            f"match module FQNs (fnmatch), e.g. 'blocks.*.attn.q' (see model.named_modules()){fix}")
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for fqn, module, style in found:
        if "forward" in vars(module):
            raise UnsupportedError(
                f"tp_plan puts {fqn} {style.name}, but its forward is replaced on the instance; "
                "plan modules that run their class's forward")
        style.check(fqn, module)
        for attr, dim in style.param_dims.items():
            param = getattr(module, attr, None)
            if dim is not None and param is not None and len(names.get(id(param), [])) > 1:
                raise UnsupportedError(
                    f"tp_plan splits {fqn}.{attr} {style.name}, but it is tied to "
                    f"{', '.join(n for n in names[id(param)] if n != f'{fqn}.{attr}')}; a tied parameter "
                    "cannot be split for one of its modules only: leave it out of the tp_plan")
    return found


class TensorParallel:
    """While active (tracing), every planned module runs its style's forward on local tensors.

    ``budget()`` is the most collectives of each kind the planned modules' calls may add."""

    def __init__(self, model: nn.Module, tp_plan, mesh, mesh_dim: int):
        self.modules = planned_modules(model, tp_plan)
        self.group = mesh.get_group(mesh_dim).group_name
        self.size = mesh.size(mesh_dim)
        self.calls: dict[str, int] = {}
        self.seq: int | None = None  # the whole sequence length, as the latest entry call saw it
        self.in_sequence_region = False  # between an entry call and the exit: activations are shards
        planned = {id(module) for _, module, _ in self.modules}
        # unplanned modules with parameters of their own: run on sequence shards, their
        # gradients would be partial over TP, so sequence parallel refuses them
        self._unplanned = {id(m): (fqn, type(m).__qualname__) for fqn, m in model.named_modules()
                           if id(m) not in planned and next(m.parameters(recurse=False), None) is not None}
        self._copies: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, list[str]]] = {}
        self._rank_index: torch.Tensor | None = None  # ``rank_index``, made by its first reader

    def budget(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fqn, _, style in self.modules:
            for kind, n in style.budget.items():
                out[kind] = out.get(kind, 0) + n * self.calls.get(fqn, 0)
        return out

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_pre_hook

        for fqn, module, style in self.modules:
            module.forward = _PlannedForward(self, fqn, module, style)
        self._hook = register_module_forward_pre_hook(self._refuse_unplanned_on_shards)
        return self

    def __exit__(self, *exc):
        self._hook.remove()
        for _, module, _ in self.modules:
            vars(module).pop("forward", None)
        self._copies.clear()
        self._rank_index = None

    def refuse_in_sequence_region(self, fqn: str, style: str) -> None:
        """Plain colwise/rowwise would mix different ranks' tokens on sequence shards."""
        if self.in_sequence_region:
            raise UnsupportedError(
                f"{fqn} is planned {style} but runs between the sequence-parallel entry and exit, where "
                f"activations are sequence shards; plan it {style}_seq")

    def _refuse_unplanned_on_shards(self, module, args):
        if self.in_sequence_region and id(module) in self._unplanned:
            fqn, kind = self._unplanned[id(module)]
            raise UnsupportedError(
                f"{fqn} ({kind}) has parameters and runs between the sequence-parallel entry and exit, "
                "where activations are sequence shards, but the tp_plan gives it no style: its "
                "gradients would be partial over TP. Plan it (norms 'sequence_parallel', linears "
                "'colwise_seq'/'rowwise_seq') or put the exit ('seq_gather_input') before it")

    def rank_index(self, fqn: str) -> torch.Tensor:
        """This rank's index along the TP dimension, as a one-element int64 tensor. One graph
        serves every rank, so the index cannot be a constant: it is cut from ``arange(tp)``,
        the same on every rank, by a ``reduce_scatter(max)`` (exact), once per traced step."""
        if self._rank_index is None:
            ranks = torch.arange(self.size, dtype=torch.float32)
            self._rank_index = self.scatter_sequence(ranks, [fqn], "rank index", "max", 0).to(torch.int64)
        return self._rank_index

    def copied_in(self, x: torch.Tensor, fqn: str) -> torch.Tensor:
        """``x`` copied to the TP region; one copy per input tensor, shared by its readers."""
        return self._shared(x, fqn, "copy", lambda readers: CopyToTP.apply(x, self, readers))

    def gathered_in(self, x: torch.Tensor, fqn: str) -> torch.Tensor:
        """Sequence shard ``x`` all_gathered into the TP region (its gradient is partial over TP:
        reduce_scattered); one gather per input tensor, shared by its readers."""
        return self._shared(x, fqn, "gather", lambda readers: GatherSeq.apply(x, self, readers, "sum"))

    def _shared(self, x, fqn, kind, make):
        entry = self._copies.get((id(x), kind))
        if entry is None or entry[0] is not x:
            readers = [fqn]  # the modules sharing the copy, named by its collectives
            entry = self._copies[id(x), kind] = (x, make(readers), readers)  # holds x: ids stay unique
        else:
            entry[2].append(fqn)
        return entry[1]

    def expect_sequence(self, x: torch.Tensor, fqn: str, style: str, sharded: bool) -> None:
        """Refuse an input of a sequence style that is not what the style expects: this rank's
        sequence shard (``sharded``) or the whole sequence, as the entry last saw it."""
        if self.seq is None:
            raise UnsupportedError(
                f"{fqn} is planned {style}, but no module planned "
                "seq_shard_output ran before it; sequence parallel starts at the module whose output "
                "is sharded over the sequence (e.g. the embedding: 'tok=seq_shard_output')")
        want = self.seq // self.size if sharded else self.seq
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != want:
            got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UnsupportedError(
                f"{fqn} is planned {style} and expects "
                f"{'its sequence shard' if sharded else 'the whole sequence'} (dim 1 = {want} of {self.seq} "
                f"tokens over {self.size} TP ranks), got shape {got}; check that the modules before it "
                "are planned for sequence parallel (norms 'sequence_parallel', the projections after "
                "them 'colwise_seq', the ones before the residual 'rowwise_seq')")

    def all_reduce(self, t: torch.Tensor, modules: list[str], what: str, params: list[str] | None = None) -> torch.Tensor:
        """``all_reduce(sum)`` over the TP dimension, labelled with the modules it serves."""
        c10d = torch.ops._c10d_functional
        reduced = c10d.all_reduce(t.contiguous(), "sum", self.group)
        self._label(reduced, modules, what, params)
        return c10d.wait_tensor(reduced)

    def gather_sequence(self, t: torch.Tensor, modules: list[str], what: str, dim: int = 1) -> torch.Tensor:
        """The shards of the TP ranks (dim ``dim`` of ``t``: the sequence unless told) all_gathered,
        in rank order."""
        c10d = torch.ops._c10d_functional
        gathered = c10d.all_gather_into_tensor(t.movedim(dim, 0).contiguous(), self.size, self.group)
        self._label(gathered, modules, what)
        return c10d.wait_tensor(gathered).movedim(0, dim)

    def scatter_sequence(self, t: torch.Tensor, modules: list[str], what: str, op: str,
                         dim: int = 1) -> torch.Tensor:
        """``t`` reduced (``op``) over the TP ranks, each keeping its shard of dim ``dim`` (the
        sequence unless told)."""
        c10d = torch.ops._c10d_functional
        scattered = c10d.reduce_scatter_tensor(t.movedim(dim, 0).contiguous(), op, self.size, self.group)
        self._label(scattered, modules, what)
        return c10d.wait_tensor(scattered).movedim(0, dim)

    @staticmethod
    def _label(t, modules, what, params=None):
        params = [f"{m}.weight" for m in modules] if params is None else params
        label_collective(t, {"label": f"tp {modules[0]} {what}", "params": params})


class _PlannedForward:
    """A planned module's forward while tracing (an instance attribute, removed after)."""

    def __init__(self, tp, fqn, module, style):
        self.tp, self.fqn, self.module, self.style = tp, fqn, module, style

    def __call__(self, *args, **kwargs):
        self.tp.calls[self.fqn] = self.tp.calls.get(self.fqn, 0) + 1
        return self.style.forward(self.tp, self.fqn, self.module, *args, **kwargs)


class TensorParallelAxis(Axis):
    """The ``tp`` mesh dimension: planned modules run their style's forward while the step is
    traced; their calls bound the collectives they add (``TensorParallel.budget``)."""

    name = "tensor_parallel"
    roles = ("tp",)

    def tracing(self, plan, model, mesh):
        return TensorParallel(model, plan.tp_plan, mesh, plan.mesh_dim("tp"))


AXIS = TensorParallelAxis()
