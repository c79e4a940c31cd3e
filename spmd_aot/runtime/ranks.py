"""The cross-rank protocol of a step's first call: what the ranks agree on and send each other.

Every function here is collective (every rank calls it, in the same order) and a no-op at world
size 1. The order in ``CompiledStep._prepare``: ``check_ranks_agree`` (the key), rank 0 decides
and ``broadcast_decision`` tells the others, ``all_ranks_allow`` settles whether stored kernels
may load (every rank must allow it), ``broadcast_blobs`` lends rank 0's artifact to ranks that
cannot read it, ``all_ranks_ok`` fails every rank when one failed (none is left waiting).
Messages are bytes, never pickle: a rank trusts rank 0's decision, not code.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import errors
from .device_check import DeviceMismatchError
from ..errors import ArtifactMismatchError, SpmdAotError

__all__ = ["ERRORS", "error_from_rank0", "comm_device", "broadcast_model_once", "check_ranks_agree",
           "Decision", "broadcast_decision", "rank0_decides", "needs_blobs", "broadcast_blobs", "all_ranks_ok", "all_ranks_allow",
           "live_groups"]

# Rank 0's failure reaches the other ranks by class name; the error types the other ranks raise
# again (any other name becomes SpmdAotError). One table: every public error type of the project.
ERRORS: dict[str, type[SpmdAotError]] = {
    name: getattr(errors, name) for name in errors.__all__
    if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), SpmdAotError)}
ERRORS[DeviceMismatchError.__name__] = DeviceMismatchError


def error_from_rank0(status: str, payload: str) -> SpmdAotError:
    """The error a rank raises when rank 0 reported failure ``status`` (an exception's class name)."""
    return ERRORS.get(status, SpmdAotError)(f"rank 0 failed: {payload}")


def comm_device() -> torch.device:
    """Where the collectives' own tensors live: NCCL moves CUDA tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_BROADCAST_MODELS = weakref.WeakSet()  # models this process has taken rank 0's values for


def broadcast_model_once(model) -> None:
    """Rank 0's parameters and buffers to every rank, once per model, as DDP does at construction:
    whichever compiled step (train or eval) sees the model first; later, FSDP2-style per-rank
    buffers must not be overwritten."""
    if model in _BROADCAST_MODELS:
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    _BROADCAST_MODELS.add(model)


def _broadcast_bytes(data: bytes | None) -> bytes:
    dev = comm_device()
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if data
           else torch.empty(int(size.item()), dtype=torch.uint8, device=dev))
    if int(size.item()):
        dist.broadcast(buf, src=0)
    return _tensor_bytes(buf) if int(size.item()) else b""


def _tensor_bytes(buf: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes without numpy (not a dependency): its own exact-size storage."""
    buf = buf.cpu().contiguous()
    return bytes(buf.untyped_storage())[buf.storage_offset(): buf.storage_offset() + buf.numel()]


def check_ranks_agree(key, world: int) -> None:
    """Raise on every rank when any rank computed another key, naming the differing ingredients."""
    if world == 1:
        return
    dev = comm_device()
    mine = torch.tensor([int(d[:12], 16) for d in key.ingredients.values()], dtype=torch.int64, device=dev)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    names = list(key.ingredients)
    for r, theirs in enumerate(everyone):
        differ = [names[i] for i in range(len(names)) if theirs[i] != everyone[0][i]]
        if differ:
            raise ArtifactMismatchError(
                f"rank {r} computes a different cache key than rank 0; differing ingredients: "
                f"{', '.join(differ)}. Every rank must run the same code, model and batch shapes.")


class Decision(NamedTuple):
    """What rank 0 settled for a step, as every rank receives it."""

    status: str  # "ok", or the class name of the error rank 0 met (every rank raises it)
    payload: str  # the manifest digest, or that error's message
    hit: bool  # served from the cache
    traced: bool  # traced by this job (a miss)


def broadcast_decision(decision, world: int) -> Decision:
    """Rank 0's (status, payload, hit, traced) to every rank: mixed hit/miss would hang a job."""
    if world == 1:
        return Decision(*decision)
    status, payload, hit, traced = decision
    data = f"{status}\n{int(hit)}{int(traced)}\n{payload}".encode() if dist.get_rank() == 0 else None
    status, flags, payload = _broadcast_bytes(data).decode().split("\n", 2)
    return Decision(status, payload, flags[0] == "1", flags[1] == "1")


def rank0_decides(resolve, rank: int, world: int):
    """Run ``resolve()`` on rank 0 only (it returns the digest, hit, traced and anything else
    rank 0 keeps) and give every rank the same ``Decision``; rank 0's failure is raised on every
    rank, so none is left waiting. Returns ``(decision, rest)``: ``rest`` is what ``resolve``
    returned past its first three values, on rank 0 (``()`` elsewhere)."""
    status, payload, hit, traced, rest, error = "ok", "", False, False, (), None
    if rank == 0:
        try:
            payload, hit, traced, *rest = resolve()
        except Exception as exc:  # any failure reaches every rank: none is left waiting
            status, payload, error = type(exc).__name__, str(exc), exc
    decision = broadcast_decision((status, payload, hit, traced), world)
    if error is not None:
        raise error
    if decision.status != "ok":
        raise error_from_rank0(decision.status, decision.payload)
    return decision, tuple(rest)


def needs_blobs(have_artifact: bool, world: int) -> bool:
    """Whether any rank could not read the artifact itself (then rank 0 sends it to all)."""
    if world == 1:
        return False
    needed = torch.tensor([0 if have_artifact else 1], dtype=torch.int64, device=comm_device())
    dist.all_reduce(needed)
    return needed.item() != 0


def broadcast_blobs(blobs: dict[str, bytes] | None) -> dict[str, bytes]:
    """Rank 0's blobs to every rank: a count, then (digest, bytes) pairs; receivers verify."""
    count = _broadcast_bytes(str(len(blobs)).encode() if blobs is not None else None)
    items = list(blobs.items()) if blobs is not None else [None] * int(count)
    out = {}
    for item in items:
        name = _broadcast_bytes(item[0].encode() if item else None).decode()
        out[name] = _broadcast_bytes(item[1] if item else None)
    return out


def all_ranks_ok(failure: Exception | None, world: int) -> None:
    """Raise on every rank if any rank failed to load, instead of leaving the others hanging."""
    if world > 1:
        flag = torch.tensor([1 if failure else 0], dtype=torch.int64, device=comm_device())
        dist.all_reduce(flag)
        if flag.item() and failure is None:
            raise SpmdAotError(f"{flag.item()} rank(s) failed to load the artifact; see their errors")
    if failure is not None:
        raise failure


def all_ranks_allow(allowed: bool, world: int) -> bool:
    """Whether every rank allows something (each for its own reasons): the AND over ranks.

    For what must be the same on every rank but that no rank may decide for another, such as
    loading native code: ranks that ran different programs could order their collectives
    differently and hang, and one rank's trust is no reason for another to run code."""
    if world == 1:
        return allowed
    refusing = torch.tensor([0 if allowed else 1], dtype=torch.int64, device=comm_device())
    dist.all_reduce(refusing)
    return refusing.item() == 0


def live_groups(mesh) -> list[str]:
    """Live process-group name of each mesh dimension (the stored graph names dimensions)."""
    if mesh is None:
        return []
    return [mesh.get_group(dim).group_name for dim in range(mesh.ndim)]
