"""The ``spmd-aot`` command line: build train steps ahead of time, then list, inspect and verify
the cache they live in.

    spmd-aot build train.py:job --world-size 2 --world-size 8 [--placement replicate] [--device cpu]
    spmd-aot ls
    spmd-aot show 6580734a [--code]
    spmd-aot verify

Every subcommand takes ``--cache-dir`` (default: $SPMD_AOT_CACHE_DIR, else
$XDG_CACHE_HOME/spmd_aot, else ~/.cache/spmd_aot; the same rule the training job uses).

Exit status: 0 success; 1 ``verify`` found problems, or an unexpected internal failure (with a
traceback); 2 a usage error or an spmd-aot error, printed as ``error: <message>`` on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
import traceback
from typing import Iterable, Sequence

from .errors import CorruptArtifactError, SpmdAotError, TargetError

__all__ = ["main"]

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2


class _Failed(Exception):
    """A subcommand failed after reporting why; carries the exit status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


# ---------------------------------------------------------------------------- entry point
def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    try:
        return args.func(args)
    except _Failed as exc:
        return exc.status
    except SpmdAotError as exc:
        _error(str(exc))
        return EXIT_ERROR
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except Exception as exc:  # a bug: keep the traceback, still exit cleanly
        traceback.print_exc()
        _error(f"unexpected {type(exc).__name__}: {exc}")
        return EXIT_PROBLEMS


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", metavar="DIR", default=None,
                        help="cache directory (default: $SPMD_AOT_CACHE_DIR, else "
                             "$XDG_CACHE_HOME/spmd_aot, else ~/.cache/spmd_aot)")
    parser = argparse.ArgumentParser(
        prog="spmd-aot",
        description="Ahead-of-time compile-and-cache for distributed PyTorch train steps.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from .plan import PLACEMENTS

    p = sub.add_parser("build", parents=[common], help="trace a job for some configurations into the cache",
                       description="Build TARGET for every WORLD_SIZE x PLACEMENT; already cached "
                                   "configurations are skipped.")
    p.add_argument("target", metavar="TARGET",
                   help="'pkg.module:job' or 'path/to/file.py:job': a spmd_aot.Job, or a "
                        "zero-argument callable returning one")
    p.add_argument("-w", "--world-size", type=_positive_int, action="append", required=True,
                   metavar="N", help="world size to build for (repeat for several)")
    p.add_argument("-p", "--placement", action="append", choices=sorted(PLACEMENTS),
                   help="placement to build for (repeat for several; default: replicate)")
    p.add_argument("--device", default="cpu", help="device type the job will run on (default: cpu)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("ls", parents=[common], help="list the cached artifacts")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", parents=[common], help="describe one cached artifact")
    p.add_argument("ref", metavar="REF", help="a key, a manifest digest, or a unique prefix of either")
    p.add_argument("--code", action="store_true", help="also print the stored graph code")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("verify", parents=[common],
                       help="re-hash every blob and read every artifact; exit 1 on any problem")
    p.set_defaults(func=cmd_verify)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# ---------------------------------------------------------------------------- build
def cmd_build(args) -> int:
    """Build the cross product of world sizes x placements and print one row per config."""
    from .builder import build
    from .plan import Plan
    from .progress import Progress

    plans = _unique(Plan(w, p, args.device) for w in args.world_size
                    for p in (args.placement or ["replicate"]))
    job = _load_job(args.target)
    store = _store(args.cache_dir, create=True)
    store.clean_tmp()  # temp files older than an hour, left by killed writers
    results = []
    try:
        with Progress(len(plans)) as bar:
            for plan in plans:
                bar.start(plan.describe())
                result = build(job, world_size=plan.world_size, placement=plan.placement,
                               device=plan.device_type, store=store)
                results.append(result)
                bar.finish("built" if result.traced else "cached")
    except SpmdAotError as exc:
        _print_build_table(results)
        _error(f"{plan.describe()}: {exc}")
        raise _Failed(EXIT_ERROR) from exc
    except Exception:
        _print_build_table(results)
        _error(f"building {plan.describe()} failed with an unexpected error (traceback below)")
        raise
    _print_build_table(results)
    return EXIT_OK


def _print_build_table(results) -> None:
    if not results:
        return
    rows = [[r.plan.describe(), r.key[:12], r.digest[:12], r.stats.get("nodes", "?"),
             r.stats.get("collectives", "?"), f"{r.seconds:.2f}", "built" if r.traced else "cached"]
            for r in results]
    _print_table(["CONFIG", "KEY", "DIGEST", "NODES", "COLLECTIVES", "SECONDS", "STATUS"], rows,
                 right={3, 4, 5})


def _load_job(target: str):
    """``load_target``; when the user's own code raised, show its traceback too."""
    from .job import load_target

    try:
        return load_target(target)
    except TargetError as exc:
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, (SpmdAotError, ModuleNotFoundError)):
            traceback.print_exception(type(cause), cause, cause.__traceback__)
        raise


def _unique(items: Iterable) -> list:
    seen: dict = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)


# ---------------------------------------------------------------------------- ls
def cmd_ls(args) -> int:
    """One row per ref: key, digest, plan, stats and total blob size (damaged ones flagged)."""
    store = _store(args.cache_dir)
    entries = _refs(store) if store else []
    root = _cache_root(args.cache_dir)
    if not entries:
        where = root if store else f"{root} (it does not exist)"
        print(f"no artifacts in {where}; build some with: spmd-aot build TARGET --world-size N")
        return EXIT_OK
    rows = []
    for entry in entries:
        rows.append([entry.key[:12], (entry.digest or "?")[:12], *_ls_columns(store, entry)])
    _print_table(["KEY", "DIGEST", "WORLD", "PLACEMENT", "DEVICE", "NODES", "COLLECTIVES", "BYTES"],
                 rows, right={2, 5, 6, 7})
    print(f"{len(entries)} artifact{'s' if len(entries) != 1 else ''} in {root}")
    return EXIT_OK


def _ls_columns(store, entry) -> list:
    from .artifact import read_manifest

    if entry.error:
        return [f"CORRUPT: {entry.error}"]
    try:
        manifest = read_manifest(store, entry.digest)
        size = 0
        for name, digest in [("manifest", entry.digest), *manifest["blobs"].items()]:
            try:
                size += store.blob_path(digest).stat().st_size
            except OSError:
                return [f"CORRUPT: {name} blob {digest[:12]} is missing"]
    except SpmdAotError as exc:
        return [f"CORRUPT: {exc}"]
    plan, stats = manifest["plan"], manifest["stats"]
    return [plan["world_size"], plan["placement"], plan["device_type"], stats.get("nodes", "?"),
            stats.get("collectives", "?"), size]


# ---------------------------------------------------------------------------- show
def cmd_show(args) -> int:
    """Print one artifact's manifest summary, and with ``--code`` its readable graph code."""
    from .artifact import read_artifact, read_manifest

    store = _store(args.cache_dir)
    if store is None:
        raise SpmdAotError(f"no artifact matches {args.ref!r}: cache directory "
                           f"{_cache_root(args.cache_dir)} does not exist")
    key, digest = _resolve_ref(store, args.ref)
    manifest = read_manifest(store, digest)
    _print_manifest(store, key, digest, manifest)
    if args.code:
        code = read_artifact(store, digest).code
        print()
        print("code:")
        print(code.rstrip("\n"))
    return EXIT_OK


def _resolve_ref(store, ref: str) -> tuple[str, str]:
    """The (key, digest) named by a key, a manifest digest, or a unique prefix of either."""
    if not ref:
        raise SpmdAotError("REF is empty: expected a key, a manifest digest, or a prefix of one")
    needle = ref.lower()
    entries = _refs(store)
    matches = [e for e in entries if needle in (e.key.lower(), (e.digest or "").lower())]
    if not matches:
        matches = [e for e in entries if e.key.lower().startswith(needle)
                   or (e.digest or "").lower().startswith(needle)]
    if not matches:
        raise SpmdAotError(
            f"no artifact matches {ref!r} in {store.root}: expected a key, a manifest digest, or a "
            "unique prefix of either; `spmd-aot ls` lists them")
    if len(matches) > 1:
        lines = "\n".join(f"  key {e.key[:16]}  digest {(e.digest or '?')[:16]}  {_describe(store, e)}"
                          for e in matches)
        raise SpmdAotError(f"{ref!r} is ambiguous, it matches {len(matches)} artifacts:\n{lines}\n"
                           "use a longer prefix")
    entry = matches[0]
    if entry.error:
        raise SpmdAotError(entry.error)
    return entry.key, entry.digest


def _describe(store, entry) -> str:
    from .artifact import read_manifest
    from .plan import Plan

    if entry.error:
        return f"CORRUPT: {entry.error}"
    try:
        p = read_manifest(store, entry.digest)["plan"]
        return Plan(p["world_size"], p["placement"], p["device_type"], tuple(p["mesh_shape"])).describe()
    except SpmdAotError as exc:
        return f"CORRUPT: {exc}"


def _print_manifest(store, key: str, digest: str, m: dict) -> None:
    from .plan import Plan

    p, stats = m["plan"], m["stats"]
    plan = Plan(p["world_size"], p["placement"], p["device_type"], tuple(p["mesh_shape"]))
    by_kind = ", ".join(f"{k} {v}" for k, v in sorted((stats.get("by_kind") or {}).items()))
    print(f"key:          {key}")
    if m["key"] != key:
        print(f"              (the manifest says key {m['key']})")
    print(f"digest:       {digest}")
    print(f"format:       {m['format']}")
    print(f"plan:         {plan.describe()}")
    print(f"nodes:        {stats.get('nodes', '?')}")
    print(f"collectives:  {stats.get('collectives', '?')}" + (f" ({by_kind})" if by_kind else ""))
    print(f"bytes/step:   {stats.get('bytes_per_step', '?')} (each rank sends into collectives)")
    print(f"trace time:   {stats.get('trace_seconds', '?')} s")
    print("blobs:")
    for name, d in [("manifest", digest), *m["blobs"].items()]:
        try:
            size = f"{store.blob_path(d).stat().st_size} bytes"
        except OSError:
            size = "MISSING"
        print(f"  {name:<12}{d}  {size}")
    print("ingredients:")
    width = max((len(n) for n in m["ingredients"]), default=0) + 2
    for name, d in m["ingredients"].items():
        print(f"  {name:<{width}}{d}")


# ---------------------------------------------------------------------------- verify
def cmd_verify(args) -> int:
    """Re-hash every blob, then fully read every referenced artifact; exit 1 on any problem.

    Read-only: an artifact whose blobs the re-hash already found damaged is reported without
    being read, since reading a corrupt blob moves it to quarantine/.
    """
    from .artifact import read_artifact, read_manifest

    store = _store(args.cache_dir)
    if store is None:
        print(f"cache directory {_cache_root(args.cache_dir)} does not exist: nothing to verify")
        print("0 blobs, 0 artifacts checked, 0 problems")
        return EXIT_OK
    n_blobs = sum(1 for _ in store.blobs())
    blob_problems = store.verify()
    problems = [f"blob {p.digest}: {p.reason} ({p.path})" if p.digest else f"{p.reason} ({p.path})"
                for p in blob_problems]
    bad = {p.digest for p in blob_problems if p.digest}
    reported_paths = {os.path.abspath(p.path) for p in blob_problems}
    entries = _refs(store)
    for entry in entries:
        if os.path.abspath(entry.path) in reported_paths:
            continue  # a damaged ref, or one to a missing manifest: store.verify reported it
        if entry.error:
            problems.append(f"ref {entry.key}: {entry.error}")
            continue
        where = f"artifact {entry.key[:12]} (manifest {entry.digest[:12]})"
        if entry.digest in bad:
            problems.append(f"{where}: its manifest blob is damaged")
            continue
        try:
            damaged = [f"{name} blob {d}" for name, d in read_manifest(store, entry.digest)["blobs"].items()
                       if d in bad]
            if damaged:
                problems.append(f"{where}: {', '.join(damaged)} damaged")
                continue
            read_artifact(store, entry.digest)
        except SpmdAotError as exc:
            problems.append(f"{where}: {exc}")
    for line in problems:
        print(line)
    n = len(problems)
    print(f"{n_blobs} blobs, {len(entries)} artifacts checked, {n} problem{'s' if n != 1 else ''}")
    return EXIT_PROBLEMS if problems else EXIT_OK


# ---------------------------------------------------------------------------- shared helpers
@dataclasses.dataclass
class _Ref:
    key: str
    path: str
    digest: str | None  # None when the ref file is damaged
    error: str | None


def _cache_root(cache_dir) -> pathlib.Path:
    from .store import resolve_cache_dir

    return resolve_cache_dir(cache_dir)


def _store(cache_dir, *, create: bool = False):
    """The store at ``cache_dir``; ``None`` when it does not exist and ``create`` is false
    (so ``ls`` or ``verify`` on a mistyped path does not create an empty cache)."""
    from .store import LocalStore

    root = _cache_root(cache_dir)
    if not create and not root.is_dir():
        return None
    return LocalStore(root)


def _refs(store) -> list[_Ref]:
    """Every ref, with a damaged one reported in place rather than failing the whole listing
    (``LocalStore.refs()`` raises on the first damaged ref file)."""
    refs_dir = store.root / "refs"
    try:
        names = sorted(e.name for e in os.scandir(refs_dir) if e.is_file() and not e.name.startswith("."))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        try:
            digest = store.get_ref(name)
        except CorruptArtifactError as exc:
            out.append(_Ref(name, str(refs_dir / name), None, str(exc)))
            continue
        except SpmdAotError:
            continue  # not a valid key name: the store ignores such files too
        if digest is not None:
            out.append(_Ref(name, str(refs_dir / name), digest, None))
    return out


def _print_table(headers: list[str], rows: list[list], right: set[int] = frozenset()) -> None:
    """Print aligned columns; a row shorter than the header has its last cell unpadded."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        cells = r if len(r) == len(headers) else r[:-1]
        for i, c in enumerate(cells):
            widths[i] = max(widths[i], len(c))

    def fmt(r):
        out = []
        for i, c in enumerate(r):
            last = i == len(r) - 1
            if last and len(r) < len(headers):
                out.append(c)
            elif i in right:
                out.append(c.rjust(widths[i]))
            else:
                out.append(c if i == len(headers) - 1 else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    print(fmt(headers))
    for r in rows:
        print(fmt(r))


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
