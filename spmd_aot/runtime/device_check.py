"""Which device a loaded step binds to, and a clear error when the process cannot run the artifact.

An artifact is built for one device type (``Plan.device_type``: ``cpu`` or ``cuda``; it is in
the key). Loading it where that device is missing or misconfigured otherwise fails late and
obscurely: a CUDA graph in a CPU-only process dies in the first kernel, a CPU graph under NCCL
in the first collective ("no backend for device type cpu"), and two ranks on one GPU hang
NCCL or fail with "Duplicate GPU detected". ``check_device`` looks at the artifact's plan, the
live model and the process (CUDA devices, the process group's backend, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` as torchrun sets them) before anything runs, and returns the device the
program binds to, or raises ``DeviceMismatchError`` saying what is wrong and what to do.

The rules:

* **CUDA artifact**: torch must be a CUDA build and see a device; the device index is
  ``LOCAL_RANK`` (torchrun's per-node rank; without it, the model's own device index); the node
  must have a GPU for every local rank (``LOCAL_RANK < device_count`` and
  ``LOCAL_WORLD_SIZE <= device_count``); the model's parameters and buffers must lie on
  ``cuda:LOCAL_RANK``, which must also be the current device (collectives run there); a
  process group must have NCCL for CUDA tensors.
* **CPU artifact**: the model lies on the CPU and the process group can move CPU tensors
  (gloo, or a ``cpu:gloo,cuda:nccl`` group), not NCCL alone.

Every rank runs the check on its own (the conditions are per process). A rank that fails raises
before any collective of the load; under torchrun its exit ends the others.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

from ..errors import ArtifactMismatchError

__all__ = ["DeviceMismatchError", "Process", "live_process", "check_device"]


class DeviceMismatchError(ArtifactMismatchError):
    """The artifact's device does not fit this process (see ``check_device``)."""


@dataclasses.dataclass(frozen=True)
class Process:
    """What ``check_device`` needs to know about the running process (``live_process()`` reads it;
    tests craft one)."""

    cuda_built: bool
    device_count: int  # CUDA devices this process sees (0 when none, or not a CUDA build)
    current_device: int | None  # torch.cuda.current_device(), None without a device
    backend: str | None  # the default process group's backend, None when there is none
    world_size: int
    local_rank: str | None  # $LOCAL_RANK as torchrun sets it (a string), None when unset
    local_world_size: str | None  # $LOCAL_WORLD_SIZE
    visible_devices: str | None  # $CUDA_VISIBLE_DEVICES, for the message
    torch_version: str = torch.__version__


def live_process(env: Mapping[str, str] | None = None) -> Process:
    """This process as it is now."""
    import torch.distributed as dist

    env = os.environ if env is None else env
    count = torch.cuda.device_count() if torch.backends.cuda.is_built() and torch.cuda.is_available() else 0
    initialized = dist.is_available() and dist.is_initialized()
    return Process(
        cuda_built=torch.backends.cuda.is_built(), device_count=count,
        current_device=torch.cuda.current_device() if count else None,
        backend=str(dist.get_backend()) if initialized else None,
        world_size=dist.get_world_size() if initialized else 1,
        local_rank=env.get("LOCAL_RANK"), local_world_size=env.get("LOCAL_WORLD_SIZE"),
        visible_devices=env.get("CUDA_VISIBLE_DEVICES"))


def _device_type(artifact) -> str:
    """The device type of a ``Plan``, a plan dict (``Plan.to_dict``) or a manifest holding one."""
    if isinstance(artifact, Mapping):
        plan = artifact.get("plan", artifact)
        device = plan.get("device_type") if isinstance(plan, Mapping) else None
    else:
        device = getattr(artifact, "device_type", None)
    if not isinstance(device, str):
        raise DeviceMismatchError("the artifact's plan names no device type")
    return device


def _backends_for(backend: str) -> dict[str, str]:
    """``"nccl"`` -> {cuda: nccl}; ``"gloo"`` -> {cpu: gloo, cuda: gloo};
    ``"cpu:gloo,cuda:nccl"`` -> as written."""
    backend = backend.lower()
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    if backend == "nccl":
        return {"cuda": "nccl"}
    return {"cpu": backend, "cuda": backend}


def _int_env(name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise DeviceMismatchError(f"${name}={value!r} is not a non-negative integer (torchrun sets it per process)")
    return n


def _model_devices(model) -> list[torch.device]:
    seen: dict[str, torch.device] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(str(t.device), t.device)
    return list(seen.values())


def check_device(artifact, model, process: Process | None = None) -> torch.device:
    """The device a program built for ``artifact`` (a ``Plan``, a plan dict or a manifest) binds to
    in this process with ``model``; raises ``DeviceMismatchError`` when it cannot run here."""
    process = process or live_process()
    target = _device_type(artifact)
    devices = _model_devices(model)
    if len(devices) > 1:
        raise DeviceMismatchError(
            f"the model's parameters and buffers lie on several devices ({', '.join(map(str, devices))}); "
            "a compiled step runs on one device per rank: move the whole model (model.to(device))")
    model_device = devices[0] if devices else None
    group = f"the process group's backend is {process.backend!r}" if process.backend else "no process group"
    by_type = _backends_for(process.backend) if process.backend and process.world_size > 1 else {}

    if target == "cpu":
        if process.backend and process.world_size > 1 and "cpu" not in by_type:
            raise DeviceMismatchError(
                f"the artifact was built for cpu, but {group}, which moves CUDA tensors only: initialize "
                "the process group with backend 'gloo' (or 'cpu:gloo,cuda:nccl') for a CPU job, or build "
                "the step for CUDA (spmd-aot build ... --device cuda) and move the model to cuda:LOCAL_RANK")
        if model_device is not None and model_device.type != "cpu":
            raise DeviceMismatchError(
                f"the artifact was built for cpu, but the model lies on {model_device}: build it for "
                f"{model_device.type} (--device {model_device.type}), or keep the model on the CPU")
        return torch.device("cpu")

    if target != "cuda":
        raise DeviceMismatchError(f"the artifact was built for device {target!r}; this runtime runs cpu and cuda")
    visible = f" (CUDA_VISIBLE_DEVICES={process.visible_devices!r})" if process.visible_devices is not None else ""
    if not process.cuda_built:
        raise DeviceMismatchError(
            f"the artifact was built for cuda, but this process's torch {process.torch_version} is a CPU-only "
            "build: install the CUDA wheel of the same torch release, or build the step for cpu")
    if process.device_count == 0:
        raise DeviceMismatchError(
            f"the artifact was built for cuda, but this process sees no CUDA device{visible}: run it on a "
            "GPU machine, or build the step for cpu (spmd-aot build ... --device cpu)")
    local_rank = _int_env("LOCAL_RANK", process.local_rank)
    local_world = _int_env("LOCAL_WORLD_SIZE", process.local_world_size)
    if local_rank is not None and local_rank >= process.device_count:
        raise DeviceMismatchError(
            f"LOCAL_RANK={local_rank}, but this node shows {process.device_count} CUDA device(s){visible}: "
            "each rank takes cuda:LOCAL_RANK; start at most one process per GPU (torchrun --nproc-per-node)")
    if local_world is not None and local_world > process.device_count:
        raise DeviceMismatchError(
            f"LOCAL_WORLD_SIZE={local_world} processes on this node, but it shows {process.device_count} CUDA "
            f"device(s){visible}: NCCL needs one GPU per rank (torchrun --nproc-per-node "
            f"{process.device_count}, or a world size that fits the nodes)")
    if process.backend and process.world_size > 1 and by_type.get("cuda") != "nccl":
        raise DeviceMismatchError(
            f"the artifact was built for cuda, but {group}: its collectives need NCCL for CUDA tensors; "
            "initialize the process group with backend 'nccl' (or 'cpu:gloo,cuda:nccl')")
    if model_device is None or model_device.type != "cuda":
        where = f"cuda:{local_rank}" if local_rank is not None else "cuda"
        raise DeviceMismatchError(
            f"the artifact was built for cuda, but the model lies on {model_device or 'no device (no parameters)'}: "
            f"move it first (model.to('{where}'))")
    index = local_rank if local_rank is not None else (
        model_device.index if model_device.index is not None else process.current_device)
    if model_device.index is not None and model_device.index != index:
        raise DeviceMismatchError(
            f"the model lies on {model_device}, but this rank's device is cuda:{index} (LOCAL_RANK={local_rank}): "
            f"move it with model.to(f'cuda:{{int(os.environ[\"LOCAL_RANK\"])}}')")
    if process.current_device is not None and process.current_device != index:
        raise DeviceMismatchError(
            f"this rank's device is cuda:{index} (LOCAL_RANK), but the current CUDA device is "
            f"cuda:{process.current_device}, where its collectives would run: call "
            "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group")
    return torch.device("cuda", index)
