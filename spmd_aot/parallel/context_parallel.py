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
  Causal attention is computed block by block with no mask (``_CausalBlocks``): each local
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
            return _CausalBlocks.apply(query, key, value, self.rank, self, scale)
        whole_key, whole_value = _GatherKV.apply(key, value, self)
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


class _GatherKV(torch.autograd.Function):
    """Keys and values of the local tokens (dim -2) all_gathered over ``cp`` in one collective;
    in backward their gradients (each rank's queries' share) summed and cut back to the local
    tokens with one reduce_scatter."""

    @staticmethod
    def forward(ctx, key, value, cp):
        ctx.cp, ctx.shapes = cp, (key.shape, value.shape)
        return _gather_kv(cp, key, value, "keys and values")

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        key_shape, value_shape = ctx.shapes
        return (*_scatter_kv(ctx.cp, grad_key, grad_value, key_shape, value_shape, "keys and values gradient"),
                None)


def _gather_kv(cp, key, value, what):
    """The local keys and values (tokens on dim -2) all_gathered over ``cp`` in one collective."""
    flat = torch.cat([_tokens_first(key), _tokens_first(value)], dim=1)
    whole = cp.gather(flat, what)
    return _split_tokens(whole, key.shape, value.shape, cp.size)


def _scatter_kv(cp, grad_key, grad_value, key_shape, value_shape, what):
    """The whole sequence's key and value gradients summed over ``cp`` and cut to the local
    tokens in one reduce_scatter."""
    flat = torch.cat([_tokens_first(grad_key), _tokens_first(grad_value)], dim=1)
    mine = cp.scatter(flat, what)
    return _split_tokens(mine, key_shape, value_shape, 1)


class _CausalBlocks(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence without a mask.

    The rank holds chunks ``A`` (global block ``i``, its index along ``cp``) and ``B`` (block
    ``2 * cp - 1 - i``) of the ``2 * cp`` blocks of length ``c``; the gathered keys hold every
    rank's ``A`` and ``B`` chunks in rank order. Under the causal rule a query block attends
    fully to every earlier block and causally to its own, so:

    - ``A`` attends causally to its own keys (a square block: ``is_causal=True`` is exact) and
      fully to the ``A`` chunks of ranks ``r < i``; never to a ``B`` chunk (all later);
    - ``B`` attends causally to its own keys, fully to every ``A`` chunk (all earlier: one
      call over ``cp * c`` keys) and fully to the ``B`` chunks of ranks ``r > i``.

    One graph serves every rank, so ``i`` is a traced value: the rank-dependent blocks are
    computed for every ``r`` in one batched call and dropped by setting their log-sum-exp to
    ``-inf`` where they do not apply. Each block is one CPU flash-attention call (no mask, so
    nothing of size ``S/cp x S`` exists); the blocks' outputs are merged by the log-sum-exp
    rule. Backward runs the flash backward per block with the *merged* output and log-sum-exp
    (each block's gradient is then exact, as ring attention does), dropping the blocks that did
    not apply, and sums the key and value gradients per gathered position."""

    @staticmethod
    def forward(ctx, query, key, value, rank, mode, scale):
        ctx.mode, ctx.scale = mode, scale
        cp = mode.size
        whole_key, whole_value = _gather_kv(mode, key, value, "keys and values")
        halves = []
        for terms in _causal_terms(query, key, value, whole_key, whole_value, rank, cp):
            outs = [_flash(q, k, v, causal, n, keep, scale) for q, k, v, causal, n, keep, _ in terms]
            halves.append(_merge(outs, query.dtype))
        out = torch.cat([o for o, _ in halves], dim=-2)
        # only this rank's tensors are kept for backward (the whole sequence's keys and values
        # are gathered again there), so what a layer keeps falls as 1/cp
        ctx.save_for_backward(query, key, value, rank, out, torch.cat([lse for _, lse in halves], dim=-1))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, rank, out, lse = ctx.saved_tensors
        mode = ctx.mode
        cp, c = mode.size, query.shape[-2] // 2
        whole_key, whole_value = _gather_kv(mode, key, value, "keys and values for backward")
        grad_out = grad_out.contiguous()
        grad_q, grad_k, grad_v = [], [], []
        # gradients of the gathered keys and values, per rank and chunk: [cp, 2] lists of parts
        whole_k = {}
        whole_v = {}
        for half, terms in enumerate(_causal_terms(query, key, value, whole_key, whole_value, rank, cp)):
            rows = slice(half * c, (half + 1) * c)
            g, o, m = grad_out[..., rows, :], out[..., rows, :].contiguous(), lse[..., rows].contiguous()
            dq_total = None
            for q, k, v, causal, n, keep, where in terms:
                dq, dk, dv = _flash_backward(g, q, k, v, o, m, causal, n, keep, ctx.scale)
                dq_total = dq if dq_total is None else dq_total + dq
                if where == "local":
                    grad_k.append(dk)
                    grad_v.append(dv)
                else:
                    whole_k.setdefault(where, []).append(dk)
                    whole_v.setdefault(where, []).append(dv)
            grad_q.append(dq_total)
        shape = (whole_key.shape[0], whole_key.shape[1], cp, c, whole_key.shape[-1])
        mine_k, mine_v = _scatter_kv(mode, _whole_grad(whole_k, shape), _whole_grad(whole_v, shape),
                                     key.shape, value.shape, "keys and values gradient")
        return (torch.cat(grad_q, dim=-2), torch.cat(grad_k, dim=-2) + mine_k, torch.cat(grad_v, dim=-2) + mine_v,
                None, None, None)


def _causal_terms(query, key, value, whole_key, whole_value, rank, cp):
    """Per local half (``A``, ``B``): the blocks it attends to, each ``(q, k, v, is_causal, n,
    keep, where)``: ``n`` the blocks batched in the call (``q`` repeated ``n`` times on dim 0),
    ``keep`` which of them apply to this rank (None: all), ``where`` whose gradient ``k`` is
    (``"local"``; ``("A", n)``: the gathered ``A`` chunks, batched; ``("A", 1)``: the gathered
    ``A`` chunks, concatenated; ``("B", n)``: the gathered ``B`` chunks, batched)."""
    c = query.shape[-2] // 2
    b, hk, e = whole_key.shape[0], whole_key.shape[1], whole_key.shape[-1]
    ranks = torch.arange(cp, device=rank.device)
    before, after = ranks < rank, ranks > rank

    def chunks(whole, which):  # the gathered chunks `which` (0: A, 1: B) of every rank
        return whole.reshape(b, hk, cp, 2, c, e)[:, :, :, which]  # [b, hk, cp, c, e]

    def batched(whole, which):  # [cp * b, hk, c, e], rank-major
        return chunks(whole, which).permute(2, 0, 1, 3, 4).reshape(cp * b, hk, c, e)

    def joined(whole):  # the A chunks as one sequence: [b, hk, cp * c, e]
        return chunks(whole, 0).reshape(b, hk, cp * c, e)

    qa, qb = query[..., :c, :], query[..., c:, :]
    return [
        [(qa, key[..., :c, :], value[..., :c, :], True, 1, None, "local"),
         (qa, batched(whole_key, 0), batched(whole_value, 0), False, cp, before, ("A", cp))],
        [(qb, key[..., c:, :], value[..., c:, :], True, 1, None, "local"),
         (qb, joined(whole_key), joined(whole_value), False, 1, None, ("A", 1)),
         (qb, batched(whole_key, 1), batched(whole_value, 1), False, cp, after, ("B", cp))],
    ]


def _repeat(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` [b, ...] as [n * b, ...] (block-major), contiguous (the kernels need dense rows)."""
    if n == 1:
        return t.contiguous()
    return t.unsqueeze(0).expand(n, *t.shape).reshape(n * t.shape[0], *t.shape[1:])


def _flash(q, k, v, causal, n, keep, scale):
    """One block's (or ``n`` batched blocks') output and log-sum-exp, [n, b, ...]; a block that
    does not apply gets log-sum-exp ``-inf`` (weight 0 in the merge)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _repeat(q, n), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    out, lse = out.unflatten(0, (n, q.shape[0])), lse.unflatten(0, (n, q.shape[0]))
    if keep is not None:
        lse = torch.where(keep.view(n, 1, 1, 1), lse, torch.full((), float("-inf"), dtype=lse.dtype,
                                                                 device=lse.device))
    return out, lse


def _merge(parts, dtype):
    """The blocks' outputs merged by the log-sum-exp rule: ``(out, lse)`` of the union of their
    keys (the causal diagonal block always applies, so ``lse`` is finite)."""
    lses = torch.cat([lse for _, lse in parts], dim=0)  # [blocks, b, h, L]
    # log-sum-exp over the blocks from allowlisted ops (the largest is finite: the diagonal block)
    top = lses.amax(dim=0)
    total = top + torch.exp(lses - top).sum(0).log()
    out = None
    start = 0
    for part, lse in parts:
        weight = torch.exp(lses[start:start + lse.shape[0]] - total).unsqueeze(-1)
        start += lse.shape[0]
        term = (weight * part.to(weight.dtype)).sum(0)
        out = term if out is None else out + term
    return out.to(dtype), total


def _flash_backward(g, q, k, v, out, lse, causal, n, keep, scale):
    """One block's (or ``n`` batched blocks') gradients given the merged ``out`` and ``lse``;
    the query gradient summed over the blocks that apply, the key and value gradients per block
    (zero where a block does not apply: ``where``, so nothing the kernel computed for a block
    outside the causal rule leaks in, not even an overflow)."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _repeat(g, n), _repeat(q, n), k.contiguous(), v.contiguous(), _repeat(out, n), _repeat(lse, n), 0.0,
        causal, scale=scale)
    if keep is None and n == 1:
        return dq, dk, dv
    dq, dk, dv = (t.unflatten(0, (n, q.shape[0])) for t in (dq, dk, dv))
    if keep is not None:
        zero = torch.zeros((), dtype=dq.dtype, device=dq.device)
        dq, dk, dv = (torch.where(keep.view(n, 1, 1, 1, 1), t, zero) for t in (dq, dk, dv))
    return dq.sum(0), dk, dv


def _whole_grad(parts: dict, shape) -> torch.Tensor:
    """The gathered keys' (or values') gradient [b, hk, cp * 2 * c, e] from the blocks' parts."""
    b, hk, cp, c, e = shape
    per_chunk = []
    for which in ("A", "B"):
        total = None
        for key, grads in parts.items():
            if key[0] != which:
                continue
            for grad in grads:
                if key[1] == 1:  # [b, hk, cp * c, e]
                    grad = grad.view(b, hk, cp, c, e)
                else:  # [cp, b, hk, c, e]
                    grad = grad.permute(1, 2, 0, 3, 4)
                total = grad if total is None else total + grad
        per_chunk.append(total)  # every chunk is in some block of each half's terms
    return torch.stack(per_chunk, dim=3).reshape(b, hk, cp * 2 * c, e)


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    """``t`` (tokens on dim -2) as [tokens, everything else]."""
    return t.movedim(-2, 0).reshape(t.shape[-2], -1)


def _split_tokens(flat: torch.Tensor, key_shape, value_shape, ranks: int):
    """Inverse of ``_tokens_first`` on the concatenated keys and values of ``ranks`` ranks."""
    n_key = flat.shape[1] - _numel(value_shape) // value_shape[-2]
    out = []
    for part, shape in zip(flat.split([n_key, flat.shape[1] - n_key], dim=1), (key_shape, value_shape)):
        tokens_first = (flat.shape[0],) + tuple(shape[:-2]) + (shape[-1],)
        out.append(part.reshape(tokens_first).movedim(0, -2))
    return tuple(out)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
