"""What the load's check derives for CPU (``spmd_aot/format/device_results.py``: the meta result,
corrected where CPU's kernel returns other metadata) against what CPU's kernel really returns,
on every dtype and flag combination of each corrected op: shape and dtype of every result, and
which results are absent. A rule that is wrong here is a value the run-time invariants would
refuse in a real model (or, worse, a contract checked on metadata the real value lacks)."""

from __future__ import annotations

import itertools

import pytest
import torch

from spmd_aot.format.device_results import RULES, corrected

aten = torch.ops.aten
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _describe(value):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    return [_describe(v) for v in value]


def _meta(v):
    if isinstance(v, torch.Tensor):  # the same strides: ``to("meta")`` would make a wide view dense
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_meta(x) for x in v)
    return v


def _agree(op, args, kwargs=None) -> tuple:
    """(what the check derives for CPU, what CPU returns), or None when CPU's kernel refuses."""
    kwargs = kwargs or {}
    try:
        real = op(*args, **kwargs)
    except (RuntimeError, ValueError, IndexError, TypeError):
        return None
    margs, mkwargs = _meta(args), _meta(kwargs)
    derived = corrected("cpu", op, margs, mkwargs, op(*margs, **mkwargs))
    return _describe(derived), _describe(real)


def _check_all(cases) -> int:
    ran, wrong = 0, []
    for label, op, args, kwargs in cases:
        pair = _agree(op, args, kwargs)
        if pair is None:
            continue
        ran += 1
        if pair[0] != pair[1]:
            wrong.append((label, pair))
    assert not wrong, wrong[:10]
    return ran


def test_every_rule_is_tested_here():
    tested = {aten.native_layer_norm.default, aten.native_group_norm.default,  # tests/runtime/test_program.py
              aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
              aten._native_batch_norm_legit.no_stats, aten._native_batch_norm_legit_no_training.default,
              aten.native_batch_norm_backward.default,
              aten._embedding_bag.default, aten.threshold_backward.default, aten.native_dropout_backward.default,
              aten.mse_loss_backward.default, aten.native_dropout.default,
              aten.convolution.default, aten.convolution_backward.default}
    assert set(RULES["cpu"]) == tested
    assert set(RULES["cuda"]) == {aten.log_sigmoid_forward.default}


def _bn_cases():
    for x_dtype, p_dtype, shape, training, with_params, with_running in itertools.product(
            FLOATS, FLOATS, [(4, 3, 5), (4, 3), (0, 3, 5)], (True, False), (True, False),
            (True, False)):
        x = torch.randn(shape).to(x_dtype)
        w = b = torch.rand(3).to(p_dtype) if with_params else None
        rm, rv = (torch.randn(3).to(p_dtype), torch.rand(3).to(p_dtype)) if with_running else (None, None)
        label = (str(x_dtype), str(p_dtype), shape, training, with_params, with_running)
        if with_running or training:  # eval mode without running statistics is refused by the contract
            yield label, aten.native_batch_norm.default, (x, w, b, rm, rv, training, 0.1, 1e-5), {}
            yield label, aten._native_batch_norm_legit.default, (x, w, b, rm, rv, training, 0.1, 1e-5), {}
        if with_running:
            yield label, aten._native_batch_norm_legit_no_training.default, (x, w, b, rm, rv, 0.1, 1e-5), {}
        if training:
            yield label, aten._native_batch_norm_legit.no_stats, (x, w, b, True, 0.1, 1e-5), {}


def test_batch_norm_saved_statistics_as_cpu_returns_them():
    """[C] when training, [0] in eval mode, in the parameters' dtype (fp32 beside any fp32 weight,
    bias or running statistic; else the input's): meta says [C] in fp32 throughout."""
    assert _check_all(_bn_cases()) > 300


def test_batch_norm_backward_returns_only_the_gradients_its_mask_asks_for():
    cases = []
    for dtype, train, with_weight, mask in itertools.product(FLOATS, (True, False), (True, False),
                                                             itertools.product((True, False), repeat=3)):
        x, g = torch.randn(4, 3, 5).to(dtype), torch.randn(4, 3, 5).to(dtype)
        w = torch.rand(3).to(dtype) if with_weight else None
        stats = [torch.rand(3).to(dtype) for _ in range(4)]
        if not train:
            stats[2:] = [torch.empty(0, dtype=dtype)] * 2  # eval mode's saved statistics, as CPU makes them
        cases.append(((str(dtype), train, with_weight, mask), aten.native_batch_norm_backward.default,
                      (g, x, w, *stats, train, 1e-5, list(mask)), {}))
    assert _check_all(cases) > 100


def _embedding_bag_cases():
    for dtype, index_dtype, mode, per_sample, last, padding_idx, layout, (n_idx, n_off), grad in itertools.product(
            FLOATS, (torch.int64, torch.int32), (0, 1, 2), (False, True, "strided"), (False, True), (-1, 3, None),
            ("contiguous", "transposed", "expanded", "wide"), ((6, 2), (0, 2), (6, 3), (6, 1), (1, 2)), (False, True)):
        if per_sample and mode != 0 or n_off < 1 + last:
            continue  # per-sample weights are sum-only; no bag at all is refused by the contract
        w = {"contiguous": lambda: torch.randn(10, 4), "transposed": lambda: torch.randn(4, 10).t(),
             "expanded": lambda: torch.randn(1, 4).expand(10, 4),
             "wide": lambda: torch.randn(10, 8)[:, ::2]}[layout]().to(dtype).requires_grad_(grad)
        idx = torch.randint(0, 10, (n_idx,), dtype=index_dtype)
        off = torch.tensor([0, 2, 4][:n_off], dtype=index_dtype).clamp(max=n_idx)
        psw = None if not per_sample else torch.rand(n_idx).to(dtype) if per_sample is True else \
            torch.rand(2 * n_idx).to(dtype)[::2]
        args = (w, idx, off, False, mode, False, psw, last, padding_idx)
        yield (str(dtype), str(index_dtype), mode, per_sample, last, padding_idx, layout, n_idx, n_off, grad), \
            aten._embedding_bag.default, args, {}


def test_embedding_bag_outputs_as_cpu_returns_them():
    """offset2bag empty on sum mode's fast path, bag_size one value per bag, max_indices [bags, D]
    in max mode else [bags], whether or not the weight requires grad: meta describes CUDA's kernel."""
    assert _check_all(_embedding_bag_cases()) > 1000


_ELEMENTWISE_DTYPES = FLOATS + (torch.int64, torch.int32, torch.bool, torch.uint8)


def test_threshold_backward_computes_in_the_promoted_dtype():
    cases = [((str(g), str(s), t), aten.threshold_backward.default,
              (torch.ones(3, 4, dtype=g), torch.ones(shape, dtype=s), t), {})
             for g, s, t, shape in itertools.product(_ELEMENTWISE_DTYPES, _ELEMENTWISE_DTYPES, (0, 0.5), ((3, 4), (4,)))]
    assert _check_all(cases) > 100


def test_native_dropout_backward_computes_in_the_promoted_dtype():
    cases = [((str(g), str(m), shape), aten.native_dropout_backward.default,
              (torch.ones(shape, dtype=g), torch.ones(shape, dtype=m), 2.0), {})
             for g, m, shape in itertools.product(_ELEMENTWISE_DTYPES, _ELEMENTWISE_DTYPES, ((3, 4), (0, 4)))]
    assert _check_all(cases) > 50


def test_mse_loss_backward_returns_selfs_dtype():
    cases = []
    for g, s, t, reduction, shapes in itertools.product(FLOATS, FLOATS, FLOATS, (0, 1, 2),
                                                        (((3, 4), (3, 4)), ((3, 4), (4,)), ((4,), (3, 4)))):
        grad = torch.ones(() if reduction else shapes[0], dtype=g)
        if reduction == 0 and shapes[0] != shapes[1]:
            grad = torch.ones(torch.broadcast_shapes(*shapes), dtype=g)
        cases.append(((str(g), str(s), str(t), reduction, shapes), aten.mse_loss_backward.default,
                      (grad, torch.ones(shapes[0], dtype=s), torch.ones(shapes[1], dtype=t), reduction), {}))
    assert _check_all(cases) > 100


def test_native_dropout_on_an_empty_input_returns_a_mask_of_its_dtype():
    cases = [((str(d), shape, p, train), aten.native_dropout.default, (torch.ones(shape, dtype=d), p, train), {})
             for d, shape, p, train in itertools.product(FLOATS, ((3, 4), (0, 4), (), (2, 0)), (0.0, 0.5, 1.0),
                                                         (True, False, None))]
    assert _check_all(cases) > 100


@pytest.mark.parametrize("op", [aten.relu.default, aten.mm.default])
def test_ops_without_a_rule_are_left_as_meta_says(op):
    value = torch.empty(3, 4, device="meta")
    assert corrected("cpu", op, (), {}, value) is value
    assert corrected("cuda", aten.native_batch_norm.default, (), {}, value) is value


def _conv_cases():
    """Inputs contiguous, channels-last, and channels-last by a transposed sequence (Segformer's
    ``transpose(1, 2).view(...)``), depthwise and dense, 1-d and 2-d, with and without bias."""
    for dims, groups, layout, bias in itertools.product((1, 2), (1, 8), ("contiguous", "channels_last", "seq"),
                                                        (True, False)):
        spatial = (4, 4) if dims == 2 else (16,)
        if layout == "seq":
            x = torch.randn(2, 16, 8).transpose(1, 2).view(2, 8, *spatial)
        else:
            x = torch.randn(2, 8, *spatial)
            if layout == "channels_last" and dims == 2:
                x = x.to(memory_format=torch.channels_last)
        w = torch.randn(8, 8 // groups, *(3,) * dims)
        b = torch.randn(8) if bias else None
        rest = ([1] * dims, [1] * dims, [1] * dims, False, [0] * dims, groups)
        yield (dims, groups, layout, bias), x, w, b, rest


def _strides(value):
    return [None if v is None else (tuple(v.shape), v.stride()) for v in (value if isinstance(value, tuple) else (value,))]


def test_convolution_results_have_the_strides_cpu_returns():
    """oneDNN returns a channels-last result for a channels-last input (meta: contiguous); the
    sequence view of a depthwise convolution's output fits only those strides."""
    wrong, ran = [], 0
    for label, x, w, b, rest in _conv_cases():
        real = aten.convolution.default(x, w, b, *rest)
        derived = corrected("cpu", aten.convolution.default, _meta((x, w, b, *rest)), {},
                            aten.convolution.default(*_meta((x, w, b, *rest))))
        g = torch.randn_like(real)
        sizes = [8] if b is not None else None
        real_bw = aten.convolution_backward.default(g, x, w, sizes, *rest, [True, True, b is not None])
        margs = _meta((g, x, w, sizes, *rest, [True, True, b is not None]))
        derived_bw = corrected("cpu", aten.convolution_backward.default, margs, {},
                               aten.convolution_backward.default(*margs))
        ran += 1
        if _strides(derived) != _strides(real) or _strides(derived_bw) != _strides(real_bw):
            wrong.append((label, _strides(derived), _strides(real), _strides(derived_bw), _strides(real_bw)))
    assert ran == 24 and not wrong, wrong[:4]


def test_cuda_log_sigmoid_forward_returns_an_empty_buffer():
    """CUDA's kernel leaves ``buffer`` empty (its backward does not read it); meta: self's shape."""
    x = torch.empty(3, 4, device="meta")
    out, buffer = corrected("cuda", aten.log_sigmoid_forward.default, (x,), {}, aten.log_sigmoid_forward.default(x))
    assert tuple(out.shape) == (3, 4) and tuple(buffer.shape) == (0,)
    assert _describe(corrected("cpu", aten.log_sigmoid_forward.default, (x,), {},
                               aten.log_sigmoid_forward.default(x))) == [((3, 4), torch.float32)] * 2
