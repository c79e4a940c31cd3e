"""Compiled kernels in the artifact (``kernels.py``, ``kernel_load.py``): parity with eager and
the interpreter, native code only from a trusted entry, tampering caught by ``verify``.

Builds of the MLP with kernels (Inductor's CPU compile of the example transformer takes a minute
on these cores, the MLP seconds): one at world 1 that serves most tests, world 2 replicate and
shard, and world 4 on 2-D meshes (HSDP, FSDP x TP: one build each, one launch for both).
"""

import logging
import pathlib
import shutil
from types import SimpleNamespace as NS

import pytest
from torch._functorch._aot_autograd.schemas import OutputType

import spmd_aot
from support.jobs import compiled_run, eager_ddp, make_job, max_diffs
from support.multiproc import run_ranks

TOL = 1e-4  # AdamW at lr 1e-2 over 3 steps: Inductor's fused loops round differently (README "Parity floor")


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kernels1")
    result = spmd_aot.build(make_job("mlp", "adamw"), world_size=1, cache_dir=cache, kernels=True)
    assert result.stats["kernels"] == "compiled", result.stats
    return cache, result


def _loaded_maps() -> list[str]:
    """Shared libraries this process mapped from a private kernels directory."""
    return [line for line in pathlib.Path("/proc/self/maps").read_text().splitlines()
            if "spmd-aot-kernels-" in line]


def _world1_worker(rank, world, cache_dir, trust):
    import spmd_aot.runtime.kernel_load as kernel_load

    model, optim, losses, info = compiled_run("mlp", "adamw", rank, world, 3, cache_dir,
                                              require_hit=True, kernels=True, trust_cache=trust)
    ref = eager_ddp("mlp", "adamw", rank, world, 3)
    interp = compiled_run("mlp", "adamw", rank, world, 3, cache_dir, require_hit=True, kernels=True,
                          trust_cache=False)
    return (max_diffs(*ref, model, optim, losses), max_diffs(*interp[:3], model, optim, losses), info.hit,
            len(_loaded_maps()), len(kernel_load.loaded_dirs()))


def test_trusted_kernels_match_eager_and_the_interpreter(world1):
    cache, _ = world1
    [(vs_eager, vs_interpreted, hit, maps, dirs)] = run_ranks(_world1_worker, 1, str(cache), True)
    assert hit and dirs == 1 and maps > 0, "the compiled kernels must have been loaded"
    assert max(vs_eager.values()) < TOL, vs_eager
    assert max(vs_interpreted.values()) < TOL, vs_interpreted


def _untrusted_worker(rank, world, cache_dir):
    import spmd_aot.runtime.kernel_load as kernel_load

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("spmd_aot.runtime.kernel_load").addHandler(handler)
    steps = [spmd_aot.compile(__import__("spmd_aot.examples.models", fromlist=["x"]).train_step,
                              cache_dir=cache_dir, require_hit=True, kernels=True) for _ in range(2)]
    from support.jobs import fresh_objects, make_batch

    for step in steps:  # two compiled steps: the reason is logged once per process
        model, optim = fresh_objects("mlp", "adamw")
        for s in range(2):
            step(model, optim, make_batch("mlp", rank, s))
    programs = [type(step._bound.program).__name__ for step in steps]
    why = [r.getMessage() for r in records if "interpreted" in r.getMessage()]
    return programs, why, len(_loaded_maps()), len(kernel_load.loaded_dirs())


def test_unsigned_untrusted_entry_never_loads_native_code(world1, monkeypatch):
    cache, _ = world1
    monkeypatch.delenv("SPMD_AOT_SIGNING_KEY", raising=False)
    monkeypatch.delenv("SPMD_AOT_TRUST_CACHE", raising=False)
    [(programs, why, maps, dirs)] = run_ranks(_untrusted_worker, 1, str(cache))
    assert programs == ["Program", "Program"] and maps == 0 and dirs == 0
    assert len(why) == 1 and "not signed" in why[0] and "SPMD_AOT_TRUST_CACHE=1" in why[0], why


def _signed_worker(rank, world, cache_dir):
    _, _, _, info = compiled_run("mlp", "adamw", rank, world, 2, cache_dir, require_hit=True, kernels=True)
    return info.hit, len(_loaded_maps())


def test_a_signed_entry_loads_kernels_without_trusting_the_cache(tmp_path, world1, monkeypatch):
    """The same entry, its manifest signed (the parts, kernels included, are unchanged)."""
    from spmd_aot.format.signing import sign_manifest_blob
    from spmd_aot.store import open_store

    cache, result = world1
    signed = tmp_path / "signed"
    shutil.copytree(cache, signed)
    store = open_store(signed)
    store.set_ref(result.key, store.put(sign_manifest_blob(store.get(result.digest), b"test key")))
    monkeypatch.setenv("SPMD_AOT_SIGNING_KEY", "test key")
    monkeypatch.delenv("SPMD_AOT_TRUST_CACHE", raising=False)
    [(hit, maps)] = run_ranks(_signed_worker, 1, str(signed))
    assert hit and maps > 0


def test_verify_detects_a_tampered_kernel_blob(tmp_path, world1):
    cache, result = world1
    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    from spmd_aot.entries import read_manifest
    from spmd_aot.cli.app import main
    from spmd_aot.store import open_store

    store = open_store(copy)
    kernels_digest = read_manifest(store, result.digest)["blobs"]["kernels"]
    path = pathlib.Path(store.blob_path(kernels_digest))
    path.chmod(0o600)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert main(["verify", "--cache-dir", str(copy)]) != 0


def test_show_lists_the_kernels(world1, capsys):
    cache, result = world1
    from spmd_aot.cli.app import main

    assert main(["show", result.key, "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "kernels:      1 library in 1 call, " in out


def _ddp_worker(rank, world, cache_dir, trusting_ranks):
    model, optim, losses, info = compiled_run("mlp", "adamw", rank, world, 3, cache_dir, require_hit=True,
                                              kernels=True, trust_cache=rank in trusting_ranks)
    ref = eager_ddp("mlp", "adamw", rank, world, 3)
    return max_diffs(*ref, model, optim, losses), len(_loaded_maps())


def test_world2_kernels_match_ddp_and_load_only_where_every_rank_trusts(tmp_path):
    result = spmd_aot.build(make_job("mlp", "adamw"), world_size=2, cache_dir=tmp_path, kernels=True)
    assert result.stats["kernels"] == "compiled", result.stats
    for diffs, maps in run_ranks(_ddp_worker, 2, str(tmp_path), (0, 1)):
        assert maps > 0
        assert max(diffs.values()) < TOL, diffs
    # rank 0 trusts the cache, rank 1 does not: no rank loads native code, both match DDP
    for diffs, maps in run_ranks(_ddp_worker, 2, str(tmp_path), (0,)):
        assert maps == 0
        assert max(diffs.values()) < TOL, diffs


def test_kernels_are_in_the_key(world1, tmp_path):
    _, with_kernels = world1
    without = spmd_aot.build(make_job("mlp", "adamw"), world_size=1, cache_dir=tmp_path)
    assert without.key != with_kernels.key and "kernels" not in without.stats


_NO_INDUCTOR_JOB = """
import sys
sys.path.insert(0, sys.argv[2])
import torch
import spmd_aot
from spmd_aot.examples.models import train_step
from spmd_aot.entries import read_artifact
from spmd_aot.runtime.kernel_load import load_kernels
from spmd_aot.store import open_store
from support.jobs import fresh_objects, make_batch


def compilers():
    return sorted(m for m in sys.modules if m.split(".")[:2] in (["torch", "_inductor"], ["torch", "_dynamo"]))


store = open_store(sys.argv[1])
artifact = read_artifact(store, store.get_ref(sys.argv[3]))
program = load_kernels(artifact, [], True, torch.device("cpu"))
program(*[torch.zeros(s["local_shape"], dtype=getattr(torch, s["dtype"])) for s in artifact.slots])
print(type(program).__name__, compilers())
model, optim = fresh_objects("mlp", "adamw")  # torch.optim imports torch._dynamo (its _disable_dynamo)
before = compilers()
step = spmd_aot.compile(train_step, cache_dir=sys.argv[1], require_hit=True, kernels=True, trust_cache=True)
for s in range(2):
    step(model, optim, make_batch("mlp", 0, s))
print(type(step._bound.program).__name__, sorted(set(compilers()) - set(before)))
"""


def test_loading_kernels_imports_neither_inductor_nor_dynamo(world1):
    """In a fresh process, loading and calling the stored kernels imports nothing of
    ``torch._inductor`` or ``torch._dynamo`` (1.2-2 s of a cold start); nor does a whole job
    (whose optimizer imports ``torch._dynamo`` by itself) import any more of them."""
    import subprocess
    import sys

    cache, result = world1
    out = subprocess.run([sys.executable, "-c", _NO_INDUCTOR_JOB, str(cache), str(pathlib.Path(__file__).parents[1]),
                          result.key], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2:] == ["KernelProgram []", "KernelProgram []"], out.stdout[-2000:]


def _old_format_worker(rank, world, cache_dir):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("spmd_aot.runtime.kernel_load").addHandler(handler)
    model, optim, losses, info = compiled_run("mlp", "adamw", rank, world, 2, cache_dir, require_hit=True,
                                              kernels=True, trust_cache=True)
    ref = eager_ddp("mlp", "adamw", rank, world, 2)
    why = [r.getMessage() for r in records if "interpreted" in r.getMessage()]
    return max(max_diffs(*ref, model, optim, losses).values()), why, len(_loaded_maps())


def test_a_kernels_blob_of_the_old_format_runs_interpreted(tmp_path, world1):
    """Format 1 (Inductor's pickled artifact + libraries) under a trusted entry: skipped by its
    format, nothing of it loaded, the step interpreted; ``verify`` refuses it."""
    import msgpack

    from spmd_aot.cli.app import main
    from spmd_aot.entries import read_manifest
    from spmd_aot.format.artifact import pack_manifest
    from spmd_aot.store import open_store

    cache, result = world1
    old = tmp_path / "old"
    shutil.copytree(cache, old)
    store = open_store(old)
    manifest = read_manifest(store, result.digest)
    requested = msgpack.unpackb(store.get(manifest["blobs"]["kernels"]))["requested"]
    manifest["blobs"]["kernels"] = store.put(msgpack.packb(
        {"format": 1, "requested": requested, "groups": [], "cxx": "c++", "artifact": b"\x80\x04pickle",
         "files": {"ab/" + "c" * 52 + ".main.so": b"\x7fELF"}}, use_bin_type=True))
    store.set_ref(result.key, store.put(pack_manifest(manifest)))
    [(diff, why, maps)] = run_ranks(_old_format_worker, 1, str(old))
    assert maps == 0 and diff < TOL
    assert len(why) == 1 and "format 1" in why[0], why
    assert main(["verify", "--cache-dir", str(old)]) != 0


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_GROUPS = ("fc1.*", "fc2.*", "head.*")


def _fsdp_worker(rank, world, cache_dir):
    from torch.distributed.fsdp import fully_shard

    from support.jobs import OPTIMIZERS, fresh_objects, make_batch
    from spmd_aot.examples.models import train_step

    ref, _ = fresh_objects("mlp", "adamw")
    for layer in (ref.fc1, ref.fc2, ref.head, ref):  # FSDP2 units as the step's groups
        fully_shard(layer)
    ref_optim = OPTIMIZERS["adamw"](ref)
    ref_losses = [train_step(ref, ref_optim, make_batch("mlp", rank, s)).detach() for s in range(3)]
    model, _, losses, info = compiled_run("mlp", "adamw", rank, world, 3, cache_dir, require_hit=True,
                                          kernels=True, trust_cache=True, placement="shard", shard_groups=_GROUPS)
    params = max((_full(a) - _full(b)).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    loss = max((a - b).abs().item() for a, b in zip(ref_losses, losses))
    import sys  # the library calls the collectives through the dispatcher, not Inductor's Python
    return params, loss, len(_loaded_maps()), "torch._inductor.codecache" in sys.modules


def test_world2_sharded_kernels_match_fsdp2(tmp_path):
    """The shard placement's all_gather, reduce_scatter and wait_tensor, called from the library;
    one group per layer, so buffers of one group's collectives are reused by the next's."""
    result = spmd_aot.build(make_job("mlp", "adamw"), world_size=2, cache_dir=tmp_path, kernels=True,
                            placement="shard", shard_groups=_GROUPS)
    assert result.stats["kernels"] == "compiled", result.stats
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= set(result.stats["by_kind"]), result.stats["by_kind"]
    for params, loss, maps, codecache in run_ranks(_fsdp_worker, 2, str(tmp_path)):
        assert maps > 0 and not codecache
        assert params < TOL and loss < TOL, (params, loss)


def _compile_entries(**changes):
    """Stand-ins for the compile's AOTAutograd and FX graph entries of a plain step, with ``changes``."""
    meta = NS(input_info=[None] * 3, num_mutated_inp_runtime_indices=0, output_info=[NS(output_type=OutputType.non_alias)],
              num_intermediate_bases=0, tokens={}, num_graphsafe_rng_states=0)
    entry = NS(runtime_metadata=meta, compiled_bw=None, maybe_subclass_meta=None,
               dispatch_wrappers=[NS(needs_post_compile=False)], indices_of_inps_to_detach=[])
    graph = NS(constants={}, torchbind_constants={}, inputs_to_check=[], source_code="    return output_tensors\n")
    for name, value in changes.items():
        owner, _, field = name.partition("__")
        setattr({"meta": meta, "entry": entry, "graph": graph}[owner], field, value)
    return entry, graph


@pytest.mark.parametrize("changes, named", [
    ({}, None),
    ({"meta__num_mutated_inp_runtime_indices": 1}, "input mutations applied outside the graph"),
    ({"meta__output_info": [NS(output_type=OutputType.alias_of_input)]}, "alias"),
    ({"meta__input_info": [None] * 2}, "2 inputs where the graph has 3"),
    ({"entry__dispatch_wrappers": [NS(needs_post_compile=True)]}, "deduplicated"),
    ({"graph__constants": {"c": 1}}, "constants passed after the inputs"),
    ({"graph__source_code": "    return [output_tensors[0].item()]\n"}, "Python numbers"),
])
def test_a_bare_call_is_refused_when_a_wrapper_would_do_something(changes, named):
    from spmd_aot.building.kernel_library import _needs

    needs = _needs(*_compile_entries(**changes), n_inputs=3)
    assert (needs == []) if named is None else (len(needs) == 1 and named in needs[0]), needs


def _collectives_worker(rank, world):
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _get_work_registry_size

    from spmd_aot.building import kernel_collectives  # noqa: F401  (defines the operators)

    name = dist.group.WORLD.group_name
    x = torch.arange(4.0) + 10 * rank
    gathered = torch.ops.spmd_aot.all_gather(x, world, name)
    in_flight = _get_work_registry_size()
    x.fill_(-1.0)  # what Inductor may do to the input buffer once the call returned
    scattered = torch.ops.spmd_aot.reduce_scatter(torch.arange(8.0), "sum", world, name)
    in_flight += _get_work_registry_size()
    # expert parallel's token exchange, uneven: rank 0 sends 1 row to rank 0 and 3 to rank 1,
    # rank 1 sends 2 and 2; each receives what the others' splits say
    sent = torch.arange(4.0) + 10 * rank
    exchanged = torch.ops.spmd_aot.all_to_all(sent, [1, 2] if rank == 0 else [3, 2], [1, 3] if rank == 0 else [2, 2],
                                              name)
    return gathered.tolist(), scattered.tolist(), exchanged.tolist(), in_flight + _get_work_registry_size()


def test_library_collectives_return_with_nothing_in_flight():
    """To Inductor they are extern calls, done when they return: it reuses their buffers right
    after (left in flight, a 4-layer LM at world 2 lost 0.4 of its loss)."""
    exchanged = [[0.0, 10.0, 11.0], [1.0, 2.0, 3.0, 12.0, 13.0]]
    for rank, (gathered, scattered, got, in_flight) in enumerate(run_ranks(_collectives_worker, 2)):
        assert in_flight == 0 and got == exchanged[rank]
        assert gathered == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
        assert scattered == [2.0 * v for v in range(4 * rank, 4 * rank + 4)]


# ---------------------------------------------------------------------------- meshes of two dimensions
_TP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}
# HSDP with the biases whole: they average over both dimensions at once, one collective over the
# world group (the compiled ``spmd_aot.kernels.world``); FSDP x TP: dp_shard and tp groups
_MESHES = {"hsdp": dict(placement="shard", mesh_shape=(2, 2), param_placements={"*bias": "replicate"}),
           "fsdp_tp": dict(placement="shard", mesh_shape=(2, 2), tp_plan=_TP_PLAN)}


def _mesh_oracle(config, rank):
    """Eager FSDP2 on the same 2x2 mesh (HSDP), or ``parallelize_module`` over tp then
    ``fully_shard`` over dp_shard (FSDP x TP); the TP ranks of a share pass the same batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from support.jobs import OPTIMIZERS, fresh_objects, make_batch
    from spmd_aot.examples.models import train_step

    model, _ = fresh_objects("mlp", "adamw")
    if config == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp_shard"])
    optim = OPTIMIZERS["adamw"](model)
    share = rank if config == "hsdp" else rank // 2
    return model, optim, [train_step(model, optim, make_batch("mlp", share, s)).detach() for s in range(3)], share


def _mesh_run(config, share, cache_dir, trust):
    import spmd_aot.runtime.kernel_load as kernel_load
    from support.jobs import fresh_objects, make_batch
    from spmd_aot.examples.models import train_step

    model, optim = fresh_objects("mlp", "adamw")
    step = spmd_aot.compile(train_step, cache_dir=cache_dir, require_hit=True, kernels=True, trust_cache=trust,
                            **_MESHES[config])
    dirs = len(kernel_load.loaded_dirs())
    losses = [step(model, optim, make_batch("mlp", share, s)).detach() for s in range(3)]
    return model, optim, losses, (step.cache_info.hit, type(step._bound.program).__name__,
                                  len(kernel_load.loaded_dirs()) - dirs)


def _meshes_worker(rank, world, caches):
    from support.features import max_diffs

    out = {}
    for config, cache_dir in caches.items():
        ref_model, ref_optim, ref_losses, share = _mesh_oracle(config, rank)
        model, optim, losses, ran = _mesh_run(config, share, cache_dir, True)
        interp = _mesh_run(config, share, cache_dir, False)
        out[config] = (max_diffs(ref_model, ref_optim, model, optim, ref_losses, losses),
                       max_diffs(interp[0], interp[1], model, optim, interp[2], losses), ran, interp[3])
    return out


def test_two_dimensional_meshes_run_kernels_matching_eager_and_the_interpreter(tmp_path):
    """HSDP 2x2 (biases whole: a world-group all-reduce too) and FSDP x TP 2x2, in one world-4
    launch: each build compiles kernels naming each mesh dimension's group (and the world's);
    the load binds them to the live groups; both hit with no trace and match eager and the
    interpreted graph of the same entry within 1e-4 after 3 steps."""
    import msgpack

    from spmd_aot.cli.app import main
    from spmd_aot.entries import read_artifact, read_manifest
    from spmd_aot.store import open_store

    caches = {}
    for config, options in _MESHES.items():
        caches[config] = str(tmp_path / config)
        result = spmd_aot.build(make_job("mlp", "adamw"), world_size=4, cache_dir=caches[config], kernels=True,
                                **options)
        assert result.stats["kernels"] == "compiled", result.stats
        store = open_store(caches[config])
        doc = msgpack.unpackb(store.get(read_manifest(store, result.digest)["blobs"]["kernels"]))
        groups = {e["group"] for e in read_artifact(store, result.digest).schema["nodes"].values() if "collective" in e}
        if config == "hsdp":
            assert "world" in groups and doc["world"] == "spmd_aot.kernels.world", (groups, doc.get("world"))
        assert doc["groups"] == ["spmd_aot.kernels.d0", "spmd_aot.kernels.d1"] and {0, 1} <= groups, groups
    assert main(["verify", "--cache-dir", caches["hsdp"]]) == 0
    for rank, per_rank in enumerate(run_ranks(_meshes_worker, 4, caches, timeout=600)):
        for config, (vs_eager, vs_interpreted, ran, interpreted) in per_rank.items():
            assert ran == (True, "KernelProgram", 1) and interpreted == (True, "Program", 0), (rank, config, ran)
            assert max(vs_eager.values()) < TOL, (rank, config, vs_eager)
            assert max(vs_interpreted.values()) < TOL, (rank, config, vs_interpreted)


@pytest.mark.parametrize("groups, world, ok", [
    (["spmd_aot.kernels.d0"], None, True),
    (["spmd_aot.kernels.d0", "spmd_aot.kernels.d1"], "spmd_aot.kernels.world", True),
    (["spmd_aot.kernels.d0", "spmd_aot.kernels.d1"], "default_pg", False),  # any other live group
    (["spmd_aot.kernels.d0"], "spmd_aot.kernels.world", False),  # 1-D: the world is dimension 0
    (["spmd_aot.kernels.d1", "spmd_aot.kernels.d0"], None, False),
])
def test_the_blob_names_only_the_compiled_groups(groups, world, ok):
    """A load binds exactly these names to live groups: a blob naming any other is refused."""
    from spmd_aot.errors import CorruptArtifactError
    from spmd_aot.format import kernels_blob

    doc = {**_blob(), "groups": groups, **({"world": world} if world is not None else {})}
    if ok:
        assert kernels_blob.check(doc, "test") is doc
    else:
        with pytest.raises(CorruptArtifactError, match="names"):
            kernels_blob.check(doc, "test")


def _blob(**changes) -> dict:
    """A well-formed kernels blob (its library bytes are not code: these tests only check the data)."""
    from spmd_aot.format import kernels_blob

    doc = {"format": kernels_blob.KERNELS_FORMAT, "requested": {}, "cxx": "c++", "entry": kernels_blob.ENTRY,
           "inputs": 2, "constants": [], "groups": [],
           "libraries": [{"library": b"\x7fELF", "inputs": 2, "outputs": 1, "strides": [[4, 1], [1]], "written": [0]},
                         {"library": b"\x7fELF", "inputs": 1, "outputs": 2, "strides": [[]], "written": []}],
           "calls": [[0, [0, 1]], [1, [2]], [0, [3, 4]]], "outputs": [5]}
    doc.update(changes)
    return doc


@pytest.mark.parametrize("changes, ok", [
    ({}, True),
    ({"calls": [[0, [0, 2]], [1, [2]]]}, False),  # reads value 2 before any call defines it
    ({"calls": [[0, [0]]]}, False),  # library 0 takes 2 inputs
    ({"calls": [[2, [0]]]}, False),  # no library 2
    ({"calls": [[0, [0, -1]]]}, False),
    ({"outputs": [6]}, False),  # six values are defined (2 inputs, then 1 + 2 + 1 outputs): 0..5
    ({"outputs": [6], "constants": ["c"]}, True),  # a constant is value 2, the outputs 3..6
    ({"constants": [7]}, False),
    ({"calls": []}, False),
    ({"libraries": [{"library": b"", "inputs": 2, "outputs": 1}]}, False),
    ({"libraries": [{"library": b"x", "inputs": "2", "outputs": 1, "strides": [[1], [1]], "written": []}]}, False),
    ({"libraries": [{"library": b"x", "inputs": 2, "outputs": 1, "strides": [[1]], "written": []}]}, False),
    ({"libraries": [{"library": b"x", "inputs": 2, "outputs": 1, "strides": [[1], [1]], "written": [2]}]}, False),
])
def test_the_blob_calls_only_values_defined_before(changes, ok):
    """Running the stored calls reads no value out of range: each reference names a step input or an
    output of an earlier call, and each call passes its library's number of inputs."""
    from spmd_aot.errors import CorruptArtifactError
    from spmd_aot.format import kernels_blob

    doc = _blob(**changes)
    if ok:
        assert kernels_blob.check(doc, "test") is doc
    else:
        with pytest.raises(CorruptArtifactError):
            kernels_blob.check(doc, "test")


def test_an_input_laid_out_otherwise_is_copied_to_the_library_strides_and_back_when_written():
    """A value one library returned, read by another compiled for other strides (Inductor chooses
    its outputs' layout): the call gets a copy with the expected strides; one it writes is copied back."""
    import torch

    from spmd_aot.runtime.kernel_load import _restrided

    base = torch.arange(6.0).reshape(2, 3)
    transposed, same = base.t(), torch.zeros(3, 2)
    args = [transposed, same]
    written = _restrided(args, [(0, (2, 1), True), (1, (2, 1), False)])
    assert args[0].stride() == (2, 1) and torch.equal(args[0], transposed) and args[1] is same
    assert len(written) == 1 and written[0][0] is transposed
    args[0].add_(1)  # what the library writes, through the copy
    for original, copy in written:
        original.copy_(copy)
    assert torch.equal(base, torch.arange(6.0).reshape(2, 3) + 1)
