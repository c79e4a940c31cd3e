"""spmd_aot.runtime.device_check: a loaded artifact's device against the live process.

Each case crafts the process (CUDA devices, backend, torchrun's LOCAL_RANK/LOCAL_WORLD_SIZE) and a
model whose parameters report the device, so the CUDA rules are tested on a CPU-only machine.
"""

import dataclasses

import pytest
import torch

from spmd_aot.runtime.device_check import DeviceMismatchError, Process, check_device, live_process
from spmd_aot.errors import ArtifactMismatchError
from spmd_aot.parallel.plan import Plan


class _OnDevice(torch.nn.Module):
    """A model whose parameters say they lie on ``devices`` (meta tensors with a device attribute)."""

    def __init__(self, *devices):
        super().__init__()
        self._devices = [torch.device(d) for d in devices]

    def parameters(self, recurse=True):
        return iter([_Fake(d) for d in self._devices])

    def buffers(self, recurse=True):
        return iter([])


@dataclasses.dataclass
class _Fake:
    device: torch.device


def _proc(**kw) -> Process:
    base = dict(cuda_built=True, device_count=8, current_device=0, backend="nccl", world_size=2,
                local_rank="0", local_world_size="2", visible_devices=None, torch_version="2.13.0+cu130")
    base.update(kw)
    return Process(**base)


CUDA = Plan(2, "replicate", "cuda").to_dict()
CPU = Plan(2, "replicate", "cpu").to_dict()


def test_cuda_artifact_binds_local_rank():
    proc = _proc(local_rank="3", current_device=3, local_world_size="8")
    assert check_device(CUDA, _OnDevice("cuda:3"), proc) == torch.device("cuda", 3)
    # a manifest (holding the plan) and a Plan object work the same
    assert check_device({"plan": CUDA}, _OnDevice("cuda:3"), proc) == torch.device("cuda", 3)
    assert check_device(Plan(2, "shard", "cuda"), _OnDevice("cuda:3"), proc) == torch.device("cuda", 3)


def test_cuda_artifact_without_torchrun_takes_the_models_device():
    proc = _proc(local_rank=None, local_world_size=None, backend=None, world_size=1, current_device=1)
    assert check_device(CUDA, _OnDevice("cuda:1"), proc) == torch.device("cuda", 1)
    # a bare "cuda" model device: the current device
    assert check_device(CUDA, _OnDevice("cuda"), proc) == torch.device("cuda", 1)


def test_cuda_artifact_in_a_cpu_only_process():
    with pytest.raises(DeviceMismatchError, match="CPU-only build"):
        check_device(CUDA, _OnDevice("cpu"), _proc(cuda_built=False, device_count=0, current_device=None))
    with pytest.raises(DeviceMismatchError, match="sees no CUDA device.*CUDA_VISIBLE_DEVICES=''"):
        check_device(CUDA, _OnDevice("cpu"), _proc(device_count=0, current_device=None, visible_devices=""))


def test_cuda_artifact_with_the_model_left_on_cpu():
    with pytest.raises(DeviceMismatchError, match=r"model lies on cpu: move it first \(model.to\('cuda:0'\)\)"):
        check_device(CUDA, _OnDevice("cpu"), _proc())


def test_cpu_artifact_under_nccl():
    with pytest.raises(DeviceMismatchError, match="built for cpu, but the process group's backend is 'nccl'"):
        check_device(CPU, _OnDevice("cpu"), _proc())
    # gloo, or a group with gloo for CPU tensors, is fine
    assert check_device(CPU, _OnDevice("cpu"), _proc(backend="gloo")) == torch.device("cpu")
    assert check_device(CPU, _OnDevice("cpu"), _proc(backend="cpu:gloo,cuda:nccl")) == torch.device("cpu")
    # one rank under NCCL has no collective to run: nothing to refuse
    assert check_device(CPU, _OnDevice("cpu"), _proc(world_size=1)) == torch.device("cpu")


def test_cpu_artifact_with_a_cuda_model():
    with pytest.raises(DeviceMismatchError, match="built for cpu, but the model lies on cuda:0"):
        check_device(CPU, _OnDevice("cuda:0"), _proc(backend="gloo"))


def test_cuda_artifact_under_gloo_alone():
    with pytest.raises(DeviceMismatchError, match="need NCCL"):
        check_device(CUDA, _OnDevice("cuda:0"), _proc(backend="gloo"))
    assert check_device(CUDA, _OnDevice("cuda:0"), _proc(backend="cpu:gloo,cuda:nccl")) == torch.device("cuda", 0)


def test_device_count_mismatch():
    with pytest.raises(DeviceMismatchError, match=r"LOCAL_RANK=2, but this node shows 2 CUDA device\(s\) "
                                                  r"\(CUDA_VISIBLE_DEVICES='0,1'\)"):
        check_device(CUDA, _OnDevice("cuda:0"), _proc(device_count=2, local_rank="2", local_world_size="4",
                                                       visible_devices="0,1"))
    with pytest.raises(DeviceMismatchError, match=r"LOCAL_WORLD_SIZE=4 processes on this node, but it shows 2"):
        check_device(CUDA, _OnDevice("cuda:1"), _proc(device_count=2, local_rank="1", local_world_size="4",
                                                       current_device=1))


def test_model_on_another_ranks_gpu():
    with pytest.raises(DeviceMismatchError, match=r"model lies on cuda:0, but this rank's device is cuda:1"):
        check_device(CUDA, _OnDevice("cuda:0"), _proc(local_rank="1", current_device=1))


def test_current_device_not_set_to_local_rank():
    with pytest.raises(DeviceMismatchError, match=r"current CUDA device is cuda:0.*torch.cuda.set_device"):
        check_device(CUDA, _OnDevice("cuda:1"), _proc(local_rank="1", current_device=0))


def test_model_on_several_devices():
    with pytest.raises(DeviceMismatchError, match="several devices"):
        check_device(CUDA, _OnDevice("cuda:0", "cpu"), _proc())


@pytest.mark.parametrize("value", ["x", "-1", ""])
def test_bad_local_rank(value):
    with pytest.raises(DeviceMismatchError, match=r"\$LOCAL_RANK="):
        check_device(CUDA, _OnDevice("cuda:0"), _proc(local_rank=value))


def test_unknown_device_type_and_missing_plan():
    with pytest.raises(DeviceMismatchError, match="device 'xpu'"):
        check_device(dict(CPU, device_type="xpu"), _OnDevice("cpu"), _proc())
    with pytest.raises(DeviceMismatchError, match="names no device type"):
        check_device({"plan": {}}, _OnDevice("cpu"), _proc())


def test_is_an_artifact_mismatch():
    assert issubclass(DeviceMismatchError, ArtifactMismatchError)


def test_live_process_here_reads_torchrun_env():
    proc = live_process({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (proc.local_rank, proc.local_world_size) == ("1", "2")
    assert proc.world_size == 1 and proc.backend is None  # no process group in this test process
    assert proc.device_count == torch.cuda.device_count() if torch.cuda.is_available() else proc.device_count == 0
    # the real process: a CPU artifact binds the CPU with a CPU model
    assert check_device(CPU, torch.nn.Linear(2, 2), proc) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceMismatchError, match="built for cuda"):
            check_device(CUDA, torch.nn.Linear(2, 2), proc)
