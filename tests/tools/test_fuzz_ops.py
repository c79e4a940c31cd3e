"""The adversarial op fuzzer's CI slice (tools/fuzz/fuzz_ops.py): every 3rd admitted overload plus the
review's crash ops, every mutation; whatever the load-time check accepts runs for real in a
child process and must not crash. The full run is ``python tools/fuzz/fuzz_ops.py``."""

from __future__ import annotations

import fuzz_ops  # a tool: pytest puts tools/ on sys.path (pyproject.toml)


def test_fuzz_slice_accepts_no_crashing_or_diverging_case():
    ops = fuzz_ops.allowed_ops()
    chosen = sorted(set(ops[::3]) | (set(fuzz_ops.REVIEW_OPS) & set(ops)))
    r = fuzz_ops.fuzz(chosen, timeout=30.0)
    print(f"\nfuzz slice: {r['ops']} ops, {r['tried']} argument sets, {r['refused']} refused, {r['run']} run, "
          f"{len(r['crashes'])} crashes, {len(r['divergences'])} meta/CPU divergences")
    assert r["crashes"] == [] and r["divergences"] == []
    assert r["refused"] > 0 and r["run"] > 0
    assert r["run_ok"] > 4 * r["run_raised"]  # cases really ran (a recipe the child cannot read only raises)


def test_the_review_crash_cases_are_refused_by_the_check():
    """Each review case, as a fuzz case: refused before anything runs."""
    t, limit = fuzz_ops.t, 16 << 20
    adam = dict(fuzz_ops.ADAM)
    cases = {
        "aten::_fused_adam_.default": ([[t(100000)], [t(100000)], [t(1)], [t(1)], [], [t()]], adam),
        "aten::_fused_adamw_.default": ([[t(4096, stride=(0,))], [t(4096)], [t(4096)], [t(4096)], [], [t()]], adam),
        "aten::native_layer_norm_backward.default": ((t(4, 8), t(4, 8), [8], t(1), t(1), t(8), t(8), [True] * 3), {}),
        "aten::native_batch_norm.default": ((t(4, 1000, 8), t(1), t(1), t(1000), t(1000), True, 0.1, 1e-5), {}),
        "aten::max_pool2d_with_indices_backward.default": (
            (t(1, 1, 2, 2), t(1, 1, 4, 4), [2, 2], [2, 2], [0, 0], [1, 1], False, t(1, 1, 1, 1, dtype="int64")), {}),
        "aten::embedding_dense_backward.default": ((t(3, 4), t(5, dtype="int64"), 10, -1, True), {}),
    }
    for name, (args, kwargs) in cases.items():
        assert fuzz_ops.check(name, args, kwargs, limit) is not None, name


def test_every_allowed_op_gets_a_valid_sample():
    """A sample the check refuses would leave its op unfuzzed (and mean the contract refuses real graphs)."""
    from spmd_aot.format.serialize import resolve_target

    refused = {}
    for name in fuzz_ops.allowed_ops():
        for args, kwargs in fuzz_ops.samples(name, resolve_target(name)):
            why = fuzz_ops.check(name, args, kwargs, 16 << 20)
            if why is not None:
                refused[name] = why
    assert refused == {}


def test_a_spent_budget_runs_nothing_and_says_how_much():
    """``--budget-seconds``: no child starts after the deadline; the cases left are counted."""
    import time

    r = fuzz_ops.fuzz(["aten::add.Tensor"], deadline=time.monotonic() - 1)
    assert r["run"] > 0 and r["not_run"] == r["run"]
    assert r["run_ok"] == r["run_raised"] == 0 and r["crashes"] == []


def test_cuda_faults_are_told_from_argument_errors():
    """On ``--device cuda`` a fault of the device ends the child (a crash); a refusal does not."""
    assert fuzz_ops._is_cuda_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert fuzz_ops._is_cuda_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert not fuzz_ops._is_cuda_fault(RuntimeError("index 7 is out of bounds for dimension 0 with size 3"))
    assert not fuzz_ops._is_cuda_fault(ValueError("Expected all tensors to be on the same device"))


def test_children_run_with_the_heap_checker_really_loaded():
    """glibc 2.36 ignores MALLOC_CHECK_ unless libc_malloc_debug is preloaded: the children's
    environment preloads it, and a child without it refuses to run (the fuzz run fails)."""
    import subprocess
    import sys

    probe = "import sys, fuzz_ops; sys.exit(0 if fuzz_ops.checker_loaded() else 1)"
    base = dict(__import__("os").environ, PYTHONPATH=fuzz_ops.os.path.dirname(fuzz_ops.__file__))
    base.pop("LD_PRELOAD", None)
    base.pop("MALLOC_CHECK_", None)
    assert subprocess.run([sys.executable, "-c", probe], env=fuzz_ops.checker_env(base)).returncode == 0
    assert subprocess.run([sys.executable, "-c", probe], env=dict(base, MALLOC_CHECK_="3")).returncode == 1


def test_the_heap_checker_catches_one_byte_past_a_tensors_storage():
    """Whether ``MALLOC_CHECK_`` alone also catches it depends on the machine's glibc (before 2.34
    it does), so only the children's environment is asserted on."""
    import os

    base = dict(os.environ)
    base.pop("LD_PRELOAD", None)
    base.pop("MALLOC_CHECK_", None)
    assert fuzz_ops.checker_catches_overflow(fuzz_ops.checker_env(base))


def test_a_child_without_the_heap_checker_fails_the_run(monkeypatch):
    monkeypatch.setattr(fuzz_ops, "checker_env", lambda env: dict(env, MALLOC_CHECK_="3"))
    import pytest

    with pytest.raises(RuntimeError, match="without glibc's heap checker"):
        fuzz_ops.fuzz(["aten::view_as_real.default"])


def test_ops_admitted_by_contract_refuse_every_edge_past_it_and_run_the_rest():
    """as_strided at and one element past its storage's end, sizes of 0, complex views of the
    wrong layout or dtype: the boundary cases the contract must refuse are refused; what it
    accepts runs without a crash, and every real result has the meta kernel's shape and dtype."""
    ops = ["aten::as_strided.default", "aten::view_as_complex.default", "aten::view_as_real.default",
           "aten::polar.default", "aten::_conj.default", "aten::unbind.int"]
    must_refuse = {
        "aten::as_strided.default": {"one_past_the_end", "huge_stride", "stride_past_int48", "negative_stride",
                                     "negative_size", "empty_offset_past_the_end", "empty_many_elements",
                                     "offset_past_the_end", "view_of_a_view_past_the_end", "short_stride"},
        "aten::view_as_complex.default": {"last_dim_3", "last_dim_1", "zero_dim", "last_stride_3", "odd_stride",
                                          "odd_offset", "bfloat16", "int64", "complex64"},
        "aten::view_as_real.default": {"float32"},
        "aten::polar.default": {"mixed_dtypes", "half", "no_broadcast", "int64"},
        "aten::_conj.default": {"float32", "int64"},
        "aten::unbind.int": {"many_views"},
    }
    for name, labels in must_refuse.items():
        edges = dict(fuzz_ops.EDGES[name])
        for label in labels:
            assert fuzz_ops.check(name, *edges[label], 16 << 20) is not None, (name, label)
    edges = dict(fuzz_ops.EDGES["aten::as_strided.default"])
    for label in ("empty_huge_stride", "view_of_a_view", "offset_default_of_a_shifted_input"):
        assert fuzz_ops.check("aten::as_strided.default", *edges[label], 16 << 20) is None, label
    r = fuzz_ops.fuzz(ops, timeout=30.0)
    print(f"\nops by contract: {r['tried']} argument sets, {r['refused']} refused, {r['run']} run, "
          f"{len(r['crashes'])} crashes, {len(r['divergences'])} meta/real divergences")
    assert r["crashes"] == [] and r["divergences"] == [] and r["valid_samples_refused"] == []
    assert r["not_run"] == 0 and set(r["by_op"]) == set(ops)


def test_mutations_break_every_kind_of_argument():
    """Zero sizes in every dimension, flags and mask entries flipped, the int64 extremes, NaN and
    infinities, integer tensors holding INT_MIN: the kinds of argument the review's crashes needed."""
    t = fuzz_ops.t
    base = [(t(4, 3, 5), t(3, dtype="int64"), [True, False], 1, 0.5, True, "sum"), {}]
    labels = {label for label, _ in fuzz_ops.mutations(base)}
    for wanted in ("0.0:empty", "0.0:empty_dim1", "0.0:empty_dim2", "0.0:nan_values", "0.0:inf_values",
                   "0.1:int_min_values", "0.1:int_max_values", "0.2.0:flip", "0.2.1:flip", "0.5:flip",
                   f"0.3:int_{-(1 << 63)}", f"0.3:int_{(1 << 63) - 1}", "0.3:int_-1", "0.3:int_0",
                   "0.4:float_nan", "0.4:float_inf", "0.6:str_trunc", "0.6:str_nonsense"):
        assert wanted in labels, wanted


_CRASHED = {  # each crashed its CPU kernel (a signal) before its contract or value check refused it
    "aten::div.Tensor_mode": ("int64_min_by_minus_one_trunc", "int32_min_by_minus_one_trunc",
                              "broadcast_min_by_minus_one_trunc"),
    "aten::div.Scalar_mode": ("int64_min_by_minus_one_trunc", "int32_min_by_minus_one_trunc"),
    "aten::_scaled_dot_product_flash_attention_for_cpu.default": ("empty_query", "empty_key", "no_heads"),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default": ("empty_query", "empty_key"),
    "aten::_embedding_bag.default": ("max_last_offset_single", "no_offsets", "no_offsets_slow_path"),
    "aten::_adaptive_avg_pool2d_backward.default": ("zero_input_height", "zero_channels"),
    "aten::native_batch_norm.default": ("eval_without_running_stats",),
    "aten::_native_batch_norm_legit.no_stats": ("eval",),
    "aten::native_batch_norm_backward.default": ("eval_without_running_stats", "train_without_saved_stats",
                                                 "train_saved_stats_empty"),
}
_VALUE_REFUSED = {"aten::div.Tensor_mode", "aten::div.Scalar_mode"}  # shapes are fine: the values trap


def test_the_crash_edges_are_refused_and_their_neighbours_run():
    """Each crash found by the extended mutations: refused by its contract at load (shapes), or by
    its value check right before the call (integer division's INT_MIN / -1); the cases next to
    them that are fine (eval-mode batch norm's empty saved statistics, floor division of INT_MIN
    by -1, a batch of 0 for adaptive pooling) are accepted and run."""
    from spmd_aot.format.contracts import VALUE_CHECKS

    for name, labels in _CRASHED.items():
        edges = dict(fuzz_ops.EDGES[name])
        for label in labels:
            why = fuzz_ops.check(name, *edges[label], 16 << 20)
            if name in _VALUE_REFUSED:
                assert why is None, (name, label, why)
                args, kwargs = fuzz_ops.materialize(*edges[label], "cpu")
                try:
                    VALUE_CHECKS[name](tuple(args), dict(kwargs))
                except ArithmeticError as exc:
                    assert "overflows" in str(exc)
                else:
                    raise AssertionError((name, label, "not refused"))
            else:
                assert why is not None, (name, label)
    fine = {"aten::native_batch_norm_backward.default": "eval_saved_stats_empty",
            "aten::native_batch_norm.default": "eval", "aten::div.Tensor_mode": "int64_min_by_minus_one_floor",
            "aten::_adaptive_avg_pool2d_backward.default": "zero_batch",
            "aten::_embedding_bag.default": "mean_padding_idx"}
    for name, label in fine.items():
        assert fuzz_ops.check(name, *dict(fuzz_ops.EDGES[name])[label], 16 << 20) is None, (name, label)
    r = fuzz_ops.fuzz(sorted(_CRASHED), timeout=30.0)
    assert r["crashes"] == [] and r["divergences"] == [] and r["valid_samples_refused"] == []
    assert r["run_ok"] > 0 and r["run_raised"] > 0  # the INT_MIN / -1 divisions raise in the child


def test_a_divergence_is_detected_reported_per_op_and_fails_the_run(monkeypatch, capsys):
    """With CPU's embedding-bag rule taken out of the load's check (``device_results``), the
    check derives the meta kernel's (CUDA's) offset2bag for a CPU run: the fuzzer sees every such
    case's real result differ, reports it per op, and exits non-zero."""
    from spmd_aot.format import device_results

    name = "aten::_embedding_bag.default"
    monkeypatch.setitem(device_results.RULES, "cpu", {
        op: rule for op, rule in device_results.RULES["cpu"].items() if op is not fuzz_ops.torch.ops.aten._embedding_bag.default})
    r = fuzz_ops.fuzz([name], timeout=30.0)
    assert r["crashes"] == [] and r["divergences"], r
    assert all(d[0] == name for d in r["divergences"])
    assert r["by_op"][name]["divergences"] == len(r["divergences"])
    meta, real = r["divergences"][0][2:]
    assert meta[1] != real[1]  # offset2bag: [n_indices] on meta, [0] on CPU's fast path
    assert fuzz_ops.main(["--op", name, "--no-pairs"]) == 1
    out = capsys.readouterr().out
    assert f"op {name}: run" in out and "DIVERGES" in out and "meta/real result divergences 0" not in out


def test_a_crash_is_found_without_its_hand_made_case_and_fails_the_run(monkeypatch, capsys):
    """With the no-bag rule taken out of embedding bag's contract and its hand-made cases gone,
    the pair mutations (no offsets, and a transposed or float64 weight: the kernel's slow path)
    crash a child; the fuzzer names each case, counts it per op and exits non-zero. Single
    mutations alone do not reach it."""
    from spmd_aot.format.contracts import CONTRACTS, Broken

    name = "aten::_embedding_bag.default"
    strict = CONTRACTS[name].check

    def without_the_no_bag_rule(a):
        try:
            strict(a)
        except Broken as exc:
            if "at least one bag" not in str(exc):
                raise

    monkeypatch.setattr(CONTRACTS[name], "check", without_the_no_bag_rule)
    monkeypatch.delitem(fuzz_ops.EDGES, name)
    assert fuzz_ops.fuzz([name], timeout=30.0)["crashes"] == []
    assert fuzz_ops.main(["--op", name]) == 1  # pairs too, by default
    out = capsys.readouterr().out
    crashes = [line for line in out.splitlines() if line.startswith(f"CRASH {name} ")]
    assert crashes and all("size_2_to_0+" in line or ":empty+" in line for line in crashes), out
    assert f"op {name}: run " in out and f"crashes {len(crashes)}," in out
