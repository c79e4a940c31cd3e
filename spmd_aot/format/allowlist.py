"""Which operator overloads a stored graph may call: a list of overloads, kept as data.

``allowed_ops.txt`` (next to this module) names every overload the tracer emits for the
supported features, plus the communication passes' and common model ops; loading refuses any
other target. A list of namespaces is not enough: ``aten`` also holds ops that apply raw sizes
and strides without bounds checks, build sparse tensors without checking their invariants,
seed the RNG or open files. ``REFUSED`` names those families with the reason; an op matching
one is refused even if someone adds it to the data file (a test checks the file stays clear).

**Opting in to more.** A job that needs an overload the list lacks names it: ``allow_ops=`` on
``spmd_aot.build`` and ``spmd_aot.compile``, ``--allow-op`` on the CLI, or
``SPMD_AOT_ALLOW_OPS`` (comma-separated) in the environment. The opt-in holds for the build or
load it is given to (``opted_in``), never for the refused families, and each name must be an
existing ``namespace::op.overload``. A build records the opted-in overloads its graph calls in the
manifest's stats (``opted_in_ops``); a job that did not opt in to them refuses the entry, so a
writer of the cache cannot widen the list: only the loading job's own opt-in counts. An
opted-in op has no contract of its own (``contracts.py``): the generic checks of every loaded
graph still run, and the user vouches for the rest.

The list is tied to the torch releases it was verified on (``# torch-release: 2.13, 2.14`` in
the file): overload names can change between releases, so a process running another release
logs a warning once and a test checks that every listed overload exists in the running torch.
One list serves both releases because 2.14 renamed no listed overload and its graphs call no
new one (the suite and ``tools/fuzz/fuzz_ops.py`` on 2.14.1); a release that needs a different set
gets its own file, ``allowed_ops-<major.minor>.txt`` next to the shared one. ``choose_list`` is
the one place that decides which file a process uses (and says why): the release's own file when
it exists, else the shared file (silently when its header names the release, with the warning
otherwise).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import pathlib
import re

import torch

__all__ = ["ALLOWED_OPS", "ListChoice", "choose_list", "chosen_list", "load_list", "PYTHON_CALLABLES", "REFUSED",
           "TORCH_RELEASE", "TORCH_RELEASES", "running_release", "ENV_ALLOW_OPS", "refusal", "allowed_ops", "is_allowed",
           "REFUSED_OVERLOADS", "is_opted_in", "opted_in", "opted_in_ops", "opt_in_names", "extra_ops"]

log = logging.getLogger(__name__)

#: Python callables a graph may name (FX uses getitem to unpack multi-output ops).
PYTHON_CALLABLES = ("operator.getitem",)

#: (pattern on the op name, why it is refused). Checked before the list, so the reason is precise.
REFUSED: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), why) for p, why in (
    (r"^(_reshape_alias|set_|_set_.*|_make_per_.*|_mkldnn.*|_copy_from.*)$",
     "builds a view from raw sizes, strides or storage that torch does not bounds-check on every path "
     "(as_strided is allowed: its contract checks the view against its input's storage)"),
    (r"sparse|_coo|_csr|_csc|_bsr|_bsc|to_dense", "builds or reads sparse tensors (invariants unchecked)"),
    (r"nested|_nt_", "builds nested tensors"),
    (r"^(resize_.*|_resize_.*|t_|transpose_|swapdims_|swapaxes_|squeeze_|unsqueeze_|detach_|as_strided_)$",
     "changes a tensor's shape or strides in place (validate.py assumes in-place ops keep metadata; "
     "a build rewrites the common ones to their out-of-place view, passes/inplace_views.py)"),
    (r"^_unsafe(?!_view$)|^_index_put_impl_$|^unsafe_",
     "skips argument checks (_unsafe_view is allowed: it checks the element count)"),
    (r"seed|rng_state|_philox|_fused_rng", "seeds or replaces the random number generator's state"),
    (r"^(from_file|save|load|_print|_assert_async|_functional_assert_async|_assert_scalar)$|file",
     "opens files, prints or asserts on data"),
))


#: Single overloads refused where the rest of their op is allowed: "namespace::op.overload" -> why.
_SCALARS_TENSOR = ("reads the values of its `scalars` tensor in its meta kernel, so the load's check, which runs "
                   "on meta tensors, cannot run it. torch.optim's foreach optimizers call the `.ScalarList` "
                   "overload (a list of floats) when traced, which is allowed; write the step's update that way")
REFUSED_OVERLOADS: dict[str, str] = {
    "aten::_foreach_addcmul_.Tensor": _SCALARS_TENSOR,
    "aten::_foreach_addcdiv_.Tensor": _SCALARS_TENSOR,
}


def refusal(opname: str) -> str | None:
    """Why op ``opname`` (no namespace, no overload) may never be allowed, or None."""
    for pattern, why in REFUSED:
        if pattern.search(opname):
            return why
    return None


def _parse(text: str) -> tuple[str, frozenset]:
    release, ops = "", set()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# torch-release:"):
            release = line.split(":", 1)[1].strip()
        line = line.split("#", 1)[0].strip()
        if line:
            ops.add(line)
    return release, frozenset(ops)


#: Where the shipped lists are: ``allowed_ops.txt`` (shared) and any ``allowed_ops-<release>.txt``.
LIST_DIR = pathlib.Path(__file__).parent
SHARED_LIST = "allowed_ops.txt"


@dataclasses.dataclass(frozen=True)
class ListChoice:
    """The allowlist file a process uses for torch ``release``, and why that one."""
    path: pathlib.Path
    release: str
    why: str
    verified: bool  # False: the list was not made for this release (loading warns once)

    def describe(self) -> str:
        return f"{self.path.name} ({self.why})"

    def identity(self) -> bytes:
        """What of the chosen list a hash takes in (the cache key, the record of passed load
        checks): its file name and its content."""
        return self.path.name.encode() + b"\0" + self.path.read_bytes()


def choose_list(release: str | None = None, directory: pathlib.Path | str | None = None) -> ListChoice:
    """The one place that decides which allowlist file torch ``release`` (default: the running
    one) uses, from the files in ``directory`` (default: this package's)."""
    release = release or running_release()
    directory = pathlib.Path(directory) if directory is not None else LIST_DIR
    own = directory / f"allowed_ops-{release}.txt"
    if own.is_file():
        return ListChoice(own, release, f"torch {release}'s own list", True)
    shared = directory / SHARED_LIST
    header = _parse(shared.read_text())[0]
    if release in _releases(header):
        return ListChoice(shared, release, f"shared list, made for torch {header}", True)
    return ListChoice(shared, release, f"shared list, made for torch {header}, not {release}", False)


@functools.cache
def load_list(release: str, directory: str) -> frozenset:
    """The overloads of the list ``choose_list`` picks; warns once per (release, directory) when
    the list was not made for ``release`` (what is not listed is refused, as always)."""
    choice = choose_list(release, directory)
    if not choice.verified:
        log.warning("the op allowlist %s was not made for torch %s: graphs that call renamed or new "
                    "overloads will be refused", choice.describe(), release)
    return _parse(choice.path.read_text())[1]


def chosen_list() -> ListChoice:
    """The list this process uses (for ``show``/``ops`` and the key)."""
    return choose_list(running_release(), LIST_DIR)


def allowed_ops() -> frozenset:
    """Every allowed overload name, ``"aten::add.Tensor"`` style (read once from the chosen file)."""
    return load_list(running_release(), str(LIST_DIR))


def running_release() -> str:
    """The running torch's ``major.minor`` (what the list's header names)."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def _releases(header: str) -> tuple[str, ...]:
    return tuple(r.strip() for r in header.split(",") if r.strip())


#: The chosen list's header, e.g. ``"2.13, 2.14"`` (a release's own file may name just itself).
TORCH_RELEASE = _parse(chosen_list().path.read_text())[0] or running_release()
#: The releases the chosen list was verified on, e.g. ``("2.13", "2.14")``.
TORCH_RELEASES = _releases(TORCH_RELEASE)
ALLOWED_OPS = allowed_ops()


#: Comma-separated overloads every build and load of this process also admits.
ENV_ALLOW_OPS = "SPMD_AOT_ALLOW_OPS"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")
_OPTED_IN: contextvars.ContextVar[frozenset] = contextvars.ContextVar("spmd_aot_opted_in", default=frozenset())


def opt_in_names(names) -> frozenset:
    """``names`` (an iterable of ``"namespace::op.overload"``, or one comma-separated string) plus
    ``$SPMD_AOT_ALLOW_OPS``, each checked: well formed, an existing overload, not refused."""
    from ..errors import SpmdAotError

    if isinstance(names, str):
        names = names.split(",")
    wanted = [n.strip() for n in [*names, *os.environ.get(ENV_ALLOW_OPS, "").split(",")] if n and n.strip()]
    for name in wanted:
        if not _NAME.match(name):
            raise SpmdAotError(f"allow_ops: {name[:80]!r} is not an operator overload name; expected "
                               "'namespace::op.overload', e.g. 'aten::cumsum.default'")
        namespace, rest = name.split("::")
        op, overload = rest.split(".")
        why = refusal(op) or REFUSED_OVERLOADS.get(name)
        if why:
            raise SpmdAotError(f"allow_ops: {name} can never be allowed: it {why}")
        try:
            getattr(getattr(getattr(torch.ops, namespace), op), overload)
        except (AttributeError, RuntimeError):
            raise SpmdAotError(f"allow_ops: {name} does not exist in torch {torch.__version__}") from None
    return frozenset(wanted) - allowed_ops()


@contextlib.contextmanager
def opted_in(names):
    """While active, the overloads ``names`` (checked by ``opt_in_names``) are allowed too."""
    token = _OPTED_IN.set(_OPTED_IN.get() | opt_in_names(names))
    try:
        yield
    finally:
        _OPTED_IN.reset(token)


def is_allowed(name: str) -> bool:
    """On the list, or opted in by the build or load in progress (never a refused overload)."""
    return (name in allowed_ops() or name in _OPTED_IN.get()) and name not in REFUSED_OVERLOADS


def opted_in_ops() -> frozenset:
    """The overloads the build or load in progress opted in to."""
    return _OPTED_IN.get()


def is_opted_in(name: str) -> bool:
    """Off the list, but opted in by the build or load in progress (it has no contract of its own)."""
    return name not in allowed_ops() and name in _OPTED_IN.get()


def extra_ops(names) -> list[str]:
    """The overloads among ``names`` that only an opt-in allows (what a manifest records)."""
    return sorted(n for n in set(names) if n not in allowed_ops())
