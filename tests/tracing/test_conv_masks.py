"""A trainable conv bias beside a frozen conv weight (BitFit-style fine-tuning) builds, loads and
matches eager: the build asks the convolution backward for the weight's gradient too."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import spmd_aot
from spmd_aot.passes import ask_conv_weight_grads


class BiasOnlyConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)
        for conv in (self.conv1, self.conv2):
            conv.weight.requires_grad_(False)  # only the biases (and the head) train

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean((2, 3)))


def _objects():
    torch.manual_seed(0)
    model = BiasOnlyConvNet()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _batch(step=0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def train_step(model, optim, batch):
    x, y = batch
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_the_pass_turns_a_bias_only_mask_into_weight_and_bias():
    from torch.fx.experimental.proxy_tensor import make_fx

    conv = BiasOnlyConvNet().conv2

    def grads(x):
        out = conv(x)
        return torch.autograd.grad(out.sum(), [conv.bias])

    gm = make_fx(grads)(torch.randn(2, 8, 4, 4))
    masks = [n.args[10] for n in gm.graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert masks and all(list(m) == [False, False, True] for m in masks)
    assert ask_conv_weight_grads(gm) == len(masks)
    gm.recompile()
    masks = [n.args[10] for n in gm.graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert all(list(m) == [False, True, True] for m in masks)
    x = torch.randn(2, 8, 4, 4)
    torch.testing.assert_close(gm(x)[0], grads(x)[0])


def test_a_frozen_conv_weight_with_a_trainable_bias_loads_and_matches_eager(tmp_path):
    job = spmd_aot.Job(step=train_step, model=lambda: _objects()[0],
                       optimizer=lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2),
                       batch=_batch)
    spmd_aot.build(job, world_size=1, cache_dir=tmp_path)
    model, optim = _objects()
    eager_model = copy.deepcopy(model)
    eager_optim = torch.optim.AdamW([p for p in eager_model.parameters() if p.requires_grad], lr=1e-2)
    step = spmd_aot.compile(train_step, cache_dir=tmp_path, require_hit=True)
    for s in range(3):
        loss = step(model, optim, _batch(s))
        eager_loss = train_step(eager_model, eager_optim, _batch(s))
        torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=0)
    assert step.cache_info.hit and step.cache_info.traces == 0
    for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)
    assert not torch.equal(model.conv1.bias, _objects()[0].conv1.bias)  # the biases did train
