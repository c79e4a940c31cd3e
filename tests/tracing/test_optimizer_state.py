"""Optimizer state created before the first compiled step: one dry step per (param group,
dtype) on a meta stand-in gives every parameter exactly the entries eager's first step creates."""

import pytest
import torch

from spmd_aot.state import _dry_step_every_param, _probed_state, initialize_optimizer_state

OPTIMIZERS = [
    (torch.optim.AdamW, {}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.SGD, {"momentum": 0.9}),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}), (torch.optim.Adamax, {}),
    (torch.optim.RAdam, {}), (torch.optim.Adadelta, {}), (torch.optim.Adam, {"foreach": False}),
    (torch.optim.Adafactor, {}),
]


def _params():
    torch.manual_seed(0)
    shapes_dtypes = [((3, 4), torch.float32), ((4,), torch.float32), ((), torch.float32),
                     ((2, 3), torch.float64), ((5, 1, 2), torch.float64)]
    return [torch.nn.Parameter(torch.randn(s, dtype=d)) for s, d in shapes_dtypes]


def _layout(state: dict, params) -> list:
    return [[(k, tuple(v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor) else (k, repr(v))
             for k, v in state[p].items()] for p in params]


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_probed_state_matches_eager_first_step(cls, options):
    params = _params()
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    optim = cls(groups, lr=1e-3, **options)
    initialize_optimizer_state(optim)
    eager_params = _params()
    eager = cls([{"params": eager_params[:3]}, {"params": eager_params[3:], "weight_decay": 0.0}],
                lr=1e-3, **options)
    for p in eager_params:
        p.grad = torch.zeros_like(p)
    eager.step()
    assert _layout(optim.state, params) == _layout(eager.state, eager_params)
    for p in params:  # all zeros, on the parameter's device
        assert all(not torch.any(v) for v in optim.state[p].values() if isinstance(v, torch.Tensor))


def test_probed_state_equals_a_dry_step_on_every_parameter():
    params = _params()
    optim = torch.optim.AdamW(params, lr=1e-3, amsgrad=True)
    probed, full = _probed_state(optim, params), _dry_step_every_param(optim, params)
    assert _layout(probed, params) == _layout(full, params)
    assert not optim.state and all(p.grad is None for p in params)  # the dry steps left nothing behind
    kept = optim.param_groups[0]["params"]
    assert len(kept) == len(params) and all(a is b for a, b in zip(kept, params))


@pytest.mark.parametrize("cls,options", OPTIMIZERS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_frozen_parameters_get_no_state(cls, options):
    """A parameter with requires_grad=False never has a gradient: eager never makes its state."""
    params = _params()
    params[0].requires_grad_(False)
    params[3].requires_grad_(False)
    optim = cls(params, lr=1e-3, **options)
    initialize_optimizer_state(optim)
    assert [i for i, p in enumerate(params) if p in optim.state] == [1, 2, 4]
