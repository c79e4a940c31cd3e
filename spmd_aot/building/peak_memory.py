"""Peak live tensor bytes of a train step: estimated from a graph, or measured on any eager step.

Both count the same thing: the bytes of every tensor *storage* alive at once (a view costs
nothing; a storage lives until its last alias dies), including the step's inputs (parameters,
optimizer state, batch), which are alive throughout. Allocator caching, fragmentation and
workspace memory are not counted; they depend on the device and allocator, not the program.

- ``graph_peak_bytes(gm)``: static, from the traced graph's fake values (``node.meta["val"]``).
  Storages are identified by the fake tensors' storages (views share one), a ``wait_tensor``
  returns its input's storage (as it does when run), and an intermediate is freed after its
  last use, as ``Program`` frees it. Stored in the manifest's ``stats["peak_bytes"]``.
- ``PeakMemory``: measured, a ``TorchDispatchMode`` that records the storage of every tensor an
  op returns and drops it when the storage is freed (weakref finalizer); storages it is told to
  ``watch`` (the step's state) are counted too, at their current size after every op (FSDP2
  frees and re-allocates its unsharded parameters by resizing storages, outside any op). It
  measures the loaded step and eager FSDP2 the same way (``tools/bench/bench_memory.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..passes.ops import is_wait

__all__ = ["graph_peak_bytes", "PeakMemory", "state_tensors", "fsdp2_storages"]


def _tensors(value) -> list[torch.Tensor]:
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


def _storage(t: torch.Tensor):
    local = getattr(t, "_local_tensor", None)  # a DTensor's memory is its local tensor's
    if local is not None:
        t = local
    try:
        return t.untyped_storage()
    except Exception:  # tensors without storage
        return None


def graph_peak_bytes(gm: torch.fx.GraphModule) -> int:
    """Peak bytes of storages alive at once when ``gm``'s nodes run in order (see module doc).

    Nodes without a fake value (made by a pass that did not set ``meta["val"]``) count zero.
    """
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    canonical: dict[int, int] = {}  # storage id -> the storage it is at run time (wait_tensor)
    size: dict[int, int] = {}
    end: dict[int, int] = {}  # storage -> index of the node after which it is freed
    born: dict[int, list[int]] = {}  # node index -> storages it allocates
    pinned: set[int] = set()  # inputs and outputs: alive throughout
    for i, node in enumerate(nodes):
        if node.op == "output":
            pinned.update(k for a in node.all_input_nodes for k in _node_storages(a, canonical))
            continue
        source = None
        if is_wait(node) and node.args \
                and isinstance(node.args[0], torch.fx.Node):
            source = next(iter(_node_storages(node.args[0], canonical)), None)
        stop = max((position[u] for u in node.users), default=i)
        for t in _tensors(node.meta.get("val")):
            st = _storage(t)
            if st is None or (node.op != "placeholder" and t.device.type == "meta"):
                continue  # meta tensors made in the step hold no memory (inputs stand for real ones)
            key = canonical.setdefault(st._cdata, source if source is not None else st._cdata)
            if key not in size:
                size[key] = st.nbytes()
                born.setdefault(i, []).append(key)
                if node.op == "placeholder":
                    pinned.add(key)
            end[key] = max(end.get(key, i), stop)
    frees: dict[int, list[int]] = {}
    for key, stop in end.items():
        if key not in pinned:
            frees.setdefault(stop, []).append(key)
    live = peak = 0
    for i in range(len(nodes)):
        for key in born.get(i, ()):
            live += size[key]
        peak = max(peak, live)
        for key in frees.get(i, ()):
            live -= size[key]
    return peak


def _node_storages(node: torch.fx.Node, canonical: dict) -> list[int]:
    out = []
    for t in _tensors(node.meta.get("val")):
        st = _storage(t)
        if st is not None:
            out.append(canonical.get(st._cdata, st._cdata))
    return out


def state_tensors(*trees) -> list[torch.Tensor]:
    """Every tensor in ``trees`` (modules: parameters and buffers; optimizers: state)."""
    out = []
    for tree in trees:
        if isinstance(tree, torch.nn.Module):
            out += list(tree.parameters()) + list(tree.buffers())
        elif isinstance(tree, torch.optim.Optimizer):
            out += [t for s in tree.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        else:
            out += _tensors(tree)
    return out


def fsdp2_storages(model: torch.nn.Module) -> list[torch.Tensor]:
    """FSDP2's unsharded-parameter storages in ``model`` (allocated and freed by resizing,
    outside any op, so ``PeakMemory`` must be told of them to count an eager FSDP2 step)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for p in group.fsdp_params if group else ():
                out += list(p.all_gather_outputs)
    return out


class PeakMemory(TorchDispatchMode):
    """Measure peak live storage bytes of the code run inside ``with PeakMemory(watch) as m:``.

    ``watch``: tensors alive before the step that count throughout (state, batch, and any
    storage the step resizes in place). ``m.peak`` is the result, ``m.baseline`` the watched
    bytes when the step began.
    """

    def __init__(self, watch: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._watched: dict[int, torch.UntypedStorage] = {}
        for t in watch:
            st = _storage(t)
            if st is not None:
                self._watched[st._cdata] = st
        self._created: dict[int, int] = {}  # storage id -> bytes, while alive
        self._refs: dict[int, weakref.ref] = {}
        self.baseline = sum(st.nbytes() for st in self._watched.values())
        self.peak = self.baseline

    def _track(self, st) -> None:
        key = st._cdata
        if key in self._watched or key in self._created or st.device.type == "meta":
            return
        self._created[key] = st.nbytes()
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._forget(key))

    def _forget(self, key: int) -> None:
        self._created.pop(key, None)
        self._refs.pop(key, None)

    def live_bytes(self) -> int:
        total = sum(st.nbytes() for st in self._watched.values())
        for ref in list(self._refs.values()):
            st = ref()
            if st is not None:
                total += st.nbytes()  # current size: storages can be resized
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            st = _storage(t)
            if st is not None:
                self._track(st)
        self.peak = max(self.peak, self.live_bytes())
        return out
