"""Op argument contracts (spmd_aot/format/contracts/): every admitted overload has one, and the
crafted entries of the op review (heap corruption and SIGSEGV from arguments torch's meta
kernels accept) are refused by the load-time check, or by the run-time index check."""

from __future__ import annotations

import pytest
import torch

from spmd_aot.format import allowlist
from spmd_aot.format import contracts
from spmd_aot.errors import UnsafeArtifactError
from spmd_aot.interpreter.program import Program
from spmd_aot.format.serialize import DecodedNode, Ref, resolve_target
from spmd_aot.format.validate import check_graph

aten = torch.ops.aten


def test_every_allowed_overload_has_a_contract():
    missing = sorted(n for n in allowlist.allowed_ops() if n not in contracts.CONTRACTS)
    assert missing == [], f"add these to spmd_aot/format/contracts/ before admitting them: {missing}"


def test_every_contract_names_an_overload_of_this_torch():
    for name in contracts.CONTRACTS:
        assert callable(resolve_target(name)) if name in allowlist.allowed_ops() else \
            callable(getattr(getattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1].split(".")[0]),
                             name.split(".")[-1])), name


def test_value_checked_ops_have_contracts():
    assert set(contracts.VALUE_CHECKS) <= set(contracts.CONTRACTS)


def _graph(layout: list[tuple[list, str]], calls: list[tuple]) -> tuple[list, list]:
    """Placeholders from ``layout``, then ``calls`` (name, op, args, kwargs) referring to earlier
    values by index; the output returns the last call."""
    nodes = [DecodedNode("placeholder", f"x{i}", f"x{i}", (), {}) for i in range(len(layout))]
    for name, op, args, kwargs in calls:
        nodes.append(DecodedNode("call_function", name, op, args, kwargs))
    nodes.append(DecodedNode("output", "output", "output", ([Ref(len(nodes) - 1)],), {}))
    return nodes, [{"local_shape": s, "dtype": d} for s, d in layout]


def _refused(layout, calls, match):
    nodes, inputs = _graph(layout, calls)
    with pytest.raises(UnsafeArtifactError, match=match):
        check_graph(nodes, {}, inputs, device_type="cpu")


def _accepted(layout, calls):
    nodes, inputs = _graph(layout, calls)
    check_graph(nodes, {}, inputs, device_type="cpu")
    return nodes


F32 = "float32"
ADAM = dict(beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)


@pytest.mark.parametrize("op,lr", [(aten._fused_adam_.default, 0.1), (aten._fused_adamw_.default, 0.1),
                                   (aten._fused_adam_.tensor_lr, "tensor"), (aten._fused_adamw_.tensor_lr, "tensor")])
def test_fused_adam_with_one_element_state_is_refused(op, lr):
    """Review case: the CPU kernel reads/writes exp_avg[param.numel()] (free(): invalid next size)."""
    layout = [([100000], F32), ([100000], F32), ([1], F32), ([1], F32), ([], F32), ([], "float64")]
    lr_arg = Ref(5) if lr == "tensor" else lr
    call = ("step", op, ([Ref(0)], [Ref(1)], [Ref(2)], [Ref(3)], [], [Ref(4)]), dict(ADAM, lr=lr_arg))
    _refused(layout, [call], r"breaks its op's argument contract: argument 'exp_avgs\[0\]' has shape \[1\], "
                             r"must be self\[0\]\.shape")
    good = [([100000], F32)] * 4 + [([], F32), ([], "float64")]
    _accepted(good, [call])


@pytest.mark.parametrize("op", [aten._fused_adam_.default, aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr])
def test_fused_step_on_a_stride_0_parameter_is_refused(op):
    """Review case: a parameter expanded from one element (stride 0) is written by every index."""
    layout = [([1], F32), ([4096], F32), ([4096], F32), ([4096], F32), ([], F32), ([], F32)]
    expand = ("p", aten.expand.default, (Ref(0), [4096]), {})
    if op is aten._fused_adam_.default:
        call = ("step", op, ([Ref(6)], [Ref(1)], [Ref(2)], [Ref(3)], [], [Ref(4)]), dict(ADAM, lr=0.1))
    else:
        call = ("step", op, ([Ref(6)], [Ref(1)], [Ref(2)]),
                dict(weight_decay=0.0, momentum=0.9, lr=Ref(5) if "tensor_lr" in str(op) else 0.1, dampening=0.0,
                     nesterov=False, maximize=False, is_first_step=False))
    _refused(layout, [expand, call], r"argument 'self\[0\]' is written but its elements overlap")


def test_fused_adam_amsgrad_needs_its_max_list():
    layout = [([8], F32)] * 4 + [([], F32)]
    call = ("step", aten._fused_adam_.default, ([Ref(0)], [Ref(1)], [Ref(2)], [Ref(3)], [], [Ref(4)]),
            dict(ADAM, lr=0.1, amsgrad=True))
    _refused(layout, [call], "argument 'max_exp_avg_sqs' has 0 tensors, self has 1")
    aliased = ("step", aten._fused_adam_.default, ([Ref(0)], [Ref(1)], [Ref(2)], [Ref(2)], [], [Ref(4)]),
               dict(ADAM, lr=0.1))
    _refused(layout, [aliased], r"argument 'exp_avgs\[0\]' overlaps argument 'exp_avg_sqs\[0\]'")


def test_layer_norm_backward_with_short_mean_is_refused():
    """Review case: torch's meta kernel does not check mean/rstd; the CPU kernel reads M of each."""
    x, ns = [64, 128], [128]
    layout = [(x, F32), (x, F32), ([1], F32), ([1], F32), (ns, F32), (ns, F32)]
    call = ("lnb", aten.native_layer_norm_backward.default,
            (Ref(0), Ref(1), ns, Ref(2), Ref(3), Ref(4), Ref(5), [True, True, True]), {})
    _refused(layout, [call], r"argument 'mean' has shape \[1\], must be input.shape\[:-k\] \+ \[1\]\*k = \[64, 1\]")
    layout[2] = layout[3] = ([64, 1], F32)
    _accepted(layout, [call])
    layout[0] = ([64, 1], F32)  # grad_out that does not match input
    _refused(layout, [call], "argument 'grad_out' has shape")


def test_layer_norm_backward_takes_a_strided_grad_out_as_its_kernel_does():
    """Sequence-parallel graphs pass a transposed grad_out; the CPU kernel makes it contiguous
    first, so the contract admits any strides and the result equals the contiguous call's."""
    x, w, b = torch.randn(4, 8, 16), torch.randn(16), torch.randn(16)
    _, mean, rstd = aten.native_layer_norm.default(x, [16], w, b, 1e-5)
    for g in (torch.randn(8, 4, 16).transpose(0, 1), torch.randn(1, 1, 16).expand(4, 8, 16)):
        args = (g, x, [16], mean, rstd, w, b, [True, True, True])
        contracts.check_call(aten.native_layer_norm_backward.default, args, {})
        got = aten.native_layer_norm_backward.default(*args)
        want = aten.native_layer_norm_backward.default(g.contiguous(), *args[1:])
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("hq,hk,ok", [(4, 2, True), (4, 1, True), (4, 4, True),
                                       (4, 3, False),   # the kernel reads past the key heads
                                       (2, 4, False)])  # the kernel divides by zero (SIGFPE)
def test_grouped_query_attention_needs_key_heads_dividing_query_heads(hq, hk, ok):
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    args = (torch.randn(2, hq, 5, 8), torch.randn(2, hk, 6, 8), torch.randn(2, hk, 6, 8), 0.0, True)
    if ok:
        contracts.check_call(op, args, {})
    else:
        with pytest.raises(contracts.Broken, match="must divide query's"):
            contracts.check_call(op, args, {})


def test_convolution_backward_without_bias_passes_bias_sizes_0():
    op = aten.convolution_backward.default
    args = [torch.randn(1, 6, 6, 6), torch.randn(1, 4, 6, 6), torch.randn(6, 2, 3, 3), [0], [1, 1], [1, 1],
            [1, 1], False, [0, 0], 2, [True, True, False]]
    contracts.check_call(op, tuple(args), {})
    args[-1] = [True, True, True]  # a bias gradient needs the bias' size
    with pytest.raises(contracts.Broken, match="bias_sizes"):
        contracts.check_call(op, tuple(args), {})


def test_batch_norm_with_short_weight_is_refused():
    """Review case: torch's meta kernel does not check weight/running stats against C."""
    layout = [([4, 1000, 8], F32), ([1], F32), ([1], F32), ([1000], F32), ([1000], F32)]
    call = ("bn", aten.native_batch_norm.default, (Ref(0), Ref(1), Ref(2), Ref(3), Ref(4), True, 0.1, 1e-5), {})
    _refused(layout, [call], r"argument 'weight' has shape \[1\], must be \[input.shape\[1\]\] = \[1000\]")
    layout[1] = layout[2] = ([1000], F32)
    _accepted(layout, [call])
    stride0 = [("rm", aten.expand.default, (Ref(3), [1000]), {})]  # a running stat that is written
    layout[3] = ([1], F32)
    call = ("bn", aten.native_batch_norm.default, (Ref(0), Ref(1), Ref(2), Ref(5), Ref(4), True, 0.1, 1e-5), {})
    _refused(layout, stride0 + [call], "argument 'running_mean' is written but its elements overlap")


def test_max_pool_backward_shapes_are_checked_and_indices_at_run_time():
    """Review case: the CPU kernel adds into grad_input[index] with unchecked index values."""
    layout = [([1, 1, 4, 4], F32), ([1, 1, 2, 2], F32), ([1, 1, 2, 2], "int64")]
    call = ("mpb", aten.max_pool2d_with_indices_backward.default,
            (Ref(1), Ref(0), [2, 2], [2, 2], [0, 0], [1, 1], False, Ref(2)), {})
    nodes = _accepted(layout, [call])
    program = Program(nodes, {}, fold=False)
    x, grad = torch.randn(1, 1, 4, 4), torch.ones(1, 1, 2, 2)
    program(x, grad, torch.tensor([[[[0, 3], [8, 15]]]]))  # in range: fine
    for bad in (1 << 30, -1, 16):
        with pytest.raises(IndexError, match=r"must lie in \[0, 16\)"):
            program(x, grad, torch.full((1, 1, 2, 2), bad))
    layout[2] = ([1, 1, 1, 2], "int64")
    _refused(layout, [call], "argument 'indices' has shape")


@pytest.mark.parametrize("scale", [True, False])
def test_embedding_backward_index_values_are_checked_at_run_time(scale):
    """Review case: with scale_grad_by_freq the CPU kernel counts counts[index]++ unchecked."""
    layout = [([3, 4], F32), ([3], "int64")]
    call = ("eb", aten.embedding_dense_backward.default, (Ref(0), Ref(1), 10, -1, scale), {})
    program = Program(_accepted(layout, [call]), {}, fold=False)
    assert program(torch.ones(3, 4), torch.tensor([0, 1, 9]))[0].shape == (10, 4)
    with pytest.raises(IndexError, match="embedding_dense_backward indices"):
        program(torch.ones(3, 4), torch.tensor([0, 1 << 30, 5]))
    layout[1] = ([5], "int64")
    _refused(layout, [call], "argument 'grad_output' has shape")


def test_written_tensors_must_not_overlap_their_inputs():
    layout = [([8, 8], F32), ([8, 8], F32)]
    # out= a view of an input it reads: the kernel would read what it already overwrote
    _refused(layout, [("mm", aten.mm.out, (Ref(0), Ref(1)), {"out": Ref(1)})], "overlaps argument")
    # in place on itself (elementwise, identical view): fine
    _accepted(layout, [("a", aten.add_.Tensor, (Ref(0), Ref(0)), {})])
    # partial overlap between a written tensor and an input: refused
    shifted = [("s", aten.slice.Tensor, (Ref(0), 0, 1, 8), {}), ("h", aten.slice.Tensor, (Ref(0), 0, 0, 7), {})]
    _refused(layout, shifted + [("c", aten.copy_.default, (Ref(3), Ref(2)), {})], "overlaps argument")
    # stride-0 written tensor
    expand = [("e", aten.expand.default, (Ref(0), [4, 8, 8]), {})]
    _refused(layout, expand + [("z", aten.zero_.default, (Ref(2),), {})], "is written but its elements overlap")


def test_in_place_ops_cannot_broadcast_their_output():
    layout = [([1, 8], F32), ([8, 8], F32)]
    _refused(layout, [("a", aten.add_.Tensor, (Ref(0), Ref(1)), {})], r"argument 'self' has shape \[1, 8\]")


def test_foreach_lists_line_up():
    layout = [([4], F32), ([4], F32), ([5], F32)]
    _accepted(layout[:2], [("f", aten._foreach_add_.List, ([Ref(0)], [Ref(1)]), {})])
    _refused(layout, [("f", aten._foreach_add_.List, ([Ref(0), Ref(1)], [Ref(2)]), {})], "has 1 tensors")
    _refused(layout, [("f", aten._foreach_add_.List, ([Ref(0)], [Ref(2)]), {})],
             r"other\[0\]' of shape \[5\] does not broadcast")
    layout[2] = ([2, 4], F32)  # broadcasting self[0] up: the written tensor would have to grow
    _refused(layout, [("f", aten._foreach_add_.List, ([Ref(0)], [Ref(2)]), {})], "would broadcast self")


def test_collective_input_must_have_dim_0():
    layout = [([], F32)]
    _refused(layout, [("g", torch.ops._c10d_functional.all_gather_into_tensor.default, (Ref(0), 2, "0"), {})],
             "must have a dimension 0")


def test_an_allowed_op_without_a_contract_is_refused(monkeypatch):
    monkeypatch.delitem(contracts.CONTRACTS, "aten::relu.default")
    _refused([([4], F32)], [("r", aten.relu.default, (Ref(0),), {})], "has no argument contract")


def test_the_check_costs_little_per_node():
    """Contract checks run on memo misses only; a 12-layer-like graph's distinct nodes are few."""
    import time

    x = torch.empty(64, 128, device="meta")
    w = torch.empty(128, device="meta")
    args = (x, x, [128], torch.empty(64, 1, device="meta"), torch.empty(64, 1, device="meta"), w, w, [True] * 3)
    start = time.perf_counter()
    for _ in range(1000):
        contracts.check_call(aten.native_layer_norm_backward.default, args, {})
    assert (time.perf_counter() - start) / 1000 < 1e-3


def test_verify_reports_the_review_cases(tmp_path, capsys):
    """The review's crafted entries, stored as someone with write access and no key would: each
    refused at load and counted by ``spmd-aot verify`` (it reported 0 problems before)."""
    import shutil

    from support.jobs import build_unsigned
    from test_hostile import Crafter, ints, node, ref

    from spmd_aot.entries import read_artifact
    from spmd_aot.cli.app import main as cli
    from spmd_aot.store import LocalStore

    pristine = tmp_path / "pristine"
    digest = build_unsigned(pristine).digest
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    store = LocalStore(cache)
    c = Crafter(store, digest)
    m, v = c.matrix, c.vector
    rows, cols = c.shapes[m]
    sgd = dict(weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False, maximize=False,
               is_first_step=False)
    table = {
        "fused_sgd_short_momentum": c.graph(node("g", "aten::clone.default", ref(m)), node(
            "evil", "aten::_fused_sgd_.default", ints(ref(m)), ints(ref("g")), ints(ref(v)), **sgd)),
        "layer_norm_backward_short_mean": c.graph(node(
            "evil", "aten::native_layer_norm_backward.default", ref(m), ref(m), ints(cols), ref(v), ref(v), None, None,
            ints(True, True, True))),
        "batch_norm_short_weight": c.graph(node(
            "evil", "aten::native_batch_norm.default", ref(m), ref(v), None, None, None, True, 0.1, 1e-5)),
    }
    for name, doc in table.items():
        d = c.store_graph(doc, ref=f"review-{name}")
        with pytest.raises(UnsafeArtifactError, match="breaks its op's argument contract"):
            read_artifact(store, d).check()
    capsys.readouterr()
    assert cli(["verify", "--cache-dir", str(cache)]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"{len(table)} problems")


# ---------------------------------------------------------------- views by contract (contracts/views.py)
def test_as_strided_may_reach_exactly_to_the_end_of_its_storage_and_no_further():
    def view(offset):
        return [("v", aten.as_strided.default, (Ref(0), [2, 2], [1, 4], offset), {})]

    _accepted([([4, 4], F32)], view(10))  # last element: 10 + 1 + 4 = 15, the storage's last
    _refused([([4, 4], F32)], view(11), r"argument 'stride' makes a view of shape \[2, 2\], strides \[1, 4\], "
                                        r"offset 11 that reaches byte 68 of a 64-byte storage")
    _accepted([([4, 4], F32)], [("v", aten.as_strided.default, (Ref(0), [0, 3], [1 << 40, 1], 16), {})])  # empty
    _refused([([4, 4], F32)], [("v", aten.as_strided.default, (Ref(0), [2], [-1], 3), {})], "must hold values in")


def test_as_strided_of_a_view_measures_against_the_whole_storage():
    """``storage_offset`` is absolute: a view of a narrowed input may reach its storage's start."""
    narrow = ("n", aten.narrow.default, (Ref(0), 0, 2, 2), {})
    _accepted([([4, 4], F32)], [narrow, ("v", aten.as_strided.default, (Ref(1), [16], [1], 0), {})])
    _refused([([4, 4], F32)], [narrow, ("v", aten.as_strided.default, (Ref(1), [16], [1]), {})],
             "reaches byte 96 of a 64-byte storage")  # default offset: the view's own (8)


@pytest.mark.parametrize("shape,dtype,ok", [([3, 4, 2], F32, True), ([3, 2], "float64", True),
                                            ([3, 2], "float16", True), ([3, 3], F32, False),
                                            ([3, 2], "bfloat16", False), ([3, 2], "int64", False)])
def test_view_as_complex_needs_pairs_of_a_complex_dtypes_parts(shape, dtype, ok):
    call = [("c", aten.view_as_complex.default, (Ref(0),), {})]
    if ok:
        _accepted([(shape, dtype)], call)
    else:
        _refused([(shape, dtype)], call, "argument 'self'")


def test_view_as_complex_needs_stride_1_pairs_on_even_offsets():
    transposed = ("t", aten.t.default, (Ref(0),), {})  # [2, 3] -> [3, 2] with strides [1, 3]
    _refused([([2, 3], F32)], [transposed, ("c", aten.view_as_complex.default, (Ref(1),), {})],
             "its last dimension must have stride 1")
    shifted = ("s", aten.narrow.default, (Ref(0), 0, 1, 2), {})  # offset 2 elements of a [3, 2]: even, fine
    _accepted([([3, 2], F32)], [shifted, ("c", aten.view_as_complex.default, (Ref(1),), {})])
    odd = ("o", aten.as_strided.default, (Ref(0), [2, 2], [2, 1], 1), {})
    _refused([([3, 2], F32)], [odd, ("c", aten.view_as_complex.default, (Ref(1),), {})], "offset 1, which must be even")


def test_view_as_real_refuses_a_lazily_conjugated_view():
    conj = ("j", aten._conj.default, (Ref(0),), {})
    _refused([([3], "complex64")], [conj, ("r", aten.view_as_real.default, (Ref(1),), {})], "lazily conjugated")
    _accepted([([3], "complex64")], [("r", aten.view_as_real.default, (Ref(0),), {})])
    _refused([([3], F32)], [("j", aten._conj.default, (Ref(0),), {})], "must be complex32, complex64 or complex128")


def test_polar_takes_one_float_dtype_and_broadcasts():
    call = [("p", aten.polar.default, (Ref(0), Ref(1)), {})]
    _accepted([([3, 1], F32), ([4], F32)], call)
    _refused([([3], F32), ([3], "float64")], call, "must be abs's torch.float32")
    _refused([([3], F32), ([4], F32)], call, "does not broadcast")


@pytest.mark.parametrize("op,args", [(aten.unbind.int, (0,)), (aten.split.Tensor, (1,)), (aten.chunk.default, (1 << 20,))])
def test_splitting_ops_make_a_bounded_number_of_views(op, args):
    """A stride-0 view of a huge size costs nothing to describe; unbinding it would make
    millions of tensors (unbounded work at load and at every step)."""
    huge = ("e", aten.expand.default, (Ref(0), [1 << 20, 4]), {})
    _refused([([1, 4], F32)], [huge, ("u", op, (Ref(1), *args), {})], "more than 65536")
    small = (3,) if op is aten.chunk.default else args
    _accepted([([3, 4], F32)], [("u", op, (Ref(0), *small), {})])


def test_inplace_geometry_ops_are_rewritten_to_their_views():
    from spmd_aot.errors import SpmdAotError
    from spmd_aot.passes import rewrite_inplace_views

    def traced(fn, *shapes):
        from torch.fx.experimental.proxy_tensor import make_fx
        return make_fx(fn)(*[torch.randn(s) for s in shapes])

    def fn(x):
        y = x * 2
        before = y + 1  # reads y's old geometry
        y.transpose_(0, 1)
        return before, y + 0, y.as_strided_([2], [1], 1) * 3, y

    gm = traced(fn, (2, 3))
    x = torch.randn(2, 3)
    expected = fn(x.clone())
    assert rewrite_inplace_views(gm) == 2
    gm.recompile()
    assert not [n for n in gm.graph.nodes if str(n.target).endswith("_.default")]
    for a, b in zip(expected, gm(x.clone())):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    with pytest.raises(SpmdAotError, match=r"on the step's input .*x = x.transpose\(0, 1\)"):
        rewrite_inplace_views(traced(lambda x: x.t_() * 1, (2, 3)))


def test_a_bias_gradient_without_the_weights_is_refused_where_cpu_would_return_it_anyway():
    """``convolution_backward`` with ``output_mask`` [*, False, True]: CPU's oneDNN path (fp32,
    bf16) returns the weight's gradient too where the meta kernel returns none, so the check's
    metadata would not describe the value; every other mask is admitted."""
    layout = [([1, 6, 6, 6], F32), ([1, 4, 6, 6], F32), ([6, 2, 3, 3], F32)]
    conv = (aten.convolution_backward.default, ([6], [1, 1], [1, 1], [1, 1], False, [0, 0], 2))

    def call(mask):
        return [("bw", conv[0], (Ref(0), Ref(1), Ref(2), *conv[1], mask), {})]
    for mask in ([True, False, True], [False, False, True]):
        _refused(layout, call(mask), "output_mask.*a bias gradient needs the weight's too")
    for mask in ([True, True, True], [True, True, False], [False, True, True], [True, False, False]):
        _accepted(layout, call(mask))


def test_eval_mode_batch_norm_needs_running_statistics_and_its_backward_may_get_empty_saved_ones():
    """Without running statistics, eval-mode batch norm (forward and backward) reads them through
    null pointers on CPU (SIGSEGV): refused. The backward with ``train=False`` reads no saved
    statistics, which CPU's eval-mode forward returns empty: ``[0]`` admitted there, not in training."""
    x, c = ([4, 3, 5], F32), ([3], F32)
    _refused([x, c, c], [("bn", aten.native_batch_norm.default, (Ref(0), Ref(1), Ref(2), None, None, False, 0.1,
                                                                 1e-5), {})], "running_mean.*must be given in eval mode")
    _refused([x, c, c], [("bn", aten._native_batch_norm_legit.no_stats, (Ref(0), Ref(1), Ref(2), False, 0.1, 1e-5),
                          {})], "training.*must be True")
    empty = ([0], F32)
    backward = aten.native_batch_norm_backward.default
    _accepted([x, x, c, c, c, empty, empty], [("bw", backward, (*(Ref(i) for i in range(7)), False, 1e-5,
                                                                 [True, True, True]), {})])
    _refused([x, x, c, c, c, empty, empty], [("bw", backward, (*(Ref(i) for i in range(7)), True, 1e-5,
                                                               [True, True, True]), {})], "save_mean")
    _refused([x, x, c, c, c], [("bw", backward, (*(Ref(i) for i in range(3)), None, None, Ref(3), Ref(4), False,
                                                 1e-5, [True, True, True]), {})], "running_mean.*eval mode")


_TRUNC_DIVISION = r"""
import sys, torch
from spmd_aot.format.serialize import DecodedNode, Ref
from spmd_aot.interpreter.program import Program

aten, low = torch.ops.aten, -(1 << 63)
folded = sys.argv[1] == "folded"
nodes = [DecodedNode("placeholder", "x0", "x0", (), {}), DecodedNode("placeholder", "x1", "x1", (), {})]
if folded:  # no input involved: computed once, at load
    nodes.append(DecodedNode("call_function", "n", aten.full.default, ([3], low), {"dtype": torch.int64}))
    nodes.append(DecodedNode("call_function", "q", aten.div.Scalar_mode, (Ref(2), -1), {"rounding_mode": "trunc"}))
else:
    nodes.append(DecodedNode("call_function", "q", aten.div.Tensor_mode, (Ref(0), Ref(1)), {"rounding_mode": "trunc"}))
nodes.append(DecodedNode("output", "output", "output", ([Ref(len(nodes) - 1)],), {}))
program = Program(nodes, {}, fold=folded)
try:
    program(torch.full((3,), low), torch.full((3,), -1))
except ArithmeticError as exc:
    print("REFUSED", exc)
    sys.exit(0)
print("RAN")
"""


@pytest.mark.parametrize("where", ["step", "folded"])
def test_trunc_division_of_int_min_by_minus_one_is_refused_not_a_sigfpe(where, tmp_path):
    """x86's ``idiv`` traps on INT_MIN / -1 (SIGFPE), which CPU's trunc division runs for int64 and
    int32: the value check refuses it right before the call, in a step or while a constant is
    folded at load (folding leaves it to the step, which raises). In a child: a trap would end it."""
    import subprocess
    import sys

    script = tmp_path / "divide.py"
    script.write_text(_TRUNC_DIVISION)
    done = subprocess.run([sys.executable, str(script), where], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("REFUSED div(rounding_mode='trunc')"), done.stdout
