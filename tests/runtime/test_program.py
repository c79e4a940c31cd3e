"""The Program interpreter: folded constants are exact and never shared where a step could see
them change, unpacked multi-output items are freed, and results equal the traced function's."""

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_aot.errors import CorruptArtifactError
from spmd_aot.interpreter.invariants import DivergedValueError
from spmd_aot.interpreter.program import Program
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


# ------------------------------------------------------------------ run-time invariants
# Ops whose CPU results differ from their meta results (shape or dtype). The load's check derives
# what CPU returns for each (format/device_results.py), so these graphs run; were that model of
# the kernel wrong (here: switched off), a crafted graph that reads such a value would run ops
# whose contracts were checked on the other value, and the program stops at the producer with a
# typed error instead (interpreter/invariants.py).
aten = torch.ops.aten
C = 3


def _bn(g, x, w, b, rm, rv):  # saved mean [C] on meta, [0] on CPU
    return g.call_function(operator.getitem, (g.call_function(
        aten._native_batch_norm_legit_no_training.default, (x, w, b, rm, rv, 0.1, 1e-5)), 1))


def _bn_eval(g, x, w, b, rm, rv):
    return g.call_function(operator.getitem, (g.call_function(
        aten.native_batch_norm.default, (x, w, b, rm, rv, False, 0.1, 1e-5)), 2))


_BN_INPUTS = ([2, C, 4], [C], [C], [C], [C])
DIVERGENT = {
    "batch_norm_no_training": (_bn, _BN_INPUTS, "float32"),
    "native_batch_norm_eval": (_bn_eval, _BN_INPUTS, "float32"),
    "embedding_bag_offset2bag": (lambda g, w, i, o: g.call_function(operator.getitem, (g.call_function(
        aten._embedding_bag.default, (w, i, o, False, 0)), 1)), ([10, 4], [4], [2]), ("float32", "int64", "int64")),
    "mse_loss_backward_dtype": (lambda g, a, b, c: g.call_function(aten.mse_loss_backward.default, (a, b, c, 1)),
                                ([4], [4], [4]), ("float32", "float32", "float64")),
    "threshold_backward_dtype": (lambda g, a, b: g.call_function(aten.threshold_backward.default, (a, b, 0.0)),
                                 ([4], [4]), ("float32", "float64")),
    "native_dropout_empty": (lambda g, x: g.call_function(operator.getitem, (g.call_function(
        aten.native_dropout.default, (x, 0.5, True)), 1)), ([0],), ("float32",)),
}


def _real(shape, dtype):
    if dtype == "int64":
        return torch.tensor([1, 2, 3, 4][:shape[0]]) if shape != [2] else torch.tensor([0, 2])
    return torch.rand(shape, dtype=getattr(torch, dtype))


def _checked_program(build, shapes, dtypes, read=lambda g, v: g.call_function(aten.cat.default, ([v, v],))):
    """A hand-made graph: ``build``'s value, read by ``read``; meta-checked as a load checks it;
    the program with its run-time invariants; real inputs."""
    from spmd_aot.format.validate import check_graph
    from spmd_aot.interpreter.invariants import describe

    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,) * len(shapes)
    g = torch.fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(len(shapes))]
    value = build(g, *xs)
    g.output(read(g, value))
    nodes = decode_graph(encode_graph(g, {}), groups=[], device=CPU)
    layout = [{"local_shape": list(s), "dtype": d} for s, d in zip(shapes, dtypes)]
    metas = check_graph(nodes, {}, layout, device_type="cpu")
    return Program(nodes, {}, expected=[describe(m) for m in metas]), [_real(s, d) for s, d in zip(shapes, dtypes)]


@pytest.fixture
def without_device_corrections(monkeypatch):
    """The load's check as if it knew nothing of CPU's kernels: the meta results, uncorrected."""
    from spmd_aot.format import device_results

    monkeypatch.setitem(device_results.RULES, "cpu", {})


@pytest.mark.parametrize("case", sorted(DIVERGENT))
def test_a_divergent_op_is_checked_as_cpu_computes_it(case):
    """Each op whose CPU result differs from its meta result: the check derives CPU's metadata,
    so a graph reading the value runs, with the invariants on, and returns what eager returns."""
    program, inputs = _checked_program(*DIVERGENT[case])
    build, shapes, dtypes = DIVERGENT[case]
    g = torch.fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(len(shapes))]
    g.output(g.call_function(aten.cat.default, ([build(g, *xs)] * 2,)))
    eager = torch.fx.GraphModule(torch.nn.Module(), g)(*inputs)
    got = program(*inputs)
    assert got.shape == eager.shape and got.dtype == eager.dtype


@pytest.mark.parametrize("case", sorted(DIVERGENT))
def test_a_value_whose_cpu_metadata_differs_from_meta_is_refused_before_it_is_read(case, without_device_corrections):
    program, inputs = _checked_program(*DIVERGENT[case])
    with pytest.raises(DivergedValueError, match=r"node \d+ .*load's meta check derived") as info:
        program(*inputs)
    assert isinstance(info.value, CorruptArtifactError)
    assert "remove the entry" in str(info.value)


_NORM_OPS = {"layer_norm": aten.native_layer_norm.default, "group_norm": aten.native_group_norm.default}


def _norm_args(op, x, w, b):
    return (x, [3], w, b, 1e-5) if op == "layer_norm" else (x, w, b, 2, 4, 3, 2, 1e-5)


@pytest.mark.parametrize("op", sorted(_NORM_OPS))
@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "float32"), ("bfloat16", None), ("bfloat16", "bfloat16"),
                                             ("bfloat16", "float32"), ("float16", "float16"), ("float16", "float32")])
def test_norm_statistics_are_checked_as_the_cpu_kernel_makes_them(op, x_dtype, w_dtype):
    """CPU layer and group norm keep their saved statistics in the input's dtype, or fp32 when a
    reduced-precision input meets an fp32 weight, where torch's meta kernels say fp32 (layer norm)
    or the input's dtype (group norm): the check follows the CPU kernel (``device_results.py``),
    so bf16 and fp16 models run, and what reads the statistics is checked against the real dtype."""
    w_shape = [3] if op == "layer_norm" else [4]
    shapes = [[2, 4, 3]] + ([w_shape, w_shape] if w_dtype else [])
    dtypes = (x_dtype,) + ((w_dtype, w_dtype) if w_dtype else ())
    build = lambda g, *xs: g.call_function(operator.getitem, (g.call_function(  # noqa: E731
        _NORM_OPS[op], _norm_args(op, *xs) if w_dtype else _norm_args(op, xs[0], None, None)), 1))
    program, inputs = _checked_program(build, shapes, dtypes)
    real = _NORM_OPS[op](*(_norm_args(op, *inputs) if w_dtype else _norm_args(op, inputs[0], None, None)))[1]
    assert program(*inputs).dtype == real.dtype


def test_a_divergent_value_nobody_reads_costs_nothing_and_breaks_nothing(without_device_corrections):
    """Eval-mode batch norm's saved statistics ([C] on meta, [0] on CPU) are never read."""
    def read_only_the_input(g, saved_mean):
        return g.call_function(aten.relu.default, (saved_mean.args[0].args[0],))  # relu(x)

    program, inputs = _checked_program(_bn, _BN_INPUTS, "float32", read=read_only_the_input)
    assert program(*inputs).shape == (2, C, 4)


def test_frozen_batch_norm_in_a_training_step_runs():
    """``native_batch_norm_backward(train=False)`` never reads the saved statistics, which are
    [0] on CPU: a model with frozen (eval-mode) batch norm in a training step."""
    bn = torch.nn.BatchNorm1d(C).eval()

    def step(w, x):
        out = torch.nn.functional.batch_norm(x, bn.running_mean, bn.running_var, w, None, False)
        (grad,) = torch.autograd.grad(out.sum(), w)
        return grad

    w, x = torch.ones(C, requires_grad=True), torch.randn(2, C, 4)
    gm = make_fx(step)(w, x)
    constants = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    from spmd_aot.format.validate import check_graph
    from spmd_aot.interpreter.invariants import describe

    nodes = decode_graph(encode_graph(gm.graph, {}), groups=[], device=CPU)
    metas = check_graph(nodes, constants, [{"local_shape": [C], "dtype": "float32"},
                                           {"local_shape": [2, C, 4], "dtype": "float32"}], device_type="cpu")
    program = Program(nodes, constants, expected=[describe(m) for m in metas], fold=False)
    assert program.n_checked > 0
    torch.testing.assert_close(program(w.detach(), x), step(w, x))


_VICTIM = r"""
import operator, sys, torch
sys.path[:0] = [{tests!r}, {here!r}]
from test_program import _checked_program, DIVERGENT, aten
from spmd_aot.interpreter.invariants import DivergedValueError

case = sys.argv[1]
build, shapes, dtypes = DIVERGENT[case]
from spmd_aot.format import device_results
device_results.RULES["cpu"] = {{}}  # the check's model of CPU's kernels wrong: the invariants must hold

def read(g, v):  # the attack: a buffer large on meta and small on CPU, written by a fused step
    big = g.call_function(aten.cat.default, ([v, g.call_function(aten.full.default, ([4096], 1.0))],))
    return g.call_function(aten.add.Tensor, (big, 1.0))

try:
    program, inputs = _checked_program(build, shapes, dtypes, read=read)
except Exception as exc:  # the load's meta check refused the graph: also safe
    print("REFUSED AT LOAD", type(exc).__name__)
    sys.exit(0)
try:
    program(*inputs)
except DivergedValueError as exc:
    print("REFUSED", str(exc)[:120])
    sys.exit(0)
print("RAN")
"""


@pytest.mark.parametrize("case", ["batch_norm_no_training", "embedding_bag_offset2bag", "native_dropout_empty"])
def test_the_crafted_graph_is_refused_in_a_process_under_the_heap_checker(case, tmp_path):
    """The victim runs in a child under glibc's malloc checker (which needs the preload on
    glibc 2.34+): it ends with the typed error and exit 0, no signal, no heap complaint."""
    import os
    import pathlib
    import subprocess
    import sys

    script = tmp_path / "victim.py"
    script.write_text(_VICTIM.format(tests=str(pathlib.Path(__file__).parents[1]), here=str(pathlib.Path(__file__).parent)))
    env = dict(os.environ, MALLOC_CHECK_="3", MALLOC_PERTURB_="165")
    debug = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
    if os.path.exists(debug):
        env["LD_PRELOAD"] = debug
    done = subprocess.run([sys.executable, str(script), case], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("REFUSED "), done.stdout + done.stderr[-2000:]


def test_a_model_with_frozen_batch_norm_trains_from_the_cache_as_eager(tmp_path, monkeypatch):
    """End to end: conv + batch norm in eval mode (frozen statistics) in a training step, built,
    loaded twice (decoded, then rebuilt from its prepared record), equal to eager."""

    import spmd_aot

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2)).eval()

    def step(model, optim, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    batch = (torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 1, 0]))
    job = spmd_aot.Job(step=step, model=make, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                       batch=lambda: batch)
    spmd_aot.build(job, world_size=1, cache_dir=tmp_path / "cache")
    eager = make()
    eager_optim = torch.optim.SGD(eager.parameters(), lr=0.1)
    want = [step(eager, eager_optim, batch).item() for _ in range(3)]
    for _ in range(2):  # the second load rebuilds from the prepared record
        model = make()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = spmd_aot.compile(step, cache_dir=tmp_path / "cache", require_hit=True)
        got = [float(compiled(model, optim, batch)) for _ in range(3)]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        for a, b in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_inputs_are_checked_too_a_slice_passes_an_expanded_tensor_does_not():
    """The induction's base: the meta check laid every input out contiguously. A slice of a
    larger batch (other strides, every element its own) runs; an expanded tensor (stride 0,
    fewer elements than its shape) would make kernels that assume a dense layout read past
    its storage, so the step refuses it."""
    program, _ = _checked_program(lambda g, x: g.call_function(aten.mul.Tensor, (x, 2.0)), ([4, 6],), "float32",
                                  read=lambda g, v: v)
    wide = torch.randn(4, 12)
    torch.testing.assert_close(program(wide[:, :6]), wide[:, :6] * 2)  # strides (12, 1)
    with pytest.raises(DivergedValueError, match=r"step input 0 .*strides \[0, 1\].*x.contiguous\(\)"):
        program(torch.randn(1, 6).expand(4, 6))
    with pytest.raises(TypeError, match="inputs are tensors"):
        program(3)


_FUSED_ADAM_VICTIM = r"""
import operator, sys, torch
from spmd_aot.format.serialize import decode_graph, encode_graph
from spmd_aot.format.validate import check_graph
from spmd_aot.interpreter.invariants import DivergedValueError, describe
from spmd_aot.interpreter.program import Program

aten, C = torch.ops.aten, 4096
g = torch.fx.Graph()
x, w, b, rm, rv, param, grad, sq, step = [g.placeholder(f"x{i}") for i in range(9)]
saved_mean = g.call_function(operator.getitem, (g.call_function(
    aten._native_batch_norm_legit_no_training.default, (x, w, b, rm, rv, 0.1, 1e-5)), 1))  # [C] meta, [0] CPU
exp_avg = g.call_function(aten.cat.default, ([saved_mean, g.call_function(aten.full.default, ([C], 1.0))],))
g.call_function(aten._fused_adam_.default, ([param], [grad], [exp_avg], [sq], [], [step]),
                dict(lr=0.1, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False))
g.output(exp_avg)
shapes = [[2, C, 1], [C], [C], [C], [C], [2 * C], [2 * C], [2 * C], []]
nodes = decode_graph(encode_graph(g, {}), groups=[], device=torch.device("cpu"))
if sys.argv[1] != "checked":  # the check's model of CPU's batch norm switched off: it passes on meta values
    from spmd_aot.format import device_results
    device_results.RULES["cpu"] = {}
try:
    metas = check_graph(nodes, {}, [{"local_shape": s, "dtype": "float32"} for s in shapes], device_type="cpu")
except Exception as exc:
    print("REFUSED AT LOAD", type(exc).__name__, str(exc)[:200])
    sys.exit(0)
expected = [describe(m) for m in metas] if sys.argv[1] != "unchecked" else None
try:
    Program(nodes, {}, expected=expected, fold=False)(*[torch.rand(s) for s in shapes])
except DivergedValueError as exc:
    print("REFUSED", str(exc)[:100])
    sys.exit(0)
print("RAN")
"""


def test_the_fused_adam_write_past_a_short_buffer_is_stopped(tmp_path):
    """The attack in full: a buffer ``[2C]`` on meta and ``[C]`` on CPU (batch norm's saved mean
    catted with C ones) as a fused Adam step's ``exp_avg``, every contract passing on meta. Without
    the run-time expectations the kernel writes 16 KiB past the buffer and glibc aborts the
    process; with them the step stops at the batch norm, exit 0. With the load's check deriving
    what CPU's batch norm returns (``[0]``), the graph is refused at load: Adam's contract sees
    an ``exp_avg`` of C elements beside a parameter of 2C."""
    import os
    import subprocess
    import sys

    script = tmp_path / "victim.py"
    script.write_text(_FUSED_ADAM_VICTIM)
    env = dict(os.environ, MALLOC_CHECK_="3")
    debug = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
    if os.path.exists(debug):
        env["LD_PRELOAD"] = debug
    checked = subprocess.run([sys.executable, str(script), "checked"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith("REFUSED AT LOAD UnsafeArtifactError") and "exp_avgs[0]" in checked.stdout
    uncorrected = subprocess.run([sys.executable, str(script), "uncorrected"], env=env, capture_output=True,
                                 text=True, timeout=300)
    assert uncorrected.returncode == 0, uncorrected.stdout + uncorrected.stderr
    assert uncorrected.stdout.startswith("REFUSED node"), uncorrected.stdout + uncorrected.stderr
    unchecked = subprocess.run([sys.executable, str(script), "unchecked"], env=env, capture_output=True,
                               text=True, timeout=300)
    assert unchecked.returncode < 0 or "RAN" not in unchecked.stdout, (unchecked.returncode, unchecked.stdout)
