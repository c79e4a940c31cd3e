"""A pipeline-parallel entry: per stage a forward and a backward graph, and the schedule.

The manifest is the envelope every entry has (``signing`` header, canonical msgpack map whose
``blobs`` names its parts and whose ``key`` is its key), so gc, push/pull, export and signing
treat it as any other entry; its ``kind`` is ``"pipeline"``. Parts are named
``stage<s>.forward``, ``stage<s>.backward`` (graphs as ``serialize.encode_graph`` data, never
code) and ``stage<s>.constants`` (safetensors). The manifest also holds each stage's ports (the
shapes and dtypes of what it takes, sends, saves and receives: the runtime allocates receive
buffers from them, and the load check lays the graphs' inputs out by them), the pipeline with its
schedule as data, and stats.

A rank reads the manifest and only its own stage's parts (``read_stage``): every part is
re-hashed, decoded against the op allowlist and the load limits, and run on meta tensors
shaped by the ports (``validate.check_graph``) before anything runs, as any load is checked.
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import torch

from ..format import bounded, signing
from ..errors import CorruptArtifactError
from ..format.limits import load_limits
from ..format.manifest import decode_manifest
from ..format.serialize import decode_graph, encode_graph

__all__ = ["KIND", "encode_pipeline", "read_pipeline_manifest", "read_stage", "LoadedStage", "is_pipeline_manifest",
           "check_pipeline_blobs", "check_pipeline_entry", "pipeline_manifest_or_none", "read_any_manifest", "backward_inputs"]

KIND = "pipeline"
FORMAT = 1
_PORT_FIELDS = {"name", "shape", "dtype", "grad"}
_GRAPHS = ("forward", "backward")


def encode_pipeline(stages, key, plan: dict, pipeline: dict, stats: dict,
                    group_names: dict[str, int] | None = None) -> dict[str, bytes]:
    """Every blob of a pipeline entry, ``"manifest"`` last. ``stages``: ``tracing.stages.StageGraphs``;
    ``group_names``: the traced process-group name of each mesh dimension the graphs' collectives
    use (tensor parallel inside the stages), stored as the dimension."""
    from safetensors.torch import save as save_safetensors

    blobs: dict[str, bytes] = {}
    described = []
    for st in stages:
        constants = {}
        for part, gm in zip(_GRAPHS, (st.forward, st.backward)):
            blobs[f"stage{st.index}.{part}"] = encode_graph(gm.graph, group_names or {})
            for node in gm.graph.nodes:
                if node.op == "get_attr":
                    value = getattr(gm, node.target)
                    if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
                        raise CorruptArtifactError(
                            f"stage {st.index} {part} graph constant {node.target} has no concrete value (created "
                            "from fake data); register it as a buffer on the module instead")
                    if node.target in constants and not torch.equal(constants[node.target], value):
                        raise CorruptArtifactError(f"stage {st.index}: two graph constants named {node.target}")
                    constants[node.target] = value.detach().cpu().contiguous().clone()
        blobs[f"stage{st.index}.constants"] = save_safetensors(constants)
        described.append({"inputs": [p.to_dict() for p in st.inputs],
                          "outputs": [p.to_dict() for p in st.outputs],
                          "saved": [p.to_dict() for p in st.saved],
                          "stats": st.stats})
    manifest = {
        "format": FORMAT, "kind": KIND, "key": key.key, "ingredients": key.ingredients,
        "ingredient_values": key.values, "plan": plan, "pipeline": pipeline, "stages": described,
        "blobs": {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()},
        "stats": stats, "previous": None,
    }
    blobs["manifest"] = signing.wrap(msgpack.packb(manifest, use_bin_type=True))
    return blobs


def is_pipeline_manifest(manifest) -> bool:
    return isinstance(manifest, dict) and manifest.get("kind") == KIND


def read_pipeline_manifest(store, digest: str) -> dict:
    """The validated pipeline manifest ``digest``; with a signing key set, only a signed one."""
    return _decode_pipeline_manifest(store.get(digest, limit=load_limits().part_bytes), digest)


def read_any_manifest(store, digest: str) -> tuple[dict, bool]:
    """The validated manifest ``digest`` of either kind, its bytes read once, and whether it is a
    pipeline entry's; for the commands that read every kind (``ls``)."""
    from .read import blob_limit, read_blob

    data = read_blob(store, digest, max(blob_limit("manifest"), load_limits().part_bytes), "manifest")
    if _is_pipeline_bytes(data, digest):
        return _decode_pipeline_manifest(data, digest), True
    return decode_manifest(data, digest), False


def _is_pipeline_bytes(data: bytes, digest: str) -> bool:
    limits = load_limits()
    try:
        _, body = signing.split(data, f"manifest {digest[:12]}")
        m = bounded.unpack(body, f"manifest {digest[:12]}", objects=limits.objects, max_array=limits.items,
                           max_map=limits.items)
    except CorruptArtifactError:
        return False
    return is_pipeline_manifest(m)


def _decode_pipeline_manifest(data: bytes | None, digest: str) -> dict:
    limits = load_limits()
    if data is None or hashlib.sha256(data).hexdigest() != digest:
        raise CorruptArtifactError(f"pipeline manifest {digest[:12]} is missing or does not match its digest")
    body = signing.verified_body(data, digest)
    m = bounded.unpack(body, f"manifest {digest[:12]}", objects=limits.objects, max_array=limits.items,
                       max_map=limits.items)
    _check_manifest(m, digest)
    return m


def _check_manifest(m, digest: str) -> None:
    def bad(why):
        raise CorruptArtifactError(f"pipeline manifest {digest[:12]}: {why}")

    if not is_pipeline_manifest(m) or m.get("format") != FORMAT:
        bad(f"not a pipeline entry of format {FORMAT}")
    for field, kind in (("key", str), ("plan", dict), ("pipeline", dict), ("stages", list), ("blobs", dict),
                        ("stats", dict)):
        if not isinstance(m.get(field), kind):
            bad(f"field {field!r} is not a {kind.__name__}")
    stages = m["stages"]
    if not stages or len(stages) != m["pipeline"].get("stages"):
        bad("its stage list does not match its pipeline")
    for s, st in enumerate(stages):
        if not isinstance(st, dict):
            bad(f"stage {s} is not a map")
        for field in ("inputs", "outputs", "saved"):
            ports = st.get(field)
            if not isinstance(ports, list) or not all(_is_port(p) for p in ports):
                bad(f"stage {s} {field} are not ports (name, shape, dtype, grad)")
        for part in (*_GRAPHS, "constants"):
            d = m["blobs"].get(f"stage{s}.{part}")
            if not (isinstance(d, str) and len(d) == 64 and all(c in "0123456789abcdef" for c in d)):
                bad(f"stage {s} has no {part} part")


def _is_port(p) -> bool:
    return (isinstance(p, dict) and set(p) == _PORT_FIELDS and isinstance(p["name"], str) and
            isinstance(p["shape"], list) and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48
                                                 for d in p["shape"]) and len(p["shape"]) <= 64
            and isinstance(p["dtype"], str) and isinstance(getattr(torch, p["dtype"], None), torch.dtype)
            and isinstance(p["grad"], bool))


@dataclasses.dataclass
class LoadedStage:
    index: int
    ports: dict  # the manifest's entry for the stage: inputs, outputs, saved
    forward: list  # decoded, checked nodes
    backward: list
    forward_expected: list  # what the meta check derived for every node (run-time invariants)
    backward_expected: list
    constants: dict[str, torch.Tensor]


def backward_inputs(ports: dict) -> list[dict]:
    """The backward graph's inputs: the saved tensors, then the gradient of each output that has one."""
    return list(ports["saved"]) + [p for p in ports["outputs"] if p["grad"]]


def read_stage(store, manifest: dict, stage: int, device: torch.device, device_type: str = "cpu",
               groups: list[str] | None = None) -> LoadedStage:
    """Stage ``stage``'s parts: re-hashed, decoded against the allowlist and the load limits, and
    run on meta tensors laid out by its ports. ``groups``: the live process-group name of each
    mesh dimension (a collective in a stage graph names its dimension); placeholders by default,
    for checking without process groups."""
    from safetensors.torch import load as load_safetensors

    from ..format.validate import check_graph
    from ..interpreter.invariants import describe

    limits = load_limits()
    ports = manifest["stages"][stage]
    parts = {}
    for part, limit in (("forward", limits.graph_bytes), ("backward", limits.graph_bytes),
                        ("constants", limits.constants_bytes)):
        digest = manifest["blobs"][f"stage{stage}.{part}"]
        data = store.get(digest, limit=limit)
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise CorruptArtifactError(f"pipeline stage {stage} {part} blob {digest[:12]} is missing or corrupt")
        parts[part] = data
    try:
        constants = load_safetensors(parts["constants"])
    except Exception as exc:
        raise CorruptArtifactError(f"pipeline stage {stage} constants unreadable: {exc}") from None
    layouts = {"forward": ports["inputs"], "backward": backward_inputs(ports)}
    decoded, expected = {}, {}
    for part in _GRAPHS:
        if groups is None:
            shape = manifest["plan"].get("mesh_shape")
            groups = [str(d) for d in range(len(shape) if isinstance(shape, list) and len(shape) <= 8 else 0)]
        nodes = decode_graph(parts[part], groups=groups, device=device)
        inputs = [{"local_shape": p["shape"], "dtype": p["dtype"]} for p in layouts[part]]
        values = check_graph(nodes, constants, inputs, device_type=device_type)
        _check_outputs(nodes, values, ports, part, stage)
        decoded[part], expected[part] = nodes, [describe(v) for v in values]
    return LoadedStage(stage, ports, decoded["forward"], decoded["backward"], expected["forward"],
                       expected["backward"], {k: v.to(device) for k, v in constants.items()})


def _check_outputs(nodes, values, ports, part: str, stage: int) -> None:
    """The graph returns what the ports say: the forward its outputs then its saved tensors, the
    backward one gradient (or None) per input, a tensor exactly for those with ``grad``."""
    from ..format.serialize import Ref

    out = nodes[-1].args[0] if nodes and nodes[-1].op == "output" else None
    if not isinstance(out, (list, tuple)):
        raise CorruptArtifactError(f"pipeline stage {stage} {part} graph returns no list")
    if part == "forward":
        want = list(ports["outputs"]) + list(ports["saved"])
        grads = [True] * len(want)
    else:
        want = list(ports["inputs"])
        grads = [p["grad"] for p in want]
    if len(out) != len(want):
        raise CorruptArtifactError(
            f"pipeline stage {stage} {part} graph returns {len(out)} values for {len(want)} ports")
    for o, p, has in zip(out, want, grads):
        value = values[o.index] if isinstance(o, Ref) else None
        if not has:
            if o is not None:
                raise CorruptArtifactError(f"pipeline stage {stage} {part}: port {p['name']} takes no gradient")
            continue
        if not isinstance(value, torch.Tensor) or list(value.shape) != p["shape"] or \
                str(value.dtype).removeprefix("torch.") != p["dtype"]:
            raise CorruptArtifactError(f"pipeline stage {stage} {part}: the value for port {p['name']} is not a "
                                       f"{p['dtype']} tensor of shape {p['shape']}")


def check_pipeline_blobs(blobs: dict[str, bytes]) -> None:
    """Every check a load runs, on every stage of an entry still in memory (a build stores only
    what loads)."""
    from ..store.memory_store import MemoryStore

    named = {hashlib.sha256(data).hexdigest(): data for data in blobs.values()}
    store = MemoryStore(named, root="<pipeline entry being built>")
    digest = hashlib.sha256(blobs["manifest"]).hexdigest()
    manifest = read_pipeline_manifest(store, digest)
    for s in range(len(manifest["stages"])):
        read_stage(store, manifest, s, torch.device("cpu"), manifest["plan"].get("device_type", "cpu"))


def pipeline_manifest_or_none(store, digest: str) -> dict | None:
    """The validated pipeline manifest ``digest``, or None when ``digest`` is another kind of entry
    (which its own reader checks); for the commands that read every kind (``show``, ``ls``, ``verify``)."""
    data = store.get(digest, limit=load_limits().part_bytes)
    if data is None or not _is_pipeline_bytes(data, digest):
        return None
    return _decode_pipeline_manifest(data, digest)


def check_pipeline_entry(store, digest: str) -> dict:
    """Every check a load runs, on every stage of the stored entry ``digest``; its manifest."""
    manifest = read_pipeline_manifest(store, digest)
    for s in range(len(manifest["stages"])):
        read_stage(store, manifest, s, torch.device("cpu"), manifest["plan"].get("device_type", "cpu"))
    return manifest
