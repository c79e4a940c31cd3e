"""One stored entry, read and verified: its manifest and parts, checked as a load checks them.

An ``Artifact`` comes from ``read.read_artifact`` (every blob re-hashed, the manifest, layout and
output spec validated). What a load does with it next lives here too: ``check`` decodes the
graph against the op allowlist and the load limits and runs it on meta tensors shaped by the
layout (``format/validate.py``); ``program`` binds the checked graph to live process groups and a
device as the interpreter's ``Program``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from ..errors import CorruptArtifactError
from ..format.limits import load_limits
from ..format.manifest import plan_from_manifest, unpack
from ..format.numpy_absent import numpy_lookups_skipped
from ..format.output_spec import decode_spec
from ..format.serialize import decode_graph, to_fx_graph
from ..parallel.plan import Plan

__all__ = ["Artifact"]


@dataclasses.dataclass
class Artifact:
    digest: str  # of the manifest
    manifest: dict
    _graph: bytes | None  # the parts below: None until first read when ``unread`` can read them
    _code: str | None
    _schema_blob: bytes | None  # decoded on first use (``schema``): inspection reads it, a load does not
    layout: dict
    constants: dict[str, torch.Tensor]
    spec: pytree.TreeSpec | None = None  # the decoded output spec (``read_artifact`` sets it)
    kernels: bytes | None = None  # the compiled kernels blob, when the entry has one (verified, not decoded)
    program_blob: bytes | None = None  # the ``program`` part, read only when the manifest's signature verified
    # reads a part ("graph", "code" or "schema") on first use, verified as ``read_artifact`` verifies
    # it: an entry that loads from its signed program part never needs its graph (``read_artifact``)
    unread: Callable[[str], bytes] | None = None

    def _part(self, name: str, field: str):
        value = getattr(self, field)
        if value is None and self.unread is not None:
            value = self.unread(name)
            if name == "code":
                try:
                    value = value.decode()
                except UnicodeDecodeError:
                    raise CorruptArtifactError(f"artifact {self.digest[:12]}: code blob is not UTF-8") from None
            setattr(self, field, value)
        return value

    @property
    def graph(self) -> bytes:
        """The encoded graph (``format/serialize.py``)."""
        return self._part("graph", "_graph")

    @property
    def code(self) -> str:
        """The graph's readable Python, for people (never run)."""
        return self._part("code", "_code")

    @property
    def schema_blob(self) -> bytes:
        return self._part("schema", "_schema_blob")

    @property
    def plan(self) -> Plan:
        return plan_from_manifest(self.manifest["plan"])

    @functools.cached_property
    def schema(self) -> dict:
        """The schema map (per node: placements, parameter names, collectives), for ``show``,
        ``verify`` and tests."""
        return unpack(self.schema_blob, f"schema of {self.digest[:12]}", load_limits())

    @property
    def slots(self) -> list[dict]:
        return self.layout["inputs"]

    def program(self, groups: list[str], device: torch.device):
        """The graph, validated (allowlist, bounds, layout on meta tensors: ``check``) and bound
        to live groups and device, with what the meta check derived for every node (from the
        run, or from its ``verified`` record), which the program's run-time invariants compare
        the real results with (``interpreter/invariants.py``)."""
        from ..interpreter.program import Program

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
        from ..interpreter.invariants import describe

        if groups is None:
            groups = [str(d) for d in range(len(self.plan.mesh_shape))] if self.plan.world_size > 1 else []
        # a job's load runs with Python's cyclic collector paused (``entries/gc_pause.py``)
        with numpy_lookups_skipped():
            nodes = decode_graph(self.graph, groups=groups, device=device or torch.device("cpu"), world=world)
            expected = verified.recall(self.digest) if remember else None
            if expected is None or len(expected) != len(nodes):
                from ..format.validate import check_graph  # only here: a remembered artifact never imports it

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
