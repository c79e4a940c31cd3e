"""A compiled segment of the step as one native library a job calls without Inductor, and the
proof that a bare call of it is the whole segment.

Why: loading Inductor's saved artifact imports ``torch._inductor`` (1.2-2 s cold) and runs
AOTAutograd's and Inductor's Python around the kernels; a job's first call paid ~1.5 s for it.
Compiled with ``cpp_wrapper``, Inductor writes a whole graph, the calls between kernels too, as
one C++ Python extension module (``PyInit_inductor_entry_cpp``): its one function takes the
inputs as tensor handles (``torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors``) and returns the
outputs' handles. Importing that file is a ``dlopen``.

But what the compile returns is that function wrapped in Python: AOTAutograd's runtime wrappers
(input mutations applied outside the graph, outputs that alias inputs regenerated, deduplicated
inputs, effect tokens, RNG state, subclasses) and Inductor's (constants appended to the inputs,
misaligned inputs copied, scalar outputs turned into Python numbers). The library stands alone
only when none of them does anything for this graph. ``plain_call`` checks that from the
compile's own cache entries, which this build just wrote into its fresh directory (so unpickling
them runs nothing but this process's own output); anything else keeps the entry interpreted.
"""

from __future__ import annotations

import pathlib
import pickle

from ..errors import UnsupportedError

__all__ = ["NotPlain", "library", "plain_call"]


class NotPlain(UnsupportedError):
    """The compiled step needs Inductor's or AOTAutograd's Python around its library."""


def library(cache_dir: pathlib.Path, before: set = frozenset()) -> bytes:
    """The one Python-extension library (``<hash>.main.so``) the compile built in ``cache_dir``
    (the other libraries there are Inductor's vector-ISA probes, not part of the step; files in
    ``before`` are earlier compiles')."""
    found = sorted(p for p in cache_dir.glob("*/*.main.so") if p not in before)
    if len(found) != 1:
        raise NotPlain(f"the compile built {len(found)} wrapper libraries, expected one (cpp_wrapper)")
    source = found[0].with_suffix(".cpp")
    if not source.is_file() or "PyImport_ImportModule" in source.read_text(errors="replace"):
        # an op with no C shim and no boxed call: the library would import torch._inductor.codecache
        raise NotPlain("the library calls an operator back through Inductor's Python (custom_op_wrapper)")
    return found[0].read_bytes()


def plain_call(cache_dir: pathlib.Path, n_inputs: int, before: set = frozenset()) -> tuple[int, list[int]]:
    """(number of outputs, positions of the inputs it writes in place) of the graph compiled into
    ``cache_dir`` (the entries not in ``before``), when calling its library with the ``n_inputs``
    inputs in order is all it does; ``NotPlain`` saying what else it needs."""
    entry = _one_entry(cache_dir / "aotautograd", "AOTAutograd", before)
    graph = _one_entry(cache_dir / "fxgraph", "FX graph", before)
    try:
        needs = _needs(entry, graph, n_inputs)
    except AttributeError as exc:  # another torch release's entries: what a bare call skips is unknown
        raise NotPlain(f"this torch's compile entries lack a field the check reads ({exc})") from exc
    if needs:
        raise NotPlain("the compiled step needs Inductor's Python around it: " + "; ".join(needs))
    written = [i for i, info in enumerate(entry.runtime_metadata.input_info) if info.mutates_data]
    return len(entry.runtime_metadata.output_info), written


def _needs(entry, graph, n_inputs: int) -> list[str]:
    """What AOTAutograd's and Inductor's wrappers would do around the library for this graph."""
    meta = entry.runtime_metadata
    needs = []
    if entry.compiled_bw is not None or entry.maybe_subclass_meta is not None:
        needs.append("a backward or tensor subclasses")
    if any(getattr(w, "needs_post_compile", True) for w in entry.dispatch_wrappers or ()):
        needs.append("deduplicated or synthetic-base inputs")
    if list(entry.indices_of_inps_to_detach or ()):
        needs.append("inputs detached at run time")
    if len(meta.input_info) != n_inputs:
        needs.append(f"{len(meta.input_info)} inputs where the graph has {n_inputs}")
    if meta.num_mutated_inp_runtime_indices:
        needs.append(f"{meta.num_mutated_inp_runtime_indices} input mutations applied outside the graph")
    aliased = [str(o.output_type) for o in meta.output_info if o.output_type.name != "non_alias"]
    if aliased or meta.num_intermediate_bases:
        needs.append(f"outputs that alias inputs or intermediates ({', '.join(aliased)[:120]})")
    if meta.tokens or meta.num_graphsafe_rng_states or getattr(meta, "is_rng_op_functionalized", False):
        needs.append("effect tokens or RNG state")
    if graph.constants or graph.torchbind_constants:
        needs.append(f"{len(graph.constants) + len(graph.torchbind_constants)} constants passed after the inputs")
    if list(graph.inputs_to_check or ()):
        needs.append("inputs Inductor realigns before the call")
    if "return output_tensors\n" not in (graph.source_code or ""):
        needs.append("outputs converted to Python numbers")
    return needs


def _one_entry(folder: pathlib.Path, what: str, before: set):
    found = [p for p in sorted(folder.glob("*/**/*")) if p.is_file() and p not in before]
    if len(found) != 1:
        raise NotPlain(f"the compile wrote {len(found)} {what} cache entries, expected one")
    with open(found[0], "rb") as f:
        return pickle.load(f)  # this build's own output, in its own fresh directory
