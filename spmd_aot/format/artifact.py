"""One stored build: the manifest and the blobs it names.

Every part is a blob named by the sha256 of its bytes; the manifest (itself a blob) lists the
parts' digests, the plan, the key with its ingredients, and stats. A ref maps key -> manifest
digest. Reading re-hashes every blob and validates every field, so a torn, corrupted or
tampered artifact is refused with ``CorruptArtifactError`` before anything runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import msgpack
import torch
import torch.utils._pytree as pytree

from . import bounded
from . import signing
from ..errors import CorruptArtifactError, SpmdAotError
from ..store.faults import crash_point
from ..store.transfer import blob_list
from ..keying.guards import KINDS as GUARD_KINDS, empty as no_guards, is_safe_path
from ..keying.key import CacheKey
from .limits import ENV_LOAD_LIMITS, LoadLimits, load_limits
from ..tracing.numpy_absent import numpy_lookups_skipped
from ..parallel.plan import Plan
from .output_spec import decode_spec, encode_spec
from .serialize import decode_graph, encode_graph, to_fx_graph
from ..state import Slot
from ..store.names import is_digest

__all__ = ["Artifact", "encode_artifact", "store_artifact", "artifact_in_memory", "read_artifact", "read_manifest", "manifest_blobs", "artifact_bytes", "amended",
           "layout_entries", "layout_mismatch", "pack_manifest", "check_entry", "FORMAT", "encode_spec", "decode_spec"]

#: The artifact format (the manifest's ``format``; cache/README.md). 3: the manifest blob is an
#: envelope whose header carries the signature (``signing``), and the output spec is spmd-aot's
#: own (``encode_spec``), not torch's pytree JSON.
FORMAT = 3

_PARTS = ("graph", "code", "schema", "layout", "constants")
#: Parts an entry may hold beside ``_PARTS``: compiled kernels (``kernels.py``: native code,
#: loaded only when trusted, ``kernel_load.py``); the checked program of a signed entry
#: (``program_blob.py``: read only when the manifest's signature was verified).
_OPTIONAL_PARTS = ("kernels", "program")


@dataclasses.dataclass
class Artifact:
    digest: str  # of the manifest
    manifest: dict
    graph: bytes
    code: str
    schema_blob: bytes  # decoded on first use (``schema``): inspection reads it, a load does not
    layout: dict
    constants: dict[str, torch.Tensor]
    spec: pytree.TreeSpec | None = None  # the decoded output spec (``read_artifact`` sets it)
    kernels: bytes | None = None  # the compiled kernels blob, when the entry has one (verified, not decoded)
    program_blob: bytes | None = None  # the ``program`` part, read only when the manifest's signature verified

    @property
    def plan(self) -> Plan:
        p = self.manifest["plan"]
        return plan_from_manifest(p)

    @functools.cached_property
    def schema(self) -> dict:
        """The schema map (per node: placements, parameter names, collectives), for ``show``,
        ``verify`` and tests."""
        return _unpack(self.schema_blob, f"schema of {self.digest[:12]}", load_limits())

    @property
    def slots(self) -> list[dict]:
        return self.layout["inputs"]

    def program(self, groups: list[str], device: torch.device):
        """The graph, validated (allowlist, bounds, layout on meta tensors: ``check``) and bound
        to live groups and device, with what the meta check derived for every node (from the
        run, or from its ``verified`` record), which the program's run-time invariants compare
        the real results with (``runtime/invariants.py``)."""
        from ..runtime.program import Program

        nodes, expected = self._check(groups, device, remember=True)
        return Program(nodes, self.constants_on(device), expected=expected)

    def check(self, groups: list[str] | None = None, device: torch.device | None = None,
              remember: bool = False) -> list:
        """Every check a load runs, without running anything: decode the graph against the op
        allowlist and the load limits, then run it on meta tensors shaped by the layout
        (``validate.check_graph``). Returns the decoded nodes. ``groups`` defaults to
        placeholders (one per mesh dimension), for checking without live process groups.
        ``remember`` (loads, not ``verify``): skip the meta run for an artifact this checker
        passed before, and record a pass (``verified.py``: a per-user record outside the cache)."""
        return self._check(groups, device, remember=remember)[0]

    def _check(self, groups: list[str] | None, device: torch.device | None,
               remember: bool, world: str | None = None) -> tuple[list, list]:
        """``check``'s work: the decoded nodes, and what the meta check derived for every node
        (``invariants.describe`` of its meta result), from the run or from its record.
        ``world``: the name a world group is bound to (``decode_graph``)."""
        from . import verified
        from ..runtime.invariants import describe

        if groups is None:
            groups = [str(d) for d in range(len(self.plan.mesh_shape))] if self.plan.world_size > 1 else []
        # a job's load runs with Python's cyclic collector paused (``runtime/gc_pause.py``)
        with numpy_lookups_skipped():
            nodes = decode_graph(self.graph, groups=groups, device=device or torch.device("cpu"), world=world)
            expected = verified.recall(self.digest) if remember else None
            if expected is None or len(expected) != len(nodes):
                from .validate import check_graph  # only here: a remembered artifact never imports it

                expected = [describe(v) for v in check_graph(nodes, self.constants, self.slots,
                                                                  device_type=self.plan.device_type)]
                if remember:
                    verified.remember(self.digest, expected)
        return nodes, expected

    def graph_module(self, groups: list[str], device: torch.device) -> torch.fx.GraphModule:
        """The same graph as an ``fx.GraphModule``, for inspection (jobs run ``program``)."""
        root = torch.nn.Module()
        for name, tensor in self.constants_on(device).items():
            setattr(root, name, tensor)
        graph = to_fx_graph(self.check(groups, device))
        for node in graph.nodes:
            if node.op == "get_attr" and node.target not in self.constants:
                raise CorruptArtifactError(f"graph reads constant {node.target!r}, which is not stored")
        return torch.fx.GraphModule(root, graph)

    def constants_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The graph's constants on ``device``."""
        return {name: t.to(device) for name, t in self.constants.items()}

    def out_spec(self) -> pytree.TreeSpec:
        """The structure of the step's return value (decoded by ``decode_spec``: nothing imported)."""
        if self.spec is None:
            self.spec = decode_spec(self.layout["outputs"]["spec"], f"artifact {self.digest[:12]}")
        return self.spec


def encode_artifact(traced, key: CacheKey, plan: Plan, slots: list[Slot], stats: dict,
                    guards: dict | None = None, previous: str | None = None) -> dict[str, bytes]:
    """All blobs of one build, ``"manifest"`` last (it names the others by digest).

    ``guards`` (see ``guards.record``) must hold at load for the entry to serve; ``previous``
    is the manifest this entry replaces under the same key (older entries stay reachable).
    """
    import hashlib

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
        "schema": _pack(schema),
        "layout": _pack(layout),
        "constants": save_safetensors(constants),
    }
    manifest = {
        "format": FORMAT,
        "key": key.key,
        "ingredients": key.ingredients,
        "ingredient_values": key.values,
        "plan": plan.to_dict(),
        "blobs": {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()},
        "stats": stats,
        "guards": guards if guards is not None else no_guards(),
        "previous": previous,
    }
    blobs["manifest"] = pack_manifest(manifest)
    return blobs


def amended(blobs: dict[str, bytes], parts: dict[str, bytes], stats: dict) -> dict[str, bytes]:
    """``blobs`` of ``encode_artifact`` with optional ``parts`` added and ``stats`` merged into
    the manifest's, which is packed again (unsigned: ``store_artifact`` signs)."""
    import hashlib

    unknown = set(parts) - set(_OPTIONAL_PARTS)
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not optional parts ({_OPTIONAL_PARTS})")
    manifest = bounded.unpack(signing.split(blobs["manifest"], "manifest")[1], "manifest", objects=1 << 20)
    manifest["stats"].update(stats)
    out = {k: v for k, v in blobs.items() if k != "manifest"}
    for name, data in parts.items():
        manifest["blobs"][name] = hashlib.sha256(data).hexdigest()
        out[name] = data
    out["manifest"] = pack_manifest(manifest)
    return out


def pack_manifest(manifest: dict) -> bytes:
    """An (unsigned) manifest blob: the envelope header, then the canonical msgpack body."""
    return signing.wrap(_pack(manifest))


def store_artifact(store, key: str, blobs: dict[str, bytes]) -> str:
    """Write parts first, manifest next, ref last: a reader never sees a ref to a missing blob.

    With ``SPMD_AOT_SIGNING_KEY`` set the manifest is signed first (see ``signing``).
    """
    for name, data in blobs.items():
        if name != "manifest":
            store.put(data)
    crash_point("artifact.parts_stored")
    manifest = blobs["manifest"]
    key_bytes = signing.signing_key()
    if key_bytes is not None:
        manifest = signing.sign_manifest_blob(manifest, key_bytes)
    digest = store.put(manifest)
    crash_point("artifact.manifest_stored")
    store.set_ref(key, digest)
    crash_point("artifact.ref_set")
    return digest


def artifact_in_memory(blobs: dict[str, bytes]):
    """(manifest digest, MemoryStore) holding a build the cache could not take, signed as
    ``store_artifact`` would sign it, so it loads through the same checks."""
    import hashlib

    from ..store.memory_store import MemoryStore

    blobs = dict(blobs)
    key_bytes = signing.signing_key()
    if key_bytes is not None:
        blobs["manifest"] = signing.sign_manifest_blob(blobs["manifest"], key_bytes)
    named = {hashlib.sha256(data).hexdigest(): data for data in blobs.values()}
    return hashlib.sha256(blobs["manifest"]).hexdigest(), MemoryStore(named, root="<this job's own trace>")


def _get(store, digest: str, limit: int, what: str) -> bytes:
    """A blob's bytes, refused before reading when the store says it is larger than ``limit``
    (and the store's ``get`` reads at most ``limit`` bytes, whatever the file became since)."""
    size = None
    with contextlib.suppress(OSError, SpmdAotError):
        size = store.size(digest)
    data = store.get(digest, limit=limit) if size is None or size <= limit else None
    if data is None or len(data) > limit:
        raise CorruptArtifactError(
            f"{what} blob {digest} is {size if data is None else len(data)} bytes, more than the load "
            f"limit of {limit}; if the artifact is yours, raise it with {ENV_LOAD_LIMITS}")
    return data


def read_manifest(store, digest: str) -> dict:
    """The validated manifest ``digest``; with a signing key set, only a correctly signed one."""
    limits = load_limits()
    data = _get(store, digest, limits.part_bytes, "manifest")
    body = signing.verified_body(data, digest)  # with a key set: before anything is decoded
    manifest = _unpack(body, f"manifest {digest}", limits)
    if not isinstance(manifest, dict):
        raise CorruptArtifactError(f"manifest {digest}: not a map")
    try:
        canonical = _pack(manifest) == body
    except Exception:  # a value msgpack cannot encode back
        canonical = False
    if not canonical:  # one manifest content, one blob (and one digest)
        raise CorruptArtifactError(
            f"manifest {digest} is not in canonical form (msgpack, shortest encodings, as spmd-aot writes "
            "it): another writer re-encoded it; refusing it. Rebuild the artifact.")
    _check_manifest(manifest, digest)
    return manifest


def manifest_blobs(manifest: dict, digest: str) -> list[tuple[str, str]]:
    """The blobs of a decoded ``manifest`` whose digest is ``digest`` (``store.transfer.blob_list``)."""
    return blob_list(manifest["blobs"], digest)


def blob_limit(name: str) -> int:
    """The most bytes a load reads of the part ``name`` (``LoadLimits``): every reader of a
    part caps its read with it, so no blob a writer of the cache swaps in is read unbounded."""
    limits = load_limits()
    return {"graph": limits.graph_bytes, "constants": limits.constants_bytes,
            "kernels": limits.constants_bytes}.get(name, limits.part_bytes)


def artifact_bytes(store, digest: str) -> dict[str, bytes]:
    """Every blob of the artifact whose manifest is ``digest``, by digest (read within its
    part's load limit, not verified)."""
    return {d: _get(store, d, blob_limit(name), name)
            for name, d in manifest_blobs(read_manifest(store, digest), digest)}


def read_artifact(store, digest: str) -> Artifact:
    """Load and verify every blob of the artifact whose manifest is ``digest``."""
    from safetensors.torch import load as load_safetensors

    signed = signing.signing_key() is not None  # then read_manifest verifies the signature
    manifest = read_manifest(store, digest)
    limits = load_limits()
    sizes = {"graph": limits.graph_bytes, "constants": limits.constants_bytes}
    parts = {name: _get(store, manifest["blobs"][name], sizes.get(name, limits.part_bytes), name)
             for name in _PARTS}
    try:
        constants = load_safetensors(parts["constants"])
    except Exception as exc:
        raise CorruptArtifactError(f"artifact {digest[:12]}: constants blob unreadable: {exc}") from None
    try:
        code = parts["code"].decode()
    except UnicodeDecodeError:
        raise CorruptArtifactError(f"artifact {digest[:12]}: code blob is not UTF-8") from None
    layout = _unpack(parts["layout"], f"layout of {digest[:12]}", limits)
    _check_layout(layout, digest, plan_from_manifest(manifest["plan"]).world_size)
    artifact = Artifact(digest, manifest, parts["graph"], code, parts["schema"], layout, constants)
    if "kernels" in manifest["blobs"]:
        artifact.kernels = _get(store, manifest["blobs"]["kernels"], limits.constants_bytes, "kernels")
    if signed and "program" in manifest["blobs"]:  # unsigned: never read, the graph is checked in full
        artifact.program_blob = _get(store, manifest["blobs"]["program"], limits.part_bytes, "program")
    artifact.out_spec()  # parse now: a bad spec is a corrupt artifact, not a failure mid-step
    return artifact


def check_entry(store, key: str, digest: str) -> Artifact:
    """Every check a load runs before it binds live state, for ``spmd-aot verify``: read and
    verify every blob (``read_artifact``), the manifest must be of ``key`` (a ref or ``previous``
    naming another key's manifest is refused), the graph must pass ``Artifact.check`` and a
    kernels blob must be well formed (``kernels_blob.unpack``)."""
    artifact = read_artifact(store, digest)
    artifact.schema  # noqa: B018  (decoded here: a load never reads it, verify must)
    if artifact.manifest["key"] != key:
        raise CorruptArtifactError(f"ref {key[:64]} leads to manifest {digest[:12]}, which is the manifest "
                                   f"of key {artifact.manifest['key'][:64]!r}")
    artifact.check()
    if artifact.kernels is not None:  # decoded as data only (msgpack): compiled code is never run here
        from .kernels_blob import unpack

        unpack(artifact.kernels, f"artifact {digest[:12]}")
    if artifact.program_blob is not None:  # read only when the signature verified
        from . import program_blob

        program_blob.check(artifact)
    return artifact


def _check_layout(layout, digest: str, world_size: int) -> None:
    """Every field the runtime reads, with its type (the blob's hash only proves who wrote it).

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


_LAYOUT_FIELDS = {"kind": str, "fqn": str, "local_shape": list, "dtype": str, "placement": list}


def _is_shape(value) -> bool:
    return (isinstance(value, list) and len(value) <= 64
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in value))


def layout_mismatch(stored: list[dict], live: list[Slot], plan: Plan) -> str | None:
    """Describe the first difference between an artifact's inputs and the live state, or None."""
    if len(stored) != len(live):
        kinds = lambda xs: {k: sum(1 for x in xs if x == k) for k in ("param", "buffer", "optim_state", "batch")}
        return (f"the artifact has {len(stored)} inputs {kinds([s['kind'] for s in stored])}, "
                f"the live job has {len(live)} {kinds([s.kind for s in live])}")
    for s, l in zip(stored, live):
        want = _slot_entry(l, plan)
        for field in ("kind", "fqn", "local_shape", "global_shape", "dtype", "placement"):
            if s.get(field) != _plain(want[field]):
                return (f"input {want['fqn']} ({want['kind']}): expected {field} {s.get(field)} "
                        f"(from the artifact), got {want[field]}")
    return None


def _plain(value):
    """``value`` as msgpack gives it back (tuples become lists), to compare with stored data."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


# ---------------------------------------------------------------------------- helpers
def plan_from_manifest(p: dict) -> Plan:
    return Plan.from_dict(p)


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
        shard_rows = s.layout.shard_rows()
    else:
        placements = ["Replicate()"] * len(plan.mesh_shape)
    return {"kind": s.kind, "fqn": s.fqn, "aliases": list(s.aliases), "global_shape": global_shape,
            "local_shape": local, "shard_rows": shard_rows, "dtype": s.dtype, "device_type": s.device_type,
            "requires_grad": s.requires_grad, "placement": placements}


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


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes, what: str, limits: LoadLimits):
    """A stored document (manifest, layout, schema), decoded within ``limits`` (``bounded``)."""
    return bounded.unpack(data, what, objects=limits.objects, max_array=limits.items, max_map=limits.items)


def _check_manifest(m: Any, digest: str) -> None:
    def bad(why):
        raise CorruptArtifactError(f"manifest {digest}: {why}")

    if not isinstance(m, dict):
        bad("not a map")
    if m.get("format") != FORMAT:
        bad(f"format {str(m.get('format'))[:20]!r}, this spmd-aot reads format {FORMAT}; rebuild the artifact")
    blobs = m.get("blobs")
    if not isinstance(blobs, dict) or not set(_PARTS) <= set(blobs) <= set(_PARTS + _OPTIONAL_PARTS):
        bad(f"blobs must name exactly {list(_PARTS)}, and may name {list(_OPTIONAL_PARTS)}")
    for name, d in blobs.items():
        if not isinstance(d, str) or not is_digest(d):
            bad(f"blob {name} has invalid digest {str(d)[:80]!r}")
    plan = m.get("plan")
    if not isinstance(plan, dict):
        bad("no plan")
    try:
        plan_from_manifest(plan)
    except Exception as exc:
        bad(f"invalid plan {plan!r}: {exc}")
    if not isinstance(plan["device_type"], str):
        bad(f"invalid device type {str(plan['device_type'])[:40]!r}")
    if not isinstance(m.get("key"), str) or not isinstance(m.get("ingredients"), dict):
        bad("no key or ingredients")
    if not all(isinstance(v, str) for v in m["ingredients"].values()):
        bad("ingredients must map names to digests")
    if not isinstance(m.get("ingredient_values", {}), dict):
        bad("ingredient_values must be a map")
    _check_guards(m.get("guards"), bad)
    previous = m.get("previous", False)
    if previous is not None and not (isinstance(previous, str) and is_digest(previous)):
        bad(f"previous must be a manifest digest or nil, got {str(previous)[:80]!r}")
    stats = m.get("stats")
    if not isinstance(stats, dict):
        bad("no stats")
    for name in ("nodes", "collectives", "bytes_per_step", "trace_seconds", "by_kind"):
        if name not in stats:  # the CLI and runtime read these; other fields are free-form
            continue
        value = stats[name]
        ok = (isinstance(value, dict) if name == "by_kind"
              else isinstance(value, (int, float)) and not isinstance(value, bool))
        if not ok:
            bad(f"stats field {name!r} has invalid value {str(value)[:80]!r}")


def _check_guards(guards, bad) -> None:
    """Guards decide whether an entry may serve: every field typed, digests well formed."""
    if not isinstance(guards, dict) or set(guards) != set(GUARD_KINDS):
        bad(f"guards must be a map of exactly {list(GUARD_KINDS)}")
    for kind in GUARD_KINDS:
        entries = guards[kind]
        if not isinstance(entries, list):
            bad(f"guards.{kind} must be a list")
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 2
                    and all(isinstance(x, str) and 0 < len(x) <= 4096 for x in entry)):
                bad(f"guards.{kind} entry {str(entry)[:80]!r} must be two non-empty strings")
            if kind != "distributions" and not is_digest(entry[1]):
                bad(f"guards.{kind} entry {entry[0][:80]!r} has invalid digest {entry[1][:80]!r}")
            if kind == "files" and not is_safe_path(entry[0]):
                bad(f"guard file {entry[0][:80]!r} is not a plain relative path (absolute, empty parts or '..')")
