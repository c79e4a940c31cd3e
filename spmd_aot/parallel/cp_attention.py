"""Attention across a ``cp`` split, as autograd functions the trace records as aten ops.

``GatherKV`` all_gathers the local keys and values over ``cp`` in one collective (backward: one
reduce_scatter of their gradients). ``CausalBlocks`` computes causal attention for a rank's two
load-balanced chunks with no mask: each chunk attends causally to its own block and fully to the
earlier ones, one CPU flash-attention call per block merged by the log-sum-exp rule; its backward
runs the flash backward per block with the merged output and log-sum-exp (exact per block) after
gathering the keys and values again, so only the rank's own tensors are kept
(``context_parallel.py`` says what a rank computes and why).
"""

from __future__ import annotations

import torch

__all__ = ["GatherKV", "CausalBlocks"]


class GatherKV(torch.autograd.Function):
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


class CausalBlocks(torch.autograd.Function):
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
