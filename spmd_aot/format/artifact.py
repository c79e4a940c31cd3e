"""A build as the blobs of an entry, and the checks of a layout read back: no store, no I/O.

Every part is a blob named by the sha256 of its bytes: the graph (``serialize``: msgpack, never
code), its readable code, the schema map (node -> placements), the state layout (every graph
input: kind, FQN, global and local shape, dtype, placement) and the constants (safetensors). The
manifest naming them is ``manifest.py``'s. ``encode_artifact`` makes all of them from a traced
step; ``check_layout`` validates a layout a reader fetched and ``layout_mismatch`` compares one
with the live job's state. Writing the blobs into a store and reading them back is
``entries/``'s.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import bounded
from . import signing
from ..errors import CorruptArtifactError
from .digests import digest_of
from .manifest import FORMAT, OPTIONAL_PARTS, empty_guards, pack, pack_manifest
from .output_spec import decode_spec, encode_spec
from .serialize import encode_graph
from ..parallel.plan import Plan
from ..state import Slot

__all__ = ["encode_artifact", "amended", "check_layout", "layout_entries", "layout_mismatch",
           "FORMAT", "pack_manifest", "encode_spec", "decode_spec"]


def encode_artifact(traced, key: Any, plan: Plan, slots: list[Slot], stats: dict,
                    guards: dict | None = None, previous: str | None = None) -> dict[str, bytes]:
    """All blobs of one build, ``"manifest"`` last (it names the others by digest).

    ``key`` is the job's cache key (``keying.key.CacheKey``: its ``key``, ``ingredients`` and
    ``values`` go into the manifest). ``guards`` (see ``keying.guards.record``) must hold at load
    for the entry to serve; ``previous`` is the manifest this entry replaces under the same key
    (older entries stay reachable).
    """
    from safetensors.torch import save as save_safetensors

    gm = traced.gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(slots):
        raise AssertionError(f"{len(placeholders)} graph inputs for {len(slots)} state slots")
    layout = {
        "inputs": layout_entries(slots, plan),
        "outputs": {"spec": encode_spec(traced.out_spec),
                    "constants": [[i, v] for i, v in sorted(traced.out_constants.items())],
                    "tensors": [_val_entry(v) for v in _output_vals(gm)]},
    }
    left = getattr(traced, "gradients_left", None)
    if left is not None and left.params:  # the graph's last outputs: [param input index, keep .grad]
        layout["outputs"]["gradients"] = [[i, keep] for i, keep in zip(left.params, left.keep)]
    schema = {"mesh_shape": list(plan.mesh_shape),
              "nodes": _schema_map(gm, placeholders, layout["inputs"], traced.group_names)}
    constants = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
                raise CorruptArtifactError(
                    f"graph constant {node.target} has no concrete value (created from fake data); "
                    "register it as a buffer on the module instead"
                )
            constants[node.target] = value.detach().cpu().contiguous().clone()
    header = "\n".join(f"#   {p.name}: {s['kind']} {s['fqn']} local {s['local_shape']} {s['dtype']} {s['placement']}"
                       for p, s in zip(placeholders, layout["inputs"]))
    code = f"# spmd-aot graph for {plan.describe()}\n# inputs:\n{header}\n{gm.code}"
    blobs = {
        "graph": encode_graph(gm.graph, traced.group_names),
        "code": code.encode(),
        "schema": pack(schema),
        "layout": pack(layout),
        "constants": save_safetensors(constants),
    }
    manifest = {
        "format": FORMAT,
        "key": key.key,
        "ingredients": key.ingredients,
        "ingredient_values": key.values,
        "plan": plan.to_dict(),
        "blobs": {name: digest_of(data) for name, data in blobs.items()},
        "stats": stats,
        "guards": guards if guards is not None else empty_guards(),
        "previous": previous,
    }
    blobs["manifest"] = pack_manifest(manifest)
    return blobs


def amended(blobs: dict[str, bytes], parts: dict[str, bytes], stats: dict) -> dict[str, bytes]:
    """``blobs`` of ``encode_artifact`` with optional ``parts`` added and ``stats`` merged into
    the manifest's, which is packed again (unsigned: ``entries.write.store_artifact`` signs)."""
    unknown = set(parts) - set(OPTIONAL_PARTS)
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not optional parts ({OPTIONAL_PARTS})")
    manifest = bounded.unpack(signing.split(blobs["manifest"], "manifest")[1], "manifest", objects=1 << 20)
    manifest["stats"].update(stats)
    out = {k: v for k, v in blobs.items() if k != "manifest"}
    for name, data in parts.items():
        manifest["blobs"][name] = digest_of(data)
        out[name] = data
    out["manifest"] = pack_manifest(manifest)
    return out


def check_layout(layout, digest: str, world_size: int) -> None:
    """A layout read back (``entries/read.py``): every field the runtime reads, with its type (the blob's
    hash only proves who wrote it).

    Sizes are not taken on the layout's word: a global shape may hold at most ``world_size``
    times its local shape's elements (load limits derive from it), and at load every shape is
    compared with the live job's (``layout_mismatch``)."""
    def bad(why):
        raise CorruptArtifactError(f"artifact {digest[:12]}: layout {why}")

    if not isinstance(layout, dict) or not isinstance(layout.get("inputs"), list):
        bad("has no input list")
    for i, entry in enumerate(layout["inputs"]):
        if not isinstance(entry, dict):
            bad(f"input {i} is not a map")
        for field, types in _LAYOUT_FIELDS.items():
            if not isinstance(entry.get(field), types):
                bad(f"input {i} field {field!r} is {type(entry.get(field)).__name__}")
        local, global_ = entry["local_shape"], entry.get("global_shape", entry["local_shape"])
        if not (_is_shape(local) and _is_shape(global_)):
            bad(f"input {i} has a shape that is not a list of at most 64 sizes")
        if math.prod(global_) > math.prod(local) * world_size:
            bad(f"input {i} ({str(entry['fqn'])[:80]}) claims global shape {global_}, more than "
                f"{world_size} ranks x its local shape {local}")
    outputs = layout.get("outputs")
    if not isinstance(outputs, dict) or "spec" not in outputs \
            or not isinstance(outputs.get("constants"), list):
        bad("outputs must give a spec and a constants list")
    for item in outputs["constants"]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)
                and isinstance(item[1], (int, float, bool, str, type(None)))):
            bad(f"output constant {str(item)[:60]!r} is malformed")
    gradients = outputs.get("gradients", [])
    n_params = sum(1 for entry in layout["inputs"] if entry["kind"] == "param")
    if not isinstance(gradients, list) or len(gradients) > n_params:
        bad("output gradients must be a list of at most one per parameter")
    for item in gradients:
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and 0 <= item[0] < n_params
                and isinstance(item[1], bool)):
            bad(f"output gradient {str(item)[:60]!r} is malformed")
    if len({item[0] for item in gradients}) != len(gradients):
        bad("output gradients name a parameter twice")


_LAYOUT_FIELDS = {"kind": str, "fqn": str, "local_shape": list, "dtype": str, "placement": list}


def _is_shape(value) -> bool:
    return (isinstance(value, list) and len(value) <= 64
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in value))


def layout_mismatch(stored: list[dict], live: list[Slot], plan: Plan) -> str | None:
    """Describe the first difference between an artifact's inputs and the live state, or None."""
    if len(stored) != len(live):
        def kinds(xs):
            return {k: sum(1 for x in xs if x == k) for k in ("param", "buffer", "optim_state", "batch")}

        return (f"the artifact has {len(stored)} inputs {kinds([s['kind'] for s in stored])}, "
                f"the live job has {len(live)} {kinds([s.kind for s in live])}")
    for s, slot in zip(stored, live):
        want = _slot_entry(slot, plan)
        for field in ("kind", "fqn", "local_shape", "global_shape", "dtype", "placement"):
            if s.get(field) != _plain(want[field]):
                return (f"input {want['fqn']} ({want['kind']}): expected {field} {s.get(field)} "
                        f"(from the artifact), got {want[field]}")
    return None


def _plain(value):
    """``value`` as msgpack gives it back (tuples become lists), to compare with stored data."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------------- helpers
def layout_entries(slots: list[Slot], plan: Plan) -> list[dict]:
    """The state layout: every graph input in order, as stored and shown to people."""
    return [_slot_entry(s, plan) for s in slots]


def _slot_entry(s: Slot, plan: Plan) -> dict:
    local = list(s.local_shape)
    global_shape = list(s.shape)
    shard_rows = []
    if s.kind == "batch":
        placements = plan.batch_placements()
        global_shape = [local[0] * plan.dp_size] + local[1:] if local else local
    elif s.layout is not None:
        placements = s.layout.placements if plan.world_size > 1 else ["Replicate()"]
        shard_rows = _row_runs(s.layout)
    else:
        placements = ["Replicate()"] * len(plan.mesh_shape)
    return {"kind": s.kind, "fqn": s.fqn, "aliases": list(s.aliases), "global_shape": global_shape,
            "local_shape": local, "shard_rows": shard_rows, "dtype": s.dtype, "device_type": s.device_type,
            "requires_grad": s.requires_grad, "placement": placements}


def _row_runs(layout) -> list[list[int]]:
    """``layout.shard_rows()`` (each shard's real dim-0 rows) as ``[rows, shards]`` runs: full
    shards, then at most one partial, then empty ones. One number per shard made an 80-layer
    AdamW step's layout at world 1024 decode past the load limit on objects; computed from the
    sizes, it also costs no work per rank at build or at each job start (``layout_mismatch``)."""
    if not layout.sharded:
        return []
    chunk, n, shards = layout.local_shape[0], layout.gathered_shape[0], layout.shards
    full = min(shards, n // chunk) if chunk else 0
    partial = n - full * chunk if chunk and full < shards else 0
    runs = [[chunk, full]] if full else []
    if partial:
        runs.append([partial, 1])
    empty = shards - full - (1 if partial else 0)
    if empty:
        runs.append([0, empty])
    return runs


def _output_vals(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in out.args[0]]


def _val_entry(v) -> dict:
    if isinstance(v, torch.Tensor):
        return {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
    return {}


_COLLECTIVE_PLACEMENTS = {  # what each collective does to a DTensor placement
    "all_reduce": ["Partial", "Replicate"],
    "all_gather_into_tensor": ["Shard(0)", "Replicate"],
    "reduce_scatter_tensor": ["Partial", "Shard(0)"],
    "broadcast": ["Replicate", "Replicate"],
}


def _schema_map(gm, placeholders, inputs, traced_groups) -> dict:
    from ..passes import is_collective
    from ..passes.collectives import collective_kind

    mesh = {}
    for p, s in zip(placeholders, inputs):
        mesh[p.name] = {"placements": s["placement"], "fqn": s["fqn"]}
    for node in gm.graph.nodes:
        if is_collective(node):
            op = collective_kind(node)
            reduce = node.args[1] if op in ("all_reduce", "reduce_scatter_tensor") else None
            label = (node.meta.get("comm") or {}).get("label", "")
            mesh[node.name] = {"collective": op, "reduce": reduce, "group": traced_groups.get(node.args[-1]),
                               "placements": _COLLECTIVE_PLACEMENTS.get(op, []), "label": label}
    return mesh
