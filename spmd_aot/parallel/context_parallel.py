"""Context parallelism: the batch's sequence split over a ``cp`` mesh dimension, attention
exact across the split (torch's ``context_parallel``, torchtitan's ``cp`` degree).

What a rank computes:

- **The batch.** The ranks of one ``cp`` group pass the same batch (as torch's
  ``context_parallel`` takes whole buffers and shards them in place); inside the step every
  batch tensor is cut on dim 1, the sequence, to this rank's tokens. For causal attention the
  cut is load-balanced as torch's ``_HeadTailLoadBalancer`` cuts it: the sequence is split into
  ``2 * cp`` chunks and rank ``i`` keeps chunks ``i`` and ``2 * cp - 1 - i``, so every rank has
  the same attention work. One graph serves every rank, so the cut cannot be a constant: the
  rank's index along ``cp`` is cut from ``arange(cp)`` by one ``reduce_scatter(max)`` per step
  (exact), and the tokens are taken with ``index_select``. Everything a model reads from the
  batch follows the split, position ids included: positions given in the batch are the global
  ones (RoPE stays right); a model that builds its positions from ``arange`` of its input's
  length would see local ones (see "Limits"). Buffers whose dim 0 is the sequence (a RoPE table
  the model slices by its input's length, as torchtitan's ``freqs_cis``) are cut the same way
  when ``context_parallel_buffers`` names them, as torch's ``context_parallel(buffers=...)``
  shards them.
- **Attention.** Every ``scaled_dot_product_attention`` call of the step runs on the rank's
  queries against the keys and values of the whole sequence, all_gathered over ``cp`` (one
  ``all_gather_into_tensor`` of both per call, inside the traced step; their gradients go back
  with one ``reduce_scatter``, summed). Full attention is one SDPA call over them, no mask.
  Causal attention is computed block by block with no mask (``CausalBlocks``): each local
  chunk attends causally to its own block (square: ``is_causal=True`` is exact) and fully to
  the earlier blocks, by CPU flash attention per block, merged by the log-sum-exp rule; only
  the rank's own tensors are kept for backward, which gathers the keys and values again. (On
  another device the causal call keeps the additive mask of the global positions.) The result
  is the unsplit attention for the local queries, forward and backward. A model's own mask is
  accepted when it is computed from no input and is the causal (or the all-allowed) mask over
  the local length, as transformers builds it while tracing: it is evaluated once at build time
  and dropped; any other mask (padding from the batch, sliding windows, additive biases) is
  refused.
- **Gradients.** The ``cp`` ranks hold the same parameters and see different tokens: their
  gradients are averaged over ``cp`` as over a data-parallel dimension (``layout.py``:
  ``dp_mesh_dims``; under ``shard`` after the shard group's reduce_scatter, as HSDP averages
  over its replicas). With a loss that is a mean over the tokens (every rank has the same
  number), the average of the ranks' gradients is the gradient of the mean over the whole
  sequence: the unsplit step's. The step returns this rank's loss (the mean over its tokens),
  as under torch's ``context_parallel``; the mean over the ``cp`` ranks is the unsplit loss.

Limits, refused at build with the construct named: a batch tensor without a sequence dimension
(dim 1) of the common length, or a length that does not divide into ``2 * cp`` chunks; causal
attention with dropout (the CPU flash kernel has none); attention whose query or key length is
not this rank's share (cross-attention, a KV cache); a model mask that depends on the batch or is
neither causal nor all-allowed; a step with no ``scaled_dot_product_attention`` call. Not
detected: attention written with plain ops (``softmax(q @ k.T)``) beside SDPA calls (it would
see local keys only); positions built from
``arange`` of the local length; labels shifted inside the model (transformers' ``labels=``
shifts within the local tokens): pass targets shifted before the step.
"""

from __future__ import annotations

import contextlib
import fnmatch

import torch
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedError
from ..passes.collectives import label_collective
from .axis_interface import Axis
from .cp_attention import CausalBlocks, GatherKV

__all__ = ["ContextParallel", "ContextParallelAxis", "load_balanced_positions", "AXIS"]

_SDPA = torch._C._nn.scaled_dot_product_attention
# the most elements of a model mask evaluated at build time (a 4k x 4k local mask)
_MAX_MASK_ELEMENTS = 1 << 24


def load_balanced_positions(seq: int, cp: int, rank, device=None) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` holds of a ``seq``-token sequence: chunks
    ``rank`` and ``2 * cp - 1 - rank`` of ``2 * cp``. ``rank`` may be an int or a one-element
    int64 tensor (then the positions are computed in the traced step)."""
    chunk = seq // (2 * cp)
    base = torch.arange(chunk, device=device)
    return torch.cat([base + rank * chunk, base + (2 * cp - 1 - rank) * chunk])


class ContextParallel(TorchFunctionMode):
    """While active (tracing), every ``scaled_dot_product_attention`` call attends over the
    whole sequence (``attention``); ``batch`` cuts the batch to this rank's tokens first.
    ``budget()`` is the most collectives the calls added."""

    def __init__(self, plan, mesh):
        super().__init__()
        self.buffer_patterns = plan.context_parallel_buffers
        dim = plan.mesh_dim("cp")
        self.group = mesh.get_group(dim).group_name
        self.size = mesh.size(dim)
        self.seq: int | None = None  # the whole sequence length, as the batch has it
        self.positions: torch.Tensor | None = None  # global positions of this rank's tokens
        self.rank: torch.Tensor | None = None  # this rank's index along cp (one-element int64, traced)
        self.calls = 0  # attention calls traced
        self.blockwise = 0  # of which causal, computed block by block (keys and values gathered again in backward)
        self.cuts = 0  # rank-index cuts traced (one per batch)
        self._masks: dict[int, tuple[torch.Tensor, str]] = {}  # a model mask's kind, per tensor
        self._causal: dict[torch.dtype, torch.Tensor] = {}  # the causal mask, per dtype

    # -- the batch ----------------------------------------------------------------------------
    def batch(self, leaves: list) -> list:
        """Every tensor of the batch (flattened) cut on dim 1 to this rank's load-balanced tokens."""
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not tensors:
            return leaves
        shapes = [list(t.shape) for t in tensors]
        lengths = {t.shape[1] for t in tensors if t.dim() >= 2}
        if any(t.dim() < 2 for t in tensors) or len(lengths) != 1:
            raise UnsupportedError(
                f"context_parallel splits dim 1 (the sequence) of every batch tensor, but the batch's "
                f"tensors have shapes {shapes}; pass tensors of shape [batch, sequence, ...] of one "
                "sequence length (token ids, targets shifted before the step, position ids)")
        seq = lengths.pop()
        if seq % (2 * self.size):
            raise UnsupportedError(
                f"context_parallel over {self.size} ranks splits the sequence into {2 * self.size} "
                f"chunks (two per rank, load-balanced for causal attention), but the batch's sequence "
                f"length is {seq}; pad or cut it to a multiple of {2 * self.size}")
        self.seq = seq
        device = tensors[0].device
        self.rank = self._rank_index(device)
        self.positions = load_balanced_positions(seq, self.size, self.rank, device)
        return [t.index_select(1, self.positions) if isinstance(t, torch.Tensor) else t for t in leaves]

    def buffers(self, names: list[list[str]], buffers: list) -> list:
        """The buffers ``context_parallel_buffers`` names (FQN patterns; dim 0 the sequence, as
        torch's ``context_parallel(buffers=..., buffer_seq_dims=...)`` takes them) cut to this
        rank's positions, so a model slicing one by its input's length (``freqs_cis[:t]``) reads
        the rows of its tokens; the others as they are."""
        if not self.buffer_patterns:
            return buffers
        used, out = set(), []
        for fqns, buf in zip(names, buffers):
            match = next((p for p in self.buffer_patterns for f in fqns if fnmatch.fnmatchcase(f, p)), None)
            if match is None or self.positions is None:
                out.append(buf)
                continue
            used.add(match)
            if buf.dim() < 1 or buf.shape[0] != self.seq:
                raise UnsupportedError(
                    f"context_parallel_buffers names buffer {fqns[0]} of shape {list(buf.shape)}, but its dim 0 "
                    f"must be the batch's sequence length {self.seq} (it is cut to each rank's positions as "
                    "the batch is); make the table exactly the training sequence length")
            out.append(buf.index_select(0, self.positions))
        unused = [p for p in self.buffer_patterns if p not in used]
        if unused and self.positions is not None:
            raise UnsupportedError(
                f"context_parallel_buffers pattern(s) {unused} match no buffer of the model; patterns match "
                "buffer FQNs (fnmatch), e.g. 'freqs_cis' or 'layers.*.rope.table' (see model.named_buffers())")
        return out

    def _rank_index(self, device) -> torch.Tensor:
        """This rank's index along ``cp`` (one-element int64): one graph serves every rank, so it
        is cut from ``arange(cp)``, the same on every rank, by a ``reduce_scatter(max)`` (exact)."""
        c10d = torch.ops._c10d_functional
        ranks = torch.arange(self.size, dtype=torch.float32, device=device)
        cut = c10d.reduce_scatter_tensor(ranks, "max", self.size, self.group)
        label_collective(cut, {"label": "cp batch rank index", "params": []})
        self.cuts += 1
        return c10d.wait_tensor(cut).to(torch.int64)

    # -- attention ----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        """``scaled_dot_product_attention`` of this rank's queries over the whole sequence."""
        if self.positions is None:
            raise UnsupportedError(
                "scaled_dot_product_attention ran under context_parallel before the batch was split "
                "(a call outside the step's use of its batch); attention under context_parallel "
                "attends over the batch's sequence")
        local = self.positions.shape[0]
        if query.shape[-2] != local or key.shape[-2] != local:
            raise UnsupportedError(
                f"scaled_dot_product_attention under context_parallel got queries of length "
                f"{query.shape[-2]} and keys of length {key.shape[-2]}; both must be this rank's "
                f"{local} tokens of the {self.seq}-token sequence (self-attention over the batch's "
                "sequence: cross-attention and KV caches are not split)")
        causal = bool(is_causal)
        if attn_mask is not None:
            causal = self._mask_kind(attn_mask, local) == "causal"
        self.calls += 1
        if causal and query.device.type == "cpu":
            if dropout_p:
                raise UnsupportedError(
                    f"scaled_dot_product_attention under context_parallel got dropout_p={dropout_p}; causal "
                    "attention under context_parallel is computed block by block with CPU flash attention, "
                    "which has no dropout: pass dropout_p=0.0 (transformers: attention_dropout=0.0)")
            if query.shape[-3] != key.shape[-3] and not enable_gqa:
                raise UnsupportedError(
                    f"scaled_dot_product_attention under context_parallel got {query.shape[-3]} query heads and "
                    f"{key.shape[-3]} key heads without enable_gqa=True; pass enable_gqa=True or repeat the "
                    "key and value heads")
            self.blockwise += 1
            return CausalBlocks.apply(query, key, value, self.rank, self, scale)
        whole_key, whole_value = GatherKV.apply(key, value, self)
        # full attention needs no mask; causal attention on another device keeps the explicit
        # mask (the blockwise kernels above are CPU's)
        mask = self._causal_mask(query.dtype) if causal else None
        return _SDPA(query, whole_key, whole_value, attn_mask=mask, dropout_p=dropout_p, is_causal=False,
                     scale=scale, enable_gqa=enable_gqa)

    def _causal_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive causal mask [local queries, whole sequence] from the global positions,
        made once per trace and dtype and shared by every attention call (one tensor kept for
        backward, not one per layer)."""
        mask = self._causal.get(dtype)
        if mask is None:
            keys = load_balanced_keys(self.seq, self.size, self.positions.device)
            allowed = self.positions.unsqueeze(-1) >= keys.unsqueeze(0)
            # one [queries, keys] tensor at once (zeros then masked_fill would hold two)
            zero = torch.zeros((), dtype=dtype, device=allowed.device)
            mask = self._causal[dtype] = torch.where(allowed, zero, torch.full((), float("-inf"), dtype=dtype,
                                                                               device=allowed.device))
        return mask

    def _mask_kind(self, mask: torch.Tensor, local: int) -> str:
        """``"causal"`` or ``"full"`` for a model mask over the local tokens (evaluated once at
        build time from the ops that made it); refuses any other."""
        seen = self._masks.get(id(mask))
        if seen is not None and seen[0] is mask:
            return seen[1]
        what = f"a mask of shape {list(mask.shape)} and dtype {mask.dtype}"
        if mask.dim() < 2 or tuple(mask.shape[-2:]) != (local, local) or mask.numel() > _MAX_MASK_ELEMENTS:
            raise UnsupportedError(
                f"scaled_dot_product_attention under context_parallel got {what}; a mask must be the "
                f"causal (or all-allowed) one over this rank's {local} tokens; drop it and pass "
                "is_causal=True (or nothing, for full attention)")
        value = _constant_value(mask)
        if value is None:
            raise UnsupportedError(
                f"scaled_dot_product_attention under context_parallel got {what} computed from the "
                "step's inputs (a padding mask from the batch?); context_parallel carries only the "
                "causal or the all-allowed mask: pass no attention_mask (sequences without padding) "
                "and is_causal=True")
        with _real():
            allowed = value if value.dtype == torch.bool else value == 0
            # an additive mask blocks with -inf or the dtype's lowest value (transformers' choice)
            if value.dtype != torch.bool and not bool((allowed | (value <= torch.finfo(value.dtype).min / 2)).all()):
                raise UnsupportedError(
                    f"scaled_dot_product_attention under context_parallel got {what} with values other "
                    "than 0 and -inf (an additive bias); context_parallel carries only the causal or the "
                    "all-allowed mask")
            allowed = allowed.expand(mask.shape).reshape(-1, local, local)
            causal = torch.ones(local, local, dtype=torch.bool, device=allowed.device).tril()
            kind = "causal" if bool((allowed == causal).all()) else "full" if bool(allowed.all()) else None
        if kind is None:
            raise UnsupportedError(
                f"scaled_dot_product_attention under context_parallel got {what} that is neither the "
                "causal nor the all-allowed mask (a sliding window, a document mask?); context_parallel "
                "carries only those two")
        self._masks[id(mask)] = (mask, kind)
        return kind

    # -- the collectives ------------------------------------------------------------------------
    def gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t``'s dim 0 all_gathered over ``cp``, in rank order."""
        c10d = torch.ops._c10d_functional
        gathered = c10d.all_gather_into_tensor(t.contiguous(), self.size, self.group)
        label_collective(gathered, {"label": f"cp attention {what}", "params": []})
        return c10d.wait_tensor(gathered)

    def scatter(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` summed over ``cp``, each rank keeping its share of dim 0."""
        c10d = torch.ops._c10d_functional
        scattered = c10d.reduce_scatter_tensor(t.contiguous(), "sum", self.size, self.group)
        label_collective(scattered, {"label": f"cp attention {what}", "params": []})
        return c10d.wait_tensor(scattered)

    def budget(self) -> dict[str, int]:
        """One all_gather (keys and values) per attention call and one more in backward per
        blockwise causal call, one reduce_scatter of their gradients per call, one reduce_scatter
        per batch cut (the rank index)."""
        return {"all_gather_into_tensor": self.calls + self.blockwise,
                "reduce_scatter_tensor": self.calls + self.cuts}


def load_balanced_keys(seq: int, cp: int, device=None) -> torch.Tensor:
    """The global positions of the gathered keys: every rank's load-balanced chunks, in rank
    order (the same on every rank: made of constants)."""
    return torch.cat([load_balanced_positions(seq, cp, r, device) for r in range(cp)])



def _constant_value(t: torch.Tensor) -> torch.Tensor | None:
    """The value of traced tensor ``t`` when the ops that made it read no step input
    (evaluated on real tensors), else None. Bounded: only ``t``'s ancestors run, each once."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    slot = get_proxy_slot(t, mode.tracer, None) if mode is not None else None
    node = getattr(getattr(slot, "proxy", None), "node", None)
    if node is None:
        return None
    order, seen, stack = [], set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return None
        if n.op not in ("call_function", "get_attr"):
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    values: dict = {}
    with _real():
        for n in sorted(order, key=position.__getitem__):
            if n.op == "get_attr":
                value = getattr(mode.tracer.root, n.target, None)
                if not isinstance(value, torch.Tensor):
                    return None
                values[n] = value.clone()  # an in-place op below must not change the traced constant
                continue
            if getattr(n.target, "namespace", None) == "_c10d_functional":
                return None
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), values.__getitem__)
            if "device" in kwargs:  # built for another device type: the values are the same on the CPU
                kwargs = {**kwargs, "device": torch.device("cpu")}
            try:
                values[n] = n.target(*args, **kwargs)
            except Exception:
                return None
    out = values[node]
    return out if isinstance(out, torch.Tensor) else None


@contextlib.contextmanager
def _real():
    """Real tensors, untraced, while tracing: what a build-time evaluation of a constant runs in."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing(), unset_fake_temporarily(), torch.no_grad():
        yield


class ContextParallelAxis(Axis):
    """The ``cp`` mesh dimension: the batch cut to this rank's tokens and attention over the
    whole sequence while the step is traced; the calls bound the collectives they add."""

    name = "context_parallel"
    roles = ("cp",)

    def tracing(self, plan, model, mesh):
        return _Tracing(ContextParallel(plan, mesh))


class _Tracing:
    """The axis' context: ``ContextParallel``'s mode entered around the step; refuses a step
    that called no attention (its model mixes tokens some other way, which the split breaks)."""

    def __init__(self, cp: ContextParallel):
        self.cp = cp

    def batch(self, leaves: list) -> list:
        return self.cp.batch(leaves)

    def buffers(self, names: list[list[str]], buffers: list) -> list:
        return self.cp.buffers(names, buffers)

    def budget(self) -> dict[str, int]:
        return self.cp.budget()

    def __enter__(self):
        self.cp.__enter__()
        return self

    def __exit__(self, exc_type, *rest):
        self.cp.__exit__(exc_type, *rest)
        if exc_type is None and self.cp.positions is not None and not self.cp.calls:
            raise UnsupportedError(
                "context_parallel split the sequence, but the step called no "
                "scaled_dot_product_attention; attention under context_parallel must go through "
                "torch.nn.functional.scaled_dot_product_attention (transformers' 'sdpa'), which it "
                "computes over the whole sequence; attention written with plain ops would see "
                "this rank's tokens only")
        return False


AXIS = ContextParallelAxis()
