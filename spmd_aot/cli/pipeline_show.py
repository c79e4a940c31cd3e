"""What ``spmd-aot show`` prints for a pipeline-parallel entry: its stages, the schedule as a
text timeline of forwards and backwards per micro-batch per stage, the bubble fraction, and
each stage's estimated peak memory (its parameters and their gradients, the saved activations of
every micro-batch in flight, and the working memory of its graphs)."""

from __future__ import annotations

from .report import human_bytes, say

__all__ = ["print_pipeline", "ls_columns"]


def print_pipeline(store, key: str, digest: str, m: dict) -> None:
    """Every line escaped (``say``): every field is stored data."""
    from ..parallel.pipeline_parallel import Pipeline, timeline

    pipeline, plan, stats = Pipeline.from_dict(m["pipeline"]), m["plan"], m["stats"]
    say(f"key:          {key}")
    say(f"digest:       {digest}")
    say(f"kind:         pipeline (format {m['format']})")
    say(f"plan:         world={plan.get('world_size')} mesh={plan.get('mesh_shape')} roles={plan.get('mesh_roles')} "
        f"{plan.get('device_type')}")
    say(f"pipeline:     {pipeline.describe()}, split before {', '.join(plan.get('split_points', [])) or '-'}")
    say(f"bubble:       {stats.get('bubble_fraction', '?')} of stage time idle (forward and backward of equal length)")
    say(f"trace time:   {stats.get('trace_seconds', '?')} s")
    say("stages:")
    for s, st in enumerate(m["stages"]):
        own = [p for p in st["inputs"] if p["name"].startswith("param:")]
        received = [p for p in st["inputs"] if p["name"].startswith("act:")]
        sent = [p for p in st["outputs"]]
        first, last = (own[0]["name"][6:], own[-1]["name"][6:]) if own else ("-", "-")
        x = st.get("stats", {})
        say(f"  stage {s}: {len(own)} parameters ({first} .. {last}); receives {_ports(received)}; "
            f"sends {_ports(sent)}")
        say(f"    forward {x.get('forward_nodes', '?')} nodes, backward {x.get('backward_nodes', '?')} nodes; "
            f"saves {human_bytes(x.get('saved_bytes_per_microbatch', 0))} per micro-batch, at most "
            f"{x.get('in_flight', '?')} in flight")
        if "peak_bytes" in x:
            say(f"    peak memory {human_bytes(x['peak_bytes'])} (parameters {human_bytes(x.get('state_bytes', 0))}, "
                "their gradients, in-flight activations, graph working memory; optimizer state not counted)")
    on_stage = ", /S: on stage S" if pipeline.stages_per_rank > 1 else ""
    say(f"schedule (F: forward, B: backward of micro-batch N{on_stage}; '.': idle):")
    for line in timeline(pipeline):
        say(f"  {line}")
    say("blobs:")
    for name, d in sorted(m["blobs"].items()):
        size = store.size(d)
        say(f"  {name:<18}{d}  {'MISSING' if size is None else f'{size} bytes'}")


def _ports(ports) -> str:
    if not ports:
        return "nothing"
    return ", ".join(f"{p['name'].split(':', 1)[-1]} {p['dtype']}{p['shape']}" for p in ports)


def ls_columns(m: dict, size: int) -> list:
    plan, stats = m["plan"], m["stats"]
    nodes = sum(st.get("stats", {}).get("forward_nodes", 0) + st.get("stats", {}).get("backward_nodes", 0)
                for st in m["stages"])
    return [plan.get("world_size"), f"pp{len(m['stages'])} {stats.get('schedule', '')}", plan.get("device_type"),
            nodes, 0, size]
