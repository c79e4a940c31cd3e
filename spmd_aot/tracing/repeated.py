"""Which blocks of a model repeat, the same model cut to a few of them, and what a trace of it
observes about each block (for ``stamp.py``).

A stack qualifies when one ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict`` holds its
blocks as children ``0, 1, ...``, every block is described identically by the key's
fingerprint (``keying/fingerprint.py``: class, code, attributes, parameter and buffer shapes
and dtypes, hooks), every block's parameters have the same layouts under the plan and none is
shared with anything outside its block, every module of a block takes the tensor-parallel
style its counterpart in block 0 takes, and the plan has no axis that treats blocks apart
(context, expert or pipeline parallel; shard-group patterns). Anything else is traced
whole, and the reason is kept in the entry's statistics.

The cut model is the user's own objects, shortened in place for the duration of a trace: the
container keeps its first blocks, the optimizer's groups and state keep their parameters. The
user's step, closures and schedulers see the same objects they always do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections import defaultdict

import torch
from torch import nn
from torch.fx._lazy_graph_module import _use_lazy_graph_module

from ..parallel.groups import block_prefixes
from ..parallel.plan import Plan
from ..parallel.tp_plan import first_match
import torch.utils._pytree as pytree

from ..entries import gc_pause
from ..state import TrainState
from .optimizers import members
from .stamp import TEMPLATE_DEPTH, BlockLabels, NotRepeatable, Template, signature

__all__ = ["Stack", "find_stack", "cut_to", "BlockRecorder", "NotRepeatable", "stamped"]

MIN_BLOCKS = 10  # below this the traces of three and four blocks cost about what the full trace does


@dataclasses.dataclass
class Stack:
    container: nn.Module
    prefix: str  # FQN prefix of the blocks: "layers." (block i is prefix + str(i))
    depth: int

    def block_of(self, fqn: str) -> int | None:
        if not fqn.startswith(self.prefix):
            return None
        head = fqn[len(self.prefix):].split(".", 1)[0]
        return int(head) if head.isdigit() else None


def find_stack(state, plan: Plan) -> Stack | str | None:
    """The model's stack of identical blocks; a reason (str) when a deep stack does not qualify;
    None when the model has no stack of ``MIN_BLOCKS`` blocks."""
    model = state.model
    by_parent: dict[str, list[str]] = defaultdict(list)
    for path in block_prefixes(model):
        parent, _, name = path.rpartition(".")
        by_parent[parent].append(name)
    if not by_parent:
        return None
    parent, names = max(by_parent.items(), key=lambda kv: len(kv[1]))
    if len(names) < MIN_BLOCKS:
        return None
    if names != [str(i) for i in range(len(names))]:
        return f"the blocks of {parent or 'the model'} are not named 0, 1, ..."
    container = model.get_submodule(parent) if parent else model
    stack = Stack(container, f"{parent}." if parent else "", len(names))
    return _refusal(state, plan, stack) or stack


def _refusal(state, plan: Plan, stack: Stack) -> str | None:
    if plan.cp > 1 or plan.ep > 1 or plan.shard_groups:
        return "the plan has an axis or shard-group patterns that may treat blocks apart"
    if plan.tp_plan:
        apart = _tp_apart(plan, stack)
        if apart:
            return apart
    if state.optim is not None and (len(members(state.optim)) != 1 or "step" in vars(state.optim)):
        return "several optimizers, or an optimizer whose step is wrapped"
    blocks = list(stack.container.children())
    first = _described(blocks[0])
    for i, block in enumerate(blocks[1:], 1):
        if not _alike(first, _described(block), i):
            return f"block {stack.prefix}{i} differs from block {stack.prefix}0 (fingerprint)"
    layouts = defaultdict(list)
    for names, p in state.params:
        blocks_of = {stack.block_of(n) for n in names}
        if len(blocks_of) > 1:
            return f"parameter {names[0]} is shared with another module"
        block = blocks_of.pop()
        if block is not None:
            rest = names[0][len(stack.prefix):].split(".", 1)[1]
            layouts[block].append((rest, plan.layout_for(names[0], p.shape)))
    if any(v != layouts[0] for v in layouts.values()):
        return "the blocks' parameters are laid out differently"
    return None


def _tp_apart(plan: Plan, stack: Stack) -> str | None:
    """Why the tp_plan treats a block apart from block 0, or None: every module of every block
    must take the style its counterpart in block 0 takes (first match wins, as the plan is
    applied), or none when that one takes none. Patterns are matched against the module names,
    not compared as text: ``layers.*.attn.q`` and ``layers.1*.attn.q`` (blocks 1 and 10-19)
    read alike but plan different blocks."""
    def styles(i: int, block: nn.Module) -> dict[str, str | None]:
        head = f"{stack.prefix}{i}"
        out = {}
        for rel, _ in block.named_modules():
            match = first_match(plan.tp_plan, f"{head}.{rel}" if rel else head)
            out[rel] = match and match[1]
        return out

    blocks = list(stack.container.children())
    first = styles(0, blocks[0])
    for i, block in enumerate(blocks[1:], 1):
        other = styles(i, block)
        if other != first:
            rel = next(r for r in [*first, *other] if first.get(r) != other.get(r))
            name = f"{stack.prefix}{i}" + (f".{rel}" if rel else "")
            return (f"the tp_plan treats block {stack.prefix}{i} apart: module {name} takes style "
                    f"{other.get(rel)!r}, its counterpart in block {stack.prefix}0 {first.get(rel)!r}")
    return None


def _described(block: nn.Module):
    from ..keying.fingerprint import Fingerprinter  # keying sits below tracing

    return json.loads(json.dumps(Fingerprinter()._module(block, "block", 0), default=str))


def _alike(first, other, index: int) -> bool:
    """Block ``index``'s description is block 0's, but for integers that are each block's own
    index (transformers' ``layer_idx``, which addresses a KV cache): 0 in block 0, ``index`` here."""
    if isinstance(first, dict) and isinstance(other, dict):
        if first.keys() != other.keys():
            return False
        if first.get("int") == 0 and other.get("int") == index and first.get("type") == other.get("type"):
            return True
        return all(_alike(first[k], other[k], index) for k in first)
    if type(first) is int and type(other) is int:
        return first == other or (first == 0 and other == index)
    if isinstance(first, list) and isinstance(other, list):
        return len(first) == len(other) and all(_alike(a, b, index) for a, b in zip(first, other))
    return first == other


@contextlib.contextmanager
def cut_to(state, stack: Stack, depth: int):
    """The model and optimizer shortened to the first ``depth`` blocks, restored on exit."""
    modules = stack.container._modules
    kept = dict(list(modules.items())[:depth])
    optims = members(state.optim) if state.optim is not None else []
    saved = [([g["params"] for g in o.param_groups], o.state) for o in optims]
    dropped = {id(p) for block in list(modules.values())[depth:] for p in block.parameters()}
    try:
        stack.container._modules = kept
        for o in optims:
            for g in o.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in dropped]
            state_kept = defaultdict(dict)
            state_kept.update({p: s for p, s in o.state.items() if id(p) not in dropped})
            o.state = state_kept
        yield
    finally:
        stack.container._modules = modules
        for o, (params, st) in zip(optims, saved):
            for g, ps in zip(o.param_groups, params):
                g["params"] = ps
            o.state = st


@contextlib.contextmanager
def _last_indices(stack: Stack, depth: int, *, checking: bool):
    """For the check trace (``checking``): blocks 1.. of the cut carry the indices of the stack's
    last blocks in their index attributes, restored on exit.

    Why: blocks may differ only by an integer that is each block's own index (``_alike``:
    transformers' ``layer_idx``), which the stamp assumes the step never reads. A forward that
    does read it (``config.layer_types[self.layer_idx]``, a last-layer special case, a threshold
    past the first blocks) gives the check trace another graph than the stamp of the three-block
    trace, whose blocks carry 0, 1, 2, and the stack is traced whole. An index read only inside
    the blocks the check does not carry (one middle block alone) is not seen."""
    changed = []
    if checking:
        blocks = list(stack.container.children())
        for i, block in enumerate(blocks[1:], 1):
            late = stack.depth - depth + i
            for (_, first), (_, module) in zip(blocks[0].named_modules(), block.named_modules()):
                for name, value in list(vars(module).items()):
                    if type(value) is int and value == i and vars(first).get(name) == 0:
                        changed.append((module, name, value))
                        setattr(module, name, late)
    try:
        yield
    finally:
        for module, name, value in changed:
            setattr(module, name, value)


def _position() -> int:
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    mode = get_proxy_mode()
    return len(mode.tracer.graph.nodes) if mode is not None else -1


class BlockRecorder:
    """While a cut model is traced: where each block's forward and backward began, where its
    parameters' gradients were ready, where the optimizer step began (counts of graph nodes).
    Its hooks return nothing and call no operator, so the traced graph is the same without it."""

    def __init__(self, stack: Stack, depth: int):
        self.stack, self.depth = stack, depth
        self.forward_start: dict[int, int] = {}
        self.forward_end: dict[int, int] = {}
        self.backward_start: dict[int, int] = {}
        self.last_leaf_gradient: dict[int, int] = {}
        self.step_start: int | None = None
        self.repeated_forward: list[int] = []

    @contextlib.contextmanager
    def recording(self):
        handles = []
        for i, block in enumerate(list(self.stack.container.children())[:self.depth]):
            handles.append(block.register_forward_pre_hook(self._before(i), prepend=True))
            handles.append(block.register_forward_hook(self._after(i)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _before(self, i):
        def hook(module, args):
            if i not in self.forward_start:
                self.forward_start[i] = _position()
            elif not self.backward_start:  # called twice in the forward (not a recompute in backward)
                self.repeated_forward.append(i)
        return hook

    def _after(self, i):
        def hook(module, args, output):
            if i in self.forward_end:
                return None
            self.forward_end[i] = _position()
            out = next((t for t in torch.utils._pytree.tree_leaves(output)
                        if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if out is not None:
                out.register_hook(self._gradient_arrived(i))
            return None
        return hook

    def _gradient_arrived(self, i):
        def hook(grad):
            self.backward_start.setdefault(i, _position())
        return hook

    def leaf(self, fqn: str, leaf: torch.Tensor) -> None:
        """Note when the gradient of ``leaf`` (parameter ``fqn``) is stored, if it is a block's."""
        block = self.stack.block_of(fqn)
        if block is None or not leaf.requires_grad:
            return

        def hook(tensor):
            self.last_leaf_gradient[block] = _position()
        leaf.register_post_accumulate_grad_hook(hook)  # after autograd stored it (a detach, for some)

    def step(self) -> None:
        if self.step_start is None:
            self.step_start = _position()

    def labels(self, slots) -> BlockLabels:
        """What was observed, with each graph input's block (``slots``: the cut state's)."""
        if self.repeated_forward:
            from .stamp import NotRepeatable

            raise NotRepeatable(f"block {self.stack.prefix}{self.repeated_forward[0]} runs twice in the forward")
        owners = []
        for s in slots:
            blocks = {self.stack.block_of(n) for n in (s.fqn, *s.aliases)} if s.kind != "hyper" else {None}
            owners.append(blocks.pop() if len(blocks) == 1 else None)
        return BlockLabels(self.stack.prefix, owners, self.forward_start, self.forward_end, self.backward_start,
                           self.last_leaf_gradient, self.step_start)


def stamped(state, plan: Plan, inputs: list, trace_cut):
    """The step's graph for the whole stack, stamped from traces of the model cut to three and
    four blocks (``trace_cut(cut_state, cut_inputs, recorder)`` traces one): (graph, gradient
    collectives, the three-block trace, statistics); a reason (str) when a deep stack cannot be
    stamped; None when the model has none."""
    try:
        stack = find_stack(state, plan)
    except Exception as exc:  # a block the fingerprint cannot describe
        return f"the blocks cannot be compared: {type(exc).__name__}: {exc}"
    if not isinstance(stack, Stack):
        return stack
    full_slots = state.slots()
    index = {s.fqn: i for i, s in enumerate(full_slots)}
    batch = pytree.tree_unflatten(state.batch_leaves, state.batch_spec)
    cuts = []
    try:
        for depth in (TEMPLATE_DEPTH, TEMPLATE_DEPTH + 1):
            # lazy modules: the short traces' graphs are read, never run, so their Python code is
            # never generated (make_fx's module generates and compiles it when made)
            with cut_to(state, stack, depth), _last_indices(stack, depth, checking=depth > TEMPLATE_DEPTH), \
                    _use_lazy_graph_module(True):
                cut = TrainState(state.model, state.optim, batch, plan)
                slots = cut.slots()
                recorder = BlockRecorder(stack, depth)
                traced = trace_cut(cut, [inputs[index[s.fqn]] for s in slots], recorder)
            if traced.untaken:
                raise NotRepeatable("a parameter gets no gradient")
            cuts.append((traced, recorder.labels(slots)))
        (small, labels), (check, _) = cuts
        budget = _budget(small.axis_budget, check.axis_budget, stack.depth)
        with _unprofiled(), gc_pause.paused():  # the stamp keeps what it makes: no garbage cycles to find
            template = Template(small.gm, labels)
            _same(template.stamp(TEMPLATE_DEPTH + 1)[0], check.gm)
            gm, copies = template.stamp(stack.depth)
            _check_inputs(gm, inputs)
            gc_pause.keep()  # a build keeps the stamped graph to its end (entries/gc_pause.py)
    except NotRepeatable as exc:
        return str(exc)
    except Exception as exc:  # the full trace reports a failing step in its own words
        return f"tracing {TEMPLATE_DEPTH} blocks failed: {type(exc).__name__}: {str(exc)[:200]}"
    small.axis_budget = budget  # the template's budget made the whole stack's (the caller reads it there)
    collectives = {}
    by_name = {n.name: n for n in small.gm.graph.nodes}
    for name, fqn in small.gradient_collectives.items():
        for new, ctx in copies.get(by_name[name], ()):
            collectives[new.name] = fqn if ctx is None else _renamed(fqn, stack.prefix, ctx)
    blocks = {"stamped": stack.depth, "traced": [TEMPLATE_DEPTH, TEMPLATE_DEPTH + 1], "prefix": stack.prefix}
    return gm, collectives, small, blocks


def _budget(three: dict[str, int], four: dict[str, int], depth: int) -> dict[str, int]:
    """The collectives the axes' calls may add over ``depth`` blocks, from the traces of three
    and four: what the fourth block added, once per block past the third. Tensor parallel adds
    its collectives per call of a planned module, so each block adds its own; a kind that shrank
    with the blocks means the axes do not treat each block alike, which stamping cannot carry."""
    out = {}
    for kind in sorted(three.keys() | four.keys()):
        per_block = four.get(kind, 0) - three.get(kind, 0)
        if per_block < 0:
            raise NotRepeatable(f"the axes' {kind} collectives shrink with the blocks")
        out[kind] = three.get(kind, 0) + (depth - TEMPLATE_DEPTH) * per_block
    return out


@contextlib.contextmanager
def _unprofiled():
    """The source recorder (``keying/guards.py``, a ``cProfile``) paused while the graph is
    stamped: stamping runs only this package's and ``torch.fx``'s code, which the traces of
    three and four blocks ran (and the key hashes), and the recorder's hook would add about half
    to its cost."""
    import _lsprof

    active = sys.getprofile()
    if not isinstance(active, _lsprof.Profiler):
        yield
        return
    active.disable()
    try:
        yield
    finally:
        active.enable()


def _renamed(fqn: str, prefix: str, ctx) -> str:
    old = f"{prefix}{ctx[0]}."
    return f"{prefix}{ctx[1]}." + fqn[len(old):] if fqn.startswith(old) else fqn


def _same(stamped_gm, traced_gm) -> None:
    """Refuse a template whose four-block stamp is not the four-block trace, naming the first
    difference."""
    a, b = signature(stamped_gm), signature(traced_gm)
    if a == b:
        return
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i >= len(a) or i >= len(b):
        raise NotRepeatable(f"the four-block graph stamped from three has {len(a)} nodes, its trace {len(b)}")
    field = next(f for f, x, y in zip(_FIELDS, a[i], b[i]) if x != y)
    got, want = (str(dict(zip(_FIELDS, row))[field])[:80] for row in (a[i], b[i]))
    raise NotRepeatable(f"the four-block graph stamped from three differs from its trace at node {i} "
                        f"({b[i][1]}): {field} {got} where the trace has {want}")


_FIELDS = ("op", "name", "target", "arguments", "keyword arguments", "values", "collective", "constant")


def _check_inputs(gm, inputs) -> None:
    """The stamped graph's inputs are the step's, in order, shape and dtype (an internal check)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs) or any(
            tuple(p.meta["val"].shape) != tuple(x.shape) or p.meta["val"].dtype != x.dtype
            for p, x in zip(placeholders, inputs)):
        raise NotRepeatable("the stamped graph's inputs are not the step's inputs")
