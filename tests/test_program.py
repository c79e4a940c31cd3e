"""The Program interpreter: folded constants are exact and never shared where a step could see
them change, unpacked multi-output items are freed, and results equal the traced function's."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_aot.runtime.program import Program
from spmd_aot.format.serialize import decode_graph, encode_graph

CPU = torch.device("cpu")


def _program(fn, *example, fold=True):
    gm = make_fx(fn)(*example)
    constants = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return Program(decode_graph(encode_graph(gm.graph, {}), groups=[], device=CPU), constants, fold=fold)


def _step(x):
    mask = torch.ones(4, 4).tril().bool()          # depends on no input: folded
    acc = torch.zeros(4)                           # written in place below: must stay per step
    acc.add_(x.sum(0))
    positions = torch.arange(4)                    # returned: must stay per step
    top, idx = torch.topk(x, 2)                    # a multi-output op, items unpacked
    return x.masked_fill(~mask, 0.0) @ x, acc, positions, top, idx


def test_folded_program_matches_the_function_and_keeps_per_step_values_fresh():
    x = torch.randn(4, 4)
    program = _program(_step, x)
    assert program.n_folded >= 3  # ones, tril, bool (and the inverted mask)
    first = program(x)
    second = program(x)
    for got, want in zip(first, _step(x)):
        assert torch.equal(got, want)
    assert torch.equal(second[1], first[1])  # the in-place accumulator did not carry over
    assert second[2] is not first[2]  # a returned value is never a shared constant
    first[2].add_(100)  # a caller writing into what it got back changes nothing later
    assert torch.equal(program(x)[2], torch.arange(4))


def test_folding_on_and_off_give_identical_results():
    x = torch.randn(4, 4)
    on, off = _program(_step, x), _program(_step, x, fold=False)
    assert off.n_folded == 0 and on.n_folded > 0
    for a, b in zip(on(x), off(x)):
        assert torch.equal(a, b)


def test_a_view_of_a_folded_value_written_in_place_is_not_folded():
    def step(x):
        base = torch.zeros(8)
        view = base.view(2, 4)       # foldable on its own, but written below
        view.add_(x)
        return base * 2

    x = torch.randn(2, 4)
    program = _program(step, x)
    a, b = program(x), program(x)
    assert torch.equal(a, b) and torch.equal(a, step(x))


def test_huge_input_independent_values_are_left_to_the_step():
    def step(x):
        big = torch.ones(5_000_000)  # 20 MB: over the per-value cap
        return x + big[:4]

    program = _program(step, torch.randn(4))
    assert program.n_folded == 0 or all(
        not isinstance(v, torch.Tensor) or v.numel() < 5_000_000 for v in program._template)
    assert torch.equal(program(torch.zeros(4)), torch.ones(4))


def test_repeated_input_independent_nodes_share_one_folded_value():
    """Each layer's causal mask is the same ops on the same arguments: folded once, shared."""
    def step(x):
        out = x
        for _ in range(3):
            mask = torch.ones(4, 4).tril().bool()
            out = out.masked_fill(~mask, 0.0) @ x
        return out

    x = torch.randn(4, 4)
    program = _program(step, x)
    shared = [v for v in program._template if isinstance(v, torch.Tensor) and v.dtype == torch.bool]
    assert program.n_folded >= 9 and len({id(v) for v in shared}) == 2  # the mask and its inverse
    assert torch.equal(program(x), step(x))
    assert torch.equal(program(x), _program(step, x, fold=False)(x))


def test_a_repeat_written_in_place_unfolds_the_value_it_repeats_too():
    """Sharing must not let one node's in-place write reach another node's constant."""
    def step(x):
        a = torch.zeros(4)       # folded alone
        b = torch.zeros(4)       # a repeat of a, written below: neither may stay shared
        b.add_(x)
        return a + 1, b

    x = torch.randn(4)
    program = _program(step, x)
    first, second = program(x), program(x)
    assert torch.equal(first[0], torch.ones(4)) and torch.equal(second[0], torch.ones(4))
    assert torch.equal(second[1], x)  # b started from zeros again
