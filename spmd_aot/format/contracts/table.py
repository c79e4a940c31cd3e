"""The contract table, as data: overload name -> its checker, and ``check_call``, what
``validate`` runs on every node's metadata before its meta kernel."""

from __future__ import annotations

import functools
from collections.abc import Callable


from ..allowlist import is_opted_in
from .rules import _bind, _general
from .checkers import (attention_cpu, bucketize, collective, convolution, dims, elementwise, factory, fft, foreach,
                       fused_step, grid_sampler, index_values, log_sigmoid_backward, matmul, nll_loss, pooling,
                       softmax, unchecked_by_design)
from .normalization import batch_norm, batch_norm_writes, group_norm, layer_norm, weight_norm
from .all_to_all import all_to_all_single
from .views import complex_view, conj_view, polar, real_view, split_views, strided_view


P = functools.partial
_ELEMENTWISE_OPS = """
    abs.default add.Scalar add.Tensor add_.Scalar add_.Tensor addcdiv.default addcdiv_.default addcmul.default
    addcmul_.default bernoulli_.float bitwise_and.Tensor bitwise_not.default bitwise_or.Tensor clamp.default
    clamp.Tensor clamp_max.default clamp_min.default copy_.default cos.default div.Scalar div.Tensor div_.Scalar
    div_.Tensor eq.Scalar eq.Tensor erf.default exp.default exp2.default expm1.default fill_.Scalar gelu.default
    gelu_backward.default ge.Scalar ge.Tensor gt.Scalar gt.Tensor hardtanh.default hardtanh_backward.default
    isinf.default isnan.default le.Scalar le.Tensor leaky_relu.default leaky_relu_backward.default lerp.Scalar
    lerp_.Scalar log.default log1p.default logical_and.default logical_and_.default logical_not.default
    logical_or.default logical_or_.default lt.Scalar lt.Tensor masked_fill.Scalar masked_fill.Tensor maximum.default
    minimum.default mse_loss.default mse_loss_backward.default mul.Scalar mul.Tensor mul_.Scalar mul_.Tensor
    nan_to_num.default native_dropout.default native_dropout_backward.default ne.Scalar ne.Tensor neg.default
    pow.Scalar pow.Tensor_Scalar pow.Tensor_Tensor reciprocal.default relu.default relu_.default rsqrt.default
    rsub.Scalar rsub.Tensor sgn.default sigmoid.default sigmoid_backward.default sign.default silu.default
    silu_backward.default sin.default softplus.default softplus_backward.default sqrt.default square.default
    sub.Scalar sub.Tensor sub_.Tensor sub_.Scalar tanh.default tanh_backward.default threshold_backward.default
    where.self where.ScalarOther where.ScalarSelf zero_.default _to_copy.default clone.default alias.default
    detach.default lift_fresh_copy.default empty_like.default ones_like.default zeros_like.default
    full_like.default new_empty.default new_ones.default new_zeros.default logical_not_.default
    bitwise_and_.Tensor bitwise_or_.Tensor masked_fill_.Scalar masked_fill_.Tensor tril_.default triu_.default
    neg_.default exp_.default sigmoid_.default tanh_.default clamp_.default clamp_min_.default gelu_.default
    silu_.default cos_.default sin_.default rsqrt_.default sqrt_.default reciprocal_.default pow_.Scalar
    leaky_relu_.default hardtanh_.default fill_.Tensor fill.Scalar copy.default acos.default acosh.default
    asin.default asinh.default atan.default atanh.default atan2.default atan2.out bitwise_and.Scalar
    bitwise_or.Scalar bitwise_xor.Scalar bitwise_xor.Tensor ceil.default cosh.default div.Scalar_mode
    div.Tensor_mode elu.default floor.default fmod.Scalar fmod.Tensor log10.default log2.default
    logical_xor.default remainder.Scalar remainder.Tensor round.default sinh.default tan.default trunc.default
    log_sigmoid_forward.default
"""
_KERNEL_CHECKED_OPS = """
    _unsafe_view.default view.default reshape.default expand.default expand_as.default t.default transpose.int
    permute.default select.int slice.Tensor narrow.default split_with_sizes.default
    unflatten.int flatten.using_ints squeeze.default squeeze.dim squeeze.dims unsqueeze.default view_as.default
    split_with_sizes_copy.default cat.default stack.default flip.default roll.default repeat.default
    constant_pad_nd.default tril.default triu.default select_backward.default slice_backward.default
    empty.memory_format full.default ones.default zeros.default arange.default arange.start arange.start_step
    scalar_tensor.default sort.default topk.default _c10d_functional.wait_tensor.default diagonal.default
    select_scatter.default slice_scatter.default rand.default randn.default randperm.default
    reflection_pad1d.default reflection_pad2d.default reflection_pad3d.default replication_pad2d.default
    replication_pad3d.default avg_pool3d.default max_pool3d_with_indices.default _adaptive_avg_pool3d.default
    col2im.default upsample_nearest2d.vec upsample_bilinear2d.vec _cdist_forward.default _pdist_forward.default
    eye.default eye.m upsample_bilinear2d.default upsample_bilinear2d_backward.default
"""
_DIM_OPS = {  # reductions and dim-taking ops: (dim argument names)
    "amax.default": ("dim",), "amin.default": ("dim",), "argmax.default": ("dim",), "cumsum.default": ("dim",),
    "max.dim": ("dim",), "min.dim": ("dim",), "max.default": (), "min.default": (), "mean.default": (),
    "mean.dim": ("dim",), "sum.default": (), "sum.dim_IntList": ("dim",), "prod.dim_int": ("dim",),
    "std.correction": ("dim",), "var.correction": ("dim",), "var_mean.correction": ("dim",),
    "linalg_vector_norm.default": ("dim",), "any.default": (), "any.dim": ("dim",), "all.default": (),
    "all.dim": ("dim",), "argmin.default": ("dim",), "logsumexp.default": ("dim",), "any.dims": ("dim",),
    "prod.default": (), "var.dim": ("dim",), "_safe_softmax.default": ("dim",),
}

_RULES: list[tuple[Callable, str]] = [
    (unchecked_by_design, _KERNEL_CHECKED_OPS),
    (strided_view, "as_strided.default"),
    (complex_view, "view_as_complex.default"),
    (real_view, "view_as_real.default"),
    (polar, "polar.default"),
    (conj_view, "_conj.default"),
    (P(split_views, kind="unbind"), "unbind.int"),
    (P(split_views, kind="split"), "split.Tensor"),
    (P(split_views, kind="chunk"), "chunk.default"),
    (P(matmul, kind="mm"), "mm.default"),
    (P(matmul, kind="mm.out"), "mm.out"),
    (P(matmul, kind="addmm"), "addmm.default"),
    (P(matmul, kind="bmm"), "bmm.default"),
    (P(matmul, kind="baddbmm"), "baddbmm.default"),
    (P(matmul, kind="linear"), "linear.default"),
    (P(matmul, kind="matmul"), "matmul.default"),
    (P(layer_norm, backward=False), "native_layer_norm.default"),
    (P(layer_norm, backward=True), "native_layer_norm_backward.default"),
    (P(batch_norm, backward=False), "native_batch_norm.default"),  # running stats: see batch_norm_writes
    (P(batch_norm, backward=True), "native_batch_norm_backward.default"),
    (P(softmax, backward=False), "_softmax.default _log_softmax.default"),
    (P(softmax, backward=True), "_softmax_backward_data.default _log_softmax_backward_data.default"),
    (P(nll_loss, backward=False), "nll_loss_forward.default"),
    (P(nll_loss, backward=True), "nll_loss_backward.default"),
    (P(index_values, op="embedding"), "embedding.default"),
    (P(index_values, op="embedding_dense_backward"), "embedding_dense_backward.default"),
    (P(index_values, op="index_select"), "index_select.default"),
    (P(index_values, op="gather"), "gather.default"),
    (P(index_values, op="scatter_add"), "scatter_add.default"),
    (P(index_values, op="index"), "index.Tensor index_put.default"),
    (P(index_values, op="scatter"), "scatter.value scatter.src scatter_reduce.two scatter_.value scatter_.src"),
    (P(index_values, op="embedding_bag"), "_embedding_bag.default"),
    (P(index_values, op="masked_scatter"), "masked_scatter.default"),
    (factory, "empty_strided.default new_empty_strided.default"),
    (bucketize, "bucketize.Tensor"),
    (log_sigmoid_backward, "log_sigmoid_backward.default"),
    (P(weight_norm, backward=False), "_weight_norm_interface.default"),
    (P(weight_norm, backward=True), "_weight_norm_interface_backward.default"),
    (P(batch_norm, backward=False), "_native_batch_norm_legit.default _native_batch_norm_legit.no_stats "
                                    "_native_batch_norm_legit_no_training.default"),
    (P(group_norm, backward=False), "native_group_norm.default"),
    (P(group_norm, backward=True), "native_group_norm_backward.default"),
    (P(fft, kind="r2c"), "_fft_r2c.default"),
    (P(fft, kind="c2r"), "_fft_c2r.default"),
    (grid_sampler, "grid_sampler_2d.default"),
    (P(pooling, kind="avg"), "avg_pool2d.default"),
    (P(pooling, kind="avg_backward"), "avg_pool2d_backward.default"),
    (P(pooling, kind="max"), "max_pool2d_with_indices.default"),
    (P(pooling, kind="max_backward"), "max_pool2d_with_indices_backward.default"),
    (P(pooling, kind="max1d"), "max_pool1d.default"),
    (P(pooling, kind="adaptive"), "_adaptive_avg_pool2d.default"),
    (P(pooling, kind="adaptive_backward"), "_adaptive_avg_pool2d_backward.default"),
    (P(convolution, backward=False), "convolution.default"),
    (P(convolution, backward=True), "convolution_backward.default"),
    (P(attention_cpu, backward=False), "_scaled_dot_product_flash_attention_for_cpu.default"),
    (P(attention_cpu, backward=True), "_scaled_dot_product_flash_attention_for_cpu_backward.default"),
    (P(fused_step, state=("grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"), steps="state_steps"),
     "_fused_adam_.default _fused_adam_.tensor_lr _fused_adamw_.default _fused_adamw_.tensor_lr"),
    (P(fused_step, state=("grads", "momentum_buffer_list"), steps=None), "_fused_sgd_.default _fused_sgd_.tensor_lr"),
    (foreach, """_foreach_abs.default _foreach_add.Scalar _foreach_add_.Scalar _foreach_div_.Scalar
        _foreach_mul.Scalar _foreach_mul_.Scalar _foreach_neg_.default _foreach_norm.Scalar _foreach_reciprocal_.default
        _foreach_sign.default _foreach_sqrt.default _foreach_sqrt_.default _foreach_sub.Scalar _foreach_sub_.Scalar
        _foreach_zero_.default _foreach_abs_.default _foreach_sign_.default _foreach_clamp_min_.Scalar
        _foreach_clamp_max_.Scalar _foreach_maximum_.Scalar"""),
    (P(foreach, lists=("exponent",)), "_foreach_pow.ScalarAndTensor"),
    (P(foreach, lists=("self", "other")), """_foreach_add.List _foreach_add_.List _foreach_div.List
        _foreach_div_.List _foreach_maximum_.List _foreach_mul.List _foreach_mul_.List _foreach_sub.List
        _foreach_sub_.List"""),
    (P(foreach, lists=("self", "src")), "_foreach_copy_.default"),
    (P(foreach, scalar_tensor="other"), "_foreach_add_.Tensor _foreach_div_.Tensor _foreach_mul.Tensor _foreach_mul_.Tensor"),
    (P(foreach, scalars="scalars"), "_foreach_add_.ScalarList"),
    (P(foreach, lists=("self", "tensor1", "tensor2")), "_foreach_addcdiv_.Scalar _foreach_addcmul_.Scalar "
                                                       "_foreach_addcdiv.Scalar _foreach_addcmul.Scalar"),
    (P(foreach, lists=("self", "tensor1", "tensor2"), scalars="scalars"),
     "_foreach_addcdiv_.ScalarList"),
    (P(foreach, lists=("self", "tensors1")), "_foreach_lerp_.Scalar"),
    (P(foreach, lists=("self", "tensors1", "weights")), "_foreach_lerp_.List"),
    (P(collective, kind="all_gather"), "all_gather_into_tensor.default all_gather_into_tensor_coalesced.default "
                                       "all_gather_into_tensor_out.default"),
    (P(collective, kind="reduce_scatter"), "reduce_scatter_tensor.default reduce_scatter_tensor_coalesced.default"),
    (P(collective, kind="all_reduce"), "all_reduce.default all_reduce_coalesced.default"),
    (P(collective, kind="all_reduce_"), "all_reduce_.default all_reduce_coalesced_.default"),
    (P(collective, kind="broadcast"), "broadcast.default broadcast_.default"),
    (all_to_all_single, "all_to_all_single.default"),
]


class Contract:
    """One overload's contract: its relation checker, and whether a written argument may be the
    identical view of a read one (elementwise kernels read each element before writing it)."""

    __slots__ = ("check", "alias_ok", "extra_writes", "family")

    def __init__(self, check: Callable, alias_ok: bool, family: str, extra_writes: Callable | None = None):
        self.check, self.alias_ok, self.family, self.extra_writes = check, alias_ok, family, extra_writes


def _table() -> dict[str, Contract]:
    out: dict[str, Contract] = {}

    def add(names: str, contract: Contract) -> None:
        for short in names.split():
            short = short.removeprefix("_c10d_functional.")
            ns = "_c10d_functional" if short.split(".")[0] in _COLLECTIVE_NAMES else "aten"
            name = f"{ns}::{short}"
            if name in out:
                raise ValueError(f"two contracts for {name}")
            out[name] = contract

    for short in _ELEMENTWISE_OPS.split():
        add(short, Contract(elementwise, True, "elementwise"))
    for short, args in _DIM_OPS.items():
        add(short, Contract(P(dims, args=args), False, "reduction"))
    for check, names in _RULES:
        family = getattr(check, "func", check).__name__
        alias_ok = family == "foreach"  # per element: read, then written
        extra = batch_norm_writes if getattr(check, "func", None) is batch_norm else None
        add(names, Contract(check, alias_ok, family, extra))
    return out


_COLLECTIVE_NAMES = {"all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out",
                     "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_reduce", "all_reduce_",
                     "all_reduce_coalesced", "all_reduce_coalesced_", "broadcast", "broadcast_", "wait_tensor",
                     "all_to_all_single"}

#: "namespace::op.overload" -> its Contract. Every overload in allowed_ops.txt must have one.
CONTRACTS: dict[str, Contract] = _table()


def op_name(op) -> str:
    """``"aten::relu.default"``: the allowlist's spelling of an overload."""
    return f"{op._schema.name}.{op._overloadname}"


def contract_of(op) -> Contract | None:
    return CONTRACTS.get(op_name(op)) if hasattr(op, "_overloadname") else None


def check_call(op, args: tuple, kwargs: dict) -> None:
    """Check one call's arguments (meta or real tensors) against ``op``'s contract: raises
    ``Broken`` naming the argument and the relation, or ``LookupError`` if ``op`` has none."""
    contract = contract_of(op)
    if contract is None:
        if not (hasattr(op, "_overloadname") and is_opted_in(op_name(op))):
            raise LookupError(f"{op} has no argument contract (spmd_aot/format/contracts/table.py)")
        # opted in by this job (allowlist.opted_in): the rules every op obeys, the rest vouched for
        _general(*_bind(op, args, kwargs), alias_ok=False)
        return
    bound, written = _bind(op, args, kwargs)
    extra = contract.extra_writes(bound) if contract.extra_writes else ()
    _general(bound, written, contract.alias_ok, extra)
    if contract.check is elementwise:
        elementwise(bound, written | frozenset(extra))
    else:
        contract.check(bound)
