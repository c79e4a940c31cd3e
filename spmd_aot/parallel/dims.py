"""Named mesh dimensions: which roles a configuration's mesh has, in mesh order.

Roles are the names FSDP2's mesh info and torchtitan's ``parallel_dims`` use: ``dp_replicate``
(replicas: DDP, or HSDP's outer dimension), ``dp_shard`` (FSDP shards), ``cp`` (context parallel:
the sequence split) and ``tp`` (tensor parallel). A configuration's mesh lists its data-parallel
roles first and the other axes' roles after, in torchtitan's order
(``(dp_replicate, dp_shard, cp, tp)``), so the stored text form (``mesh_shape`` plus the
placement and plan) names each dimension without storing the names. Only names here: the plan
value imports this module, the axes' mechanics (``axes.py``) import it too.
"""

from __future__ import annotations

__all__ = ["ROLES", "DATA_PARALLEL_ROLES", "BATCH_ROLES", "PLACEMENT_NAMES", "mesh_roles"]

#: Every role, in mesh order.
ROLES = ("dp_replicate", "dp_shard", "cp", "ep", "tp")
DATA_PARALLEL_ROLES = ("dp_replicate", "dp_shard")
#: The roles whose ranks take different batches (split on dim 0): the data-parallel ones and
#: ``ep`` (expert parallel: its ranks exchange tokens with the ranks holding their experts, and
#: average every non-expert gradient as a data-parallel dimension).
BATCH_ROLES = DATA_PARALLEL_ROLES + ("ep",)

#: The data-parallel placements (``data_parallel.PLACEMENTS`` holds their mechanics) and the
#: data-parallel roles each takes, by how many mesh dimensions are left to it once the other
#: axes took theirs. ``replicate`` with none left is an other axis alone (TP alone).
_DP_ROLES = {
    "replicate": {0: (), 1: ("dp_replicate",)},
    "shard": {1: ("dp_shard",), 2: ("dp_replicate", "dp_shard")},
}
PLACEMENT_NAMES = tuple(_DP_ROLES)


def mesh_roles(placement: str, mesh_shape: tuple[int, ...], other_roles: tuple[str, ...]) -> tuple[str, ...] | str:
    """The role of each mesh dimension: the data-parallel ones, then ``other_roles`` (the
    dimensions the other axes take, last); or why ``mesh_shape`` does not fit (a message)."""
    left = len(mesh_shape) - len(other_roles)
    dp = _DP_ROLES[placement].get(left)
    if dp is None or (left == 0 and not other_roles):
        forms = " or ".join(f"({', '.join(roles + other_roles)}{',' if len(roles + other_roles) == 1 else ''})"
                            for roles in _DP_ROLES[placement].values() if roles + other_roles)
        names = {"cp": "context_parallel", "ep": "expert_parallel", "tp": "a tp_plan"}
        others = " and ".join(names.get(r, r) for r in other_roles)
        hint = "" if placement == "shard" else "; 2-D meshes (dp_replicate, dp_shard) are for placement 'shard' (HSDP)"
        return (f"mesh shape {tuple(mesh_shape)} does not fit placement {placement!r}"
                f"{' with ' + others if other_roles else ''}: it takes mesh_shape={forms}{hint}")
    return dp + other_roles
