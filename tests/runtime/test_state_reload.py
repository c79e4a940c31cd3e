"""A compiled step keeps reading what the optimizer holds after a checkpoint is loaded into it,
or after a state tensor is replaced, even though it reuses its input list between steps."""

import copy

import torch

import spmd_aot
from support.jobs import fresh_objects, make_batch
from spmd_aot.examples.models import train_step


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_loading_a_checkpoint_between_compiled_steps_matches_eager(tmp_path):
    step = spmd_aot.compile(train_step, cache_dir=tmp_path)
    model, optim = fresh_objects("transformer", "adamw")
    ref_model, ref_optim = fresh_objects("transformer", "adamw")
    for s in range(2):
        step(model, optim, make_batch("transformer", 0, s))
        train_step(ref_model, ref_optim, make_batch("transformer", 0, s))
    checkpoint = copy.deepcopy((ref_model.state_dict(), ref_optim.state_dict()))
    step(model, optim, make_batch("transformer", 0, 99))  # drift away from the checkpoint
    model.load_state_dict(checkpoint[0])
    optim.load_state_dict(checkpoint[1])  # new state tensors: the step must pick them up
    for s in range(2, 4):
        step(model, optim, make_batch("transformer", 0, s))
        train_step(ref_model, ref_optim, make_batch("transformer", 0, s))
    assert _max_diff(model, ref_model) <= 1e-5
    state, ref_state = optim.state_dict()["state"], ref_optim.state_dict()["state"]
    assert max((state[i][k] - ref_state[i][k]).abs().max().item() for i in ref_state for k in ref_state[i]) <= 1e-5


def test_a_replaced_state_tensor_is_the_one_updated(tmp_path):
    step = spmd_aot.compile(train_step, cache_dir=tmp_path)
    model, optim = fresh_objects("mlp", "sgd")
    step(model, optim, make_batch("mlp", 0, 0))
    p = next(iter(optim.state))
    replacement = optim.state[p]["momentum_buffer"].clone()
    optim.state[p]["momentum_buffer"] = replacement
    before = replacement.clone()
    step(model, optim, make_batch("mlp", 0, 1))
    assert not torch.equal(replacement, before)  # the graph wrote into the new tensor
