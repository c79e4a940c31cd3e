"""The op allowlist: data tied to the torch release, never naming a refused family, enforced
when a graph is stored (so every artifact the test suite builds is checked against it) and
when it is loaded."""

from __future__ import annotations

import torch

from spmd_aot.format import allowlist
from spmd_aot.cli.app import main as cli
from spmd_aot.errors import UnsafeArtifactError
from spmd_aot.format.serialize import encode_graph, resolve_target

import pytest


def test_every_listed_overload_exists_in_this_torch_release():
    assert allowlist.running_release() in allowlist.TORCH_RELEASES, \
        "run the suite and tools/fuzz/fuzz_ops.py on this torch release, then name it in allowed_ops.txt's header"
    for name in allowlist.allowed_ops():
        assert callable(resolve_target(name)), name


def test_the_header_names_each_verified_release():
    assert allowlist.TORCH_RELEASES == ("2.13", "2.14")
    assert allowlist._releases(" 2.13 ,2.14,") == ("2.13", "2.14")


def test_no_listed_overload_belongs_to_a_refused_family():
    refused = {name: allowlist.refusal(name.split("::")[1].split(".")[0]) for name in allowlist.allowed_ops()}
    assert {n: why for n, why in refused.items() if why} == {}


@pytest.mark.parametrize("op", ["_reshape_alias", "as_strided_", "set_", "sparse_coo_tensor",
                                "_sparse_coo_tensor_with_dims_and_tensors", "to_dense", "_nested_tensor_from_mask",
                                "_unsafe_index", "_unsafe_index_put", "_index_put_impl_", "seed", "from_file",
                                "_print", "save"])
def test_dangerous_families_are_refused(op):
    assert allowlist.refusal(op)


def test_views_by_contract_are_listed_not_refused():
    """as_strided and the complex views of rotary embeddings are admitted with a contract each;
    as_strided_ stays refused at load (a build rewrites it to as_strided)."""
    for name in ("aten::as_strided.default", "aten::view_as_complex.default", "aten::view_as_real.default",
                 "aten::_conj.default", "aten::polar.default", "aten::unbind.int"):
        assert name in allowlist.allowed_ops() and allowlist.refusal(name.split("::")[1].split(".")[0]) is None
    with pytest.raises(UnsafeArtifactError, match="is refused: it changes a tensor's shape or strides in place"):
        resolve_target("aten::as_strided_.default")


def test_overloads_whose_meta_kernel_reads_values_are_refused_by_name():
    """``_foreach_addcmul_.Tensor`` and ``_foreach_addcdiv_.Tensor``: their meta kernels read the
    ``scalars`` tensor's values, which the load's check (on meta tensors) cannot give them, so no
    graph calling them could load. They are off the list, an opt-in to them is refused with that
    reason, and their ``.Scalar`` / ``.ScalarList`` overloads stay listed."""
    from spmd_aot.errors import SpmdAotError

    assert set(allowlist.REFUSED_OVERLOADS) == {"aten::_foreach_addcmul_.Tensor", "aten::_foreach_addcdiv_.Tensor"}
    for name in allowlist.REFUSED_OVERLOADS:
        assert name not in allowlist.allowed_ops() and not allowlist.is_allowed(name)
        with pytest.raises(SpmdAotError, match="can never be allowed: it reads the values of its `scalars` tensor"):
            allowlist.opt_in_names([name])
    assert {"aten::_foreach_addcdiv_.ScalarList", "aten::_foreach_addcmul_.Scalar"} <= allowlist.allowed_ops()
    xs = [torch.ones(3, device="meta")]
    with pytest.raises(RuntimeError, match="Expected scalars to be on CPU"):  # why: if torch changes this, re-admit
        torch.ops.aten._foreach_addcmul_.Tensor(xs, xs, xs, torch.ones(1, device="meta"))
    graph = torch.fx.Graph()
    ps = [graph.placeholder(f"p{i}") for i in range(3)]
    graph.call_function(torch.ops.aten._foreach_addcmul_.Tensor, ([ps[0]], [ps[1]], [ps[2]], ps[0]))
    graph.output(None)
    with pytest.raises(UnsafeArtifactError, match="no opt-in can allow: it reads the values of its `scalars`"):
        encode_graph(graph, {})  # the build names it
    with pytest.raises(UnsafeArtifactError, match="is refused: it reads the values of its `scalars`"):
        resolve_target("aten::_foreach_addcdiv_.Tensor")  # and so does a load of a crafted entry


def test_every_op_the_suite_needs_is_listed():
    """The communication passes' ops and every functional collective are on the list; the
    ops of every graph the suite traces are checked when it is stored (next test)."""
    needed = {"aten::cat.default", "aten::view.default", "aten::reshape.default", "aten::split_with_sizes.default",
              "aten::narrow.default", "aten::empty.memory_format", "aten::zeros.default", "aten::copy_.default",
              "aten::_foreach_div_.Scalar", "aten::_foreach_copy_.default", "aten::constant_pad_nd.default",
              "aten::flatten.using_ints", "aten::unflatten.int", "aten::chunk.default",
              "_c10d_functional::all_reduce_coalesced.default", "_c10d_functional::broadcast.default",
              "_c10d_functional::reduce_scatter_tensor_coalesced.default", "_c10d_functional::wait_tensor.default",
              "_c10d_functional::all_gather_into_tensor_coalesced.default"}
    assert needed <= allowlist.allowed_ops()


def test_storing_a_graph_with_an_unlisted_op_fails_at_build_time():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.erfinv.default, (x,)))
    with pytest.raises(UnsafeArtifactError, match="not on the op allowlist"):
        encode_graph(graph, {})


def test_cli_lists_the_allowlist(capsys):
    assert cli(["ops"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "aten::add.Tensor" in lines and "operator.getitem" in lines
    assert "aten::_reshape_alias.default" not in lines
    assert len([line for line in lines if not line.startswith("#")]) == len(allowlist.allowed_ops()) + 1


def _lists(tmp_path, header: str, own: str | None = None):
    (tmp_path / "allowed_ops.txt").write_text(f"# torch-release: {header}\naten::add.Tensor\n")
    if own:
        (tmp_path / f"allowed_ops-{own}.txt").write_text(f"# torch-release: {own}\naten::sub.Tensor\n")
    return str(tmp_path)


def test_a_release_with_its_own_list_uses_it_over_the_shared_one(tmp_path, caplog):
    directory = _lists(tmp_path, "2.13, 2.14", own="2.14")
    choice = allowlist.choose_list("2.14", directory)
    assert choice.path.name == "allowed_ops-2.14.txt" and choice.verified and "own list" in choice.why
    assert allowlist.load_list("2.14", directory) == {"aten::sub.Tensor"}
    assert allowlist.load_list("2.13", directory) == {"aten::add.Tensor"}  # the other release keeps the shared one
    assert not caplog.records


def test_a_header_naming_the_release_selects_the_shared_list_silently(tmp_path, caplog):
    directory = _lists(tmp_path, "2.13, 2.14")
    choice = allowlist.choose_list("2.13", directory)
    assert choice.path.name == "allowed_ops.txt" and choice.verified
    assert allowlist.load_list("2.13", directory) == {"aten::add.Tensor"}
    assert not caplog.records


def test_an_unnamed_release_uses_the_shared_list_and_warns_once(tmp_path, caplog):
    directory = _lists(tmp_path, "2.13, 2.14", own="2.14")
    choice = allowlist.choose_list("2.15", directory)
    assert choice.path.name == "allowed_ops.txt" and not choice.verified and "not 2.15" in choice.why
    with caplog.at_level("WARNING", logger=allowlist.__name__):
        assert allowlist.load_list("2.15", directory) == {"aten::add.Tensor"}
        assert allowlist.load_list("2.15", directory) == {"aten::add.Tensor"}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "not made for torch 2.15" in warnings[0], warnings


def test_the_running_process_uses_the_chosen_list():
    assert allowlist.allowed_ops() == allowlist.load_list(allowlist.running_release(), str(allowlist.LIST_DIR))
    assert allowlist.chosen_list().path.parent == allowlist.LIST_DIR
