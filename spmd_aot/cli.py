"""The ``spmd-aot`` command line: build train steps ahead of time, then list, inspect and verify
the cache they live in.

    spmd-aot build train.py:job --world-size 2 --world-size 8 [--placement replicate] [--device cpu]
    spmd-aot ls
    spmd-aot show 6580734a [--code]
    spmd-aot verify                                     spmd-aot ops
    spmd-aot explain train.py:job --world-size 8 [--placement replicate]
    spmd-aot push [REF...] --to s3://bucket/prefix      spmd-aot pull [REF...] --from s3://bucket/prefix
    spmd-aot export REF... -o bundle.tar                spmd-aot import bundle.tar
    spmd-aot rm REF...                                  spmd-aot gc --max-size 2G --max-age 7d

Every subcommand takes ``--cache-dir`` (default: $SPMD_AOT_CACHE_DIR, else
$XDG_CACHE_HOME/spmd_aot, else ~/.cache/spmd_aot; the same rule the training job uses). A store
URL there works too (``s3://bucket/prefix``, ``memory://NAME``: ``store/registry.py``): ``build``
opens it as a job does (an s3:// bucket behind a local cache, $SPMD_AOT_LOCAL_CACHE, written
through), the other subcommands inspect the store itself.

Exit status (the README's table):
  0    success (``explain``: the configuration is cached)
  1    the answer is no: ``verify`` found problems, ``explain`` found a miss
  2    a usage error or an spmd-aot error, printed as ``error: <message>`` on stderr; a cache
       directory that does not exist is one for every command that reads a cache (``explain``
       answers "miss" instead)
  3    an unexpected internal failure (a bug: the traceback is printed)
  130  interrupted (Ctrl-C)
  141  stdout was closed early (``spmd-aot show REF --code | head``); nothing is printed
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shlex
import sys
import traceback
from typing import Iterable, Sequence

from .allowlist import opted_in
from .errors import CorruptArtifactError, SpmdAotError, TargetError
from .parallel.dims import PLACEMENT_NAMES, cli_fields

__all__ = ["main"]

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR, EXIT_BUG = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_PIPE = 130, 141  # 128 + SIGINT, 128 + SIGPIPE: what a shell reports


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
    except SystemExit as exc:  # --help, --version, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    _configure_logging(args.verbose)
    try:
        with _trusting(args.trust_cache), opted_in(args.allow_op):
            status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at interpreter exit
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except _Failed as exc:
        return exc.status
    except SpmdAotError as exc:
        _error(str(exc))
        return EXIT_ERROR
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except OSError as exc:  # an environment fault (full disk, read-only, permissions): no traceback
        from .errors import os_error

        _error(str(os_error(exc, exc.filename or "the cache directory", "access")))
        return EXIT_ERROR
    except Exception as exc:  # a bug: keep the traceback, still exit cleanly
        traceback.print_exc()
        _error(f"unexpected {type(exc).__name__}: {exc}")
        return EXIT_BUG


@contextlib.contextmanager
def _trusting(trust: bool):
    """``--trust-cache``: ``$SPMD_AOT_TRUST_CACHE=1`` for this command only (store/trust.py)."""
    from .store.trust import ENV_TRUST_CACHE

    saved = os.environ.get(ENV_TRUST_CACHE)
    if trust:
        os.environ[ENV_TRUST_CACHE] = "1"
    try:
        yield
    finally:
        if trust:
            if saved is None:
                os.environ.pop(ENV_TRUST_CACHE, None)
            else:
                os.environ[ENV_TRUST_CACHE] = saved


def _stdout_closed() -> int:
    """The reader of stdout went away (``| head``): stop quietly, as Unix tools do. Later
    writes, including Python's own flush at exit, go to /dev/null instead of raising."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_PIPE


def _configure_logging(verbose: bool) -> None:
    """Library code logs under ``spmd_aot``; the CLI shows its warnings (with -v, INFO too)."""
    logger = logging.getLogger("spmd_aot")
    if verbose:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers:  # the program's own root config wins (and pytest's)
        logging.basicConfig(format="spmd-aot: %(levelname)s: %(message)s", stream=sys.stderr)


def _version() -> str:
    import importlib.metadata

    import torch

    try:
        mine = importlib.metadata.version("spmd-aot")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        mine = "(not installed)"
    return f"spmd-aot {mine} (torch {torch.__version__})"


def _common() -> argparse.ArgumentParser:
    """The options every command takes: where the cache is, how much to log, what to trust."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", metavar="DIR", default=None,
                        help="cache directory (default: $SPMD_AOT_CACHE_DIR, else "
                             "$XDG_CACHE_HOME/spmd_aot, else ~/.cache/spmd_aot)")
    common.add_argument("-v", "--verbose", action="store_true",
                        help="also log INFO lines (keys, hits, misses, timings) to stderr")
    common.add_argument("--trust-cache", action="store_true",
                        help="use a cache directory other users can write, without a signing key "
                             "(as $SPMD_AOT_TRUST_CACHE=1; see the README's threat model)")
    common.add_argument("--allow-op", action="append", default=[], metavar="OP",
                        help="also allow operator overload OP ('namespace::op.overload') beyond the op "
                             "allowlist, in builds and loads (repeatable; as $SPMD_AOT_ALLOW_OPS); every job "
                             "loading such an entry must opt in too")
    return common


def _parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="spmd-aot",
        description="Ahead-of-time compile-and-cache for distributed PyTorch train steps.",
        epilog="Exit status: 0 success; 1 `verify` found problems or `explain` found a miss; 2 a usage "
               "or spmd-aot error (also: the cache directory does not exist); 3 an internal error; "
               "130 interrupted; 141 stdout closed early.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # in the order `spmd-aot --help` lists them
    for add in (_build_command, _inspect_commands, _explain_command, _copy_commands, _maintenance_commands,
                _bundle_commands):
        add(sub, common)
    return parser


def _build_command(sub, common) -> None:
    """``build``: trace configurations into the cache."""
    p = sub.add_parser("build", parents=[common], help="trace a job for some configurations into the cache",
                       description="Build TARGET for every WORLD_SIZE x PLACEMENT; already cached "
                                   "configurations are skipped.")
    p.add_argument("target", metavar="TARGET",
                   help="'pkg.module:job' or 'path/to/file.py:job': a spmd_aot.Job, or a "
                        "zero-argument callable returning one")
    p.add_argument("-w", "--world-size", type=_positive_int, action="append", required=True,
                   metavar="N", help="world size to build for (repeat for several)")
    p.add_argument("-p", "--placement", action="append", choices=sorted(PLACEMENT_NAMES),
                   help="placement to build for (repeat for several; default: replicate)")
    p.add_argument("--device", default="cpu", help="device type the job will run on (default: cpu)")
    p.add_argument("--kernels", action="store_true",
                   help="also compile the graph with Inductor into the entry (jobs pass kernels=True; native "
                        "code: it runs only from a signed entry or a trusted cache)")
    _add_shard_options(p)
    p.set_defaults(func=cmd_build)


def _inspect_commands(sub, common) -> None:
    """``ls``, ``show``, ``verify``, ``ops``: read the cache, change nothing."""
    p = sub.add_parser("ls", parents=[common], help="list the cached artifacts")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", parents=[common], help="describe one cached artifact")
    p.add_argument("ref", metavar="REF", help="a key, a manifest digest, or a unique prefix of either")
    p.add_argument("--code", action="store_true", help="also print the stored graph code")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("verify", parents=[common],
                       help="re-hash every blob and run every load check on every artifact; exit 1 on any problem")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("ops", parents=[common], help="list the operator overloads a stored graph may call (the op allowlist)")
    p.set_defaults(func=cmd_ops)


def _explain_command(sub, common) -> None:
    """``explain``: a job's key looked up without tracing."""
    p = sub.add_parser("explain", parents=[common],
                       help="say whether a job's configuration is cached, and if not, why not",
                       description="Compute TARGET's cache key for one configuration WITHOUT tracing "
                                   "(fake tensors, a second or two) and look it up. Prints 'hit' (exit 0) "
                                   "or 'miss' and which key ingredients differ from the nearest stored "
                                   "artifact (exit 1), e.g. 'parallel' for another world size or 'batch' "
                                   "for other batch shapes.")
    p.add_argument("target", metavar="TARGET", help="as for build: 'pkg.module:job' or 'path/to/file.py:job'")
    p.add_argument("-w", "--world-size", type=_positive_int, required=True, metavar="N",
                   help="world size the job will run at")
    p.add_argument("-p", "--placement", default="replicate", choices=sorted(PLACEMENT_NAMES),
                   help="placement (default: replicate)")
    p.add_argument("--device", default="cpu", help="device type the job will run on (default: cpu)")
    _add_shard_options(p)
    p.set_defaults(func=cmd_explain)


def _copy_commands(sub, common) -> None:
    """``push``, ``pull``: artifacts to and from object storage or another cache."""
    remote_help = ("s3://bucket/prefix (endpoint from $SPMD_AOT_S3_ENDPOINT, else $AWS_ENDPOINT_URL, "
                   "else AWS; credentials as boto3 finds them), or another cache directory")
    p = sub.add_parser("push", parents=[common], help="copy artifacts from the cache to object storage",
                       description="Copy each REF (default: every artifact in the cache) with its "
                                   "manifest and part blobs to the store at --to. Every blob is re-hashed "
                                   "on the way; blobs the destination already holds intact are not sent "
                                   "again; each ref is written after its blobs.")
    p.add_argument("refs", nargs="*", metavar="REF", help="a key, a manifest digest, or a unique prefix "
                                                          "of either (default: all)")
    p.add_argument("--to", required=True, metavar="URL", dest="remote", help=remote_help)
    p.set_defaults(func=cmd_push)

    p = sub.add_parser("pull", parents=[common], help="copy artifacts from object storage into the cache",
                       description="Copy each REF (default: every artifact at --from) with its manifest "
                                   "and part blobs into the cache. Every blob is re-hashed against its "
                                   "name before it is stored; each ref is written after its blobs.")
    p.add_argument("refs", nargs="*", metavar="REF", help="a key, a manifest digest, or a unique prefix "
                                                          "of either, as listed at --from (default: all)")
    p.add_argument("--from", required=True, metavar="URL", dest="remote", help=remote_help)
    p.set_defaults(func=cmd_pull)


def _maintenance_commands(sub, common) -> None:
    """``rm``, ``gc``: remove refs, free blobs."""
    p = sub.add_parser("rm", parents=[common], help="remove artifacts' refs (gc then frees their blobs)",
                       description="Remove each REF from the cache. Its blobs become unreferenced and "
                                   "`spmd-aot gc` deletes them (unless a job is loading them right now).")
    p.add_argument("refs", nargs="+", metavar="REF", help="a key, a manifest digest, or a unique prefix of either")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("gc", parents=[common], help="evict least recently used artifacts, free unreferenced blobs",
                       description="Evict every artifact last used more than --max-age ago, then the least "
                                   "recently used ones until the cache's blobs fit in --max-size, then "
                                   "delete blobs no artifact references. Artifacts a job is loading (a "
                                   "reader lease) are never deleted; while a build runs, unreferenced part "
                                   "blobs are kept for the next gc. Last use: when a job last loaded the "
                                   "artifact, else when it was built or pulled.")
    p.add_argument("--max-size", type=_size, metavar="SIZE",
                   help="bound on the cache's blob bytes, e.g. 500M, 2G, 1.5GiB, 0 (binary units)")
    p.add_argument("--max-age", type=_age, metavar="AGE",
                   help="evict artifacts not used for AGE, e.g. 7d, 12h, 30m, 45s, 2w")
    p.add_argument("--grace", type=_age, default=0.0, metavar="AGE",
                   help="keep unreferenced blobs younger than AGE (for writers that do not take the "
                        "build lock; default 0: every spmd-aot writer takes it)")
    p.add_argument("-n", "--dry-run", action="store_true", help="only report what would be deleted")
    p.set_defaults(func=cmd_gc)


def _bundle_commands(sub, common) -> None:
    """``export``, ``import``: artifacts as one tar file."""
    p = sub.add_parser("export", parents=[common], help="write artifacts to a bundle (tar) file",
                       description="Write each REF with its manifest and part blobs, plus an index, to "
                                   "the tar file -o (.tar.gz/.tgz/.tar.xz are compressed). `spmd-aot "
                                   "import` reads it into another cache.")
    p.add_argument("refs", nargs="+", metavar="REF", help="a key, a manifest digest, or a unique prefix of either")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="bundle file to write")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", parents=[common], help="read a bundle (from `spmd-aot export`) into the cache",
                       description="Check the whole bundle first (every member a plain file named "
                                   "index.json or objects/<sha256>, no paths outside, no links; every blob "
                                   "hashes to its name; every ref names a complete manifest of its key), "
                                   "then store its blobs and refs. Nothing is extracted to the filesystem; a "
                                   "bundle failing any check is refused as a whole.")
    p.add_argument("bundle", metavar="FILE", help="bundle file to read")
    p.set_defaults(func=cmd_import)


def _size(text: str) -> int:
    from .store.gc import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _age(text: str) -> float:
    from .store.gc import parse_age

    try:
        return parse_age(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# ---------------------------------------------------------------------------- build
def _add_shard_options(p) -> None:
    p.add_argument("--mesh-shape", type=_mesh_shape, metavar="RxS",
                   help="for placement shard: a 2-D mesh of R replicas x S shards (HSDP), e.g. 2x4; with "
                        "--tp-plan the last dimension is TP: DPxTP (DDP x TP under replicate, FSDP x TP "
                        "under shard) or RxSxTP (HSDP x TP)")
    p.add_argument("--param-placement", action="append", type=_param_placement, default=[],
                   metavar="PATTERN=PLACEMENT",
                   help="for placement shard: keep parameters whose FQN matches PATTERN (fnmatch) "
                        "whole, e.g. '*.bias=replicate' (repeat for several; first match wins)")
    p.add_argument("--shard-group", action="append", default=[], metavar="PATTERN",
                   help="for placement shard: parameters whose FQN matches PATTERN (fnmatch) form one "
                        "communication group (repeat for several; default: one group per block of "
                        "every ModuleList/Sequential)")
    p.add_argument("--keep-params-after-forward", action="store_true",
                   help="for placement shard: keep gathered parameters from forward to backward "
                        "(more memory, fewer all_gathers) instead of gathering them again")
    p.add_argument("--tp-plan", action="append", type=_tp_style, default=[], metavar="PATTERN=STYLE",
                   help="tensor parallel on the last mesh dimension: modules whose FQN matches PATTERN "
                        "(fnmatch) run STYLE (colwise, rowwise or a sequence-parallel style, see README), "
                        "e.g. 'blocks.*.attn.q=colwise'; or 'hf': a transformers model's own plan "
                        "(config.base_model_tp_plan) "
                        "(repeat for several; first match wins). Without --mesh-shape TP alone over the "
                        "world (placement replicate); with it, TP on its last dimension")
    p.add_argument("--bucket-cap-mb", type=_positive_float, default=25.0, metavar="MIB",
                   help="for placement replicate: gradient bucket size (default 25, as DDP)")
    p.add_argument("--first-bucket-cap-mb", type=_positive_float, default=1.0, metavar="MIB",
                   help="for placement replicate: size of the first gradient bucket (default 1, as DDP)")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _mesh_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a mesh shape like 2x4, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected a mesh shape like 2x4, got {text!r}")
    return shape


def _pattern_pair(text: str, what: str, choices) -> tuple[str, str]:
    """``PATTERN=VALUE`` (the last ``=`` splits) with VALUE one of ``choices``."""
    pattern, sep, value = text.rpartition("=")
    if not sep or not pattern or value not in choices:
        raise argparse.ArgumentTypeError(
            f"expected PATTERN={what} with {what} one of {', '.join(choices)}, got {text!r}")
    return pattern, value


def _param_placement(text: str) -> tuple[str, str]:
    return _pattern_pair(text, "PLACEMENT", PLACEMENT_NAMES)


def _tp_style(text: str) -> tuple[str, str] | str:
    """``PATTERN=STYLE`` (ours or transformers' style names), or ``hf``/``auto``: the model's own plan."""
    from .parallel.tp_plan import HF_REFUSED_STYLES, HF_STYLE_NAMES, MODEL_PLAN_NAMES, STYLE_NAMES

    if text in MODEL_PLAN_NAMES:
        return text
    return _pattern_pair(text, "STYLE", [*STYLE_NAMES, *HF_STYLE_NAMES, *HF_REFUSED_STYLES])


def _tp_plan(entries: list) -> tuple | str:
    """The --tp-plan options as ``Plan`` takes them: pairs, or the model's own plan alone."""
    named = [e for e in entries if isinstance(e, str)]
    if named and len(entries) > 1:
        raise SpmdAotError(f"--tp-plan {named[0]} takes the model's own plan; it cannot be combined with "
                           "other --tp-plan entries")
    return named[0] if named else tuple(entries)


def _plan(args, world_size: int, placement: str):
    """One configuration; a placement's own options (``parallel.dims.cli_fields``) apply to it alone."""
    from .schema import Schema

    options = {"mesh_shape": args.mesh_shape, "param_placements": tuple(args.param_placement),
               "shard_groups": tuple(args.shard_group),
               "reshard_after_forward": not args.keep_params_after_forward}
    own = cli_fields(placement, bool(args.tp_plan))
    schema = Schema(placement, bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=args.first_bucket_cap_mb,
                    tp_plan=_tp_plan(args.tp_plan), **{k: v for k, v in options.items() if k in own})
    return schema.plan(world_size, args.device)


def cmd_build(args) -> int:
    """Build the cross product of world sizes x placements and print one row per config."""
    from .builder import build
    from .progress import Progress

    plans = _unique(_plan(args, w, p) for w in args.world_size for p in (args.placement or ["replicate"]))
    job = _load_job(args.target)
    from .store import local_files, open_store

    store = open_store(args.cache_dir)  # as the job opens it: s3:// behind a local cache, written through
    local = local_files(store)
    if local is not None:
        local.clean_tmp()  # temp files older than an hour, left by killed writers
    results = []
    try:
        with Progress(len(plans)) as bar:
            for plan in plans:
                bar.start(plan.describe())
                result = build(job, plan=plan, store=store, kernels=args.kernels)
                results.append(result)
                bar.finish("built" if result.traced else "cached")
    except (SpmdAotError, OSError) as exc:
        from .errors import os_error

        _print_build_table(results)
        _error(f"{plan.describe()}: {exc if isinstance(exc, SpmdAotError) else os_error(exc, exc.filename, 'write')}")
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

    _cwd_importable()
    try:
        return load_target(target)
    except TargetError as exc:
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, (SpmdAotError, ModuleNotFoundError)):
            traceback.print_exception(type(cause), cause, cause.__traceback__)
        raise


def _cwd_importable() -> None:
    """Make 'module:job' targets importable from the current directory, as under `python -m`
    (the `spmd-aot` script's own sys.path starts with its bin directory instead)."""
    cwd = os.getcwd()
    if not any(entry in ("", ".") or os.path.abspath(entry) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


def _unique(items: Iterable) -> list:
    seen: dict = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)


# ---------------------------------------------------------------------------- ls
def cmd_ls(args) -> int:
    """One row per ref: key, digest, plan, stats and total blob size (damaged ones flagged)."""
    store = _existing_store(args.cache_dir)
    entries = _refs(store)
    root = _cache_root(args.cache_dir)
    if not entries:
        print(f"no artifacts in {root}; build some with: "
              f"spmd-aot build TARGET --world-size N --cache-dir {shlex.quote(str(root))}")
        return EXIT_OK
    rows = []
    for entry in entries:
        rows.append([entry.key[:12], (entry.digest or "?")[:12], *_ls_columns(store, entry)])
    _print_table(["KEY", "DIGEST", "WORLD", "PLACEMENT", "DEVICE", "NODES", "COLLECTIVES", "BYTES"],
                 rows, right={2, 5, 6, 7})
    print(f"{len(entries)} artifact{'s' if len(entries) != 1 else ''} in {root}")
    return EXIT_OK


def _ls_columns(store, entry) -> list:
    from .artifact import blob_list, read_manifest

    if entry.error:
        return [f"CORRUPT: {entry.error}"]
    try:
        manifest = read_manifest(store, entry.digest)
        size = 0
        for name, digest in blob_list(manifest, entry.digest):
            blob_size = store.size(digest)
            if blob_size is None:
                return [f"CORRUPT: {name} blob {digest[:12]} is missing"]
            size += blob_size
    except SpmdAotError as exc:
        return [f"CORRUPT: {exc}"]
    plan, stats = manifest["plan"], manifest["stats"]
    return [plan["world_size"], plan["placement"], plan["device_type"], stats.get("nodes", "?"),
            stats.get("collectives", "?"), size]


# ---------------------------------------------------------------------------- show
def cmd_show(args) -> int:
    """Print one artifact's manifest summary, and with ``--code`` its readable graph code."""
    from .artifact import read_artifact, read_manifest

    store = _existing_store(args.cache_dir)
    key, digest = _resolve_ref(store, args.ref)
    manifest = read_manifest(store, digest)
    _print_manifest(store, key, digest, manifest)
    _print_kernels(store, manifest)
    if args.code:
        code = read_artifact(store, digest).code
        print()
        print("code:")
        print(_safe(code.rstrip("\n"), keep="\n\t"))
    return EXIT_OK


def _print_kernels(store, manifest: dict) -> None:
    """The compiled kernels blob (``kernels.py``), decoded as data: what built it, how much."""
    from .kernels import describe

    status = manifest["stats"].get("kernels")
    if "kernels" not in manifest["blobs"]:
        if status:
            _say(f"kernels:      {status}")
        return
    try:
        d = describe(store.get(manifest["blobs"]["kernels"]), "kernels")
    except SpmdAotError as exc:
        _say(f"kernels:      CORRUPT: {exc}")
        return
    _say(f"kernels:      {d['libraries']} libraries, {_human_bytes(d['bytes'])}, compiled in "
         f"{manifest['stats'].get('kernel_seconds', '?')} s (native code: runs only from a signed entry or a "
         "trusted cache)")
    _say(f"  torch {d['torch']}, {d['cxx']}, cpu capability {d['cpu_capability']}, options {d['options']}")


def _say(*parts) -> None:
    """``print`` for lines made of stored data: escaped (``_safe``)."""
    print(_safe(" ".join(str(p) for p in parts)))


def _safe(text, keep: str = "") -> str:
    """``text`` fit for a terminal: control and format characters (escape sequences, bidi
    overrides, ...) other than those in ``keep`` are shown escaped (``\\x1b``), never sent raw.
    Stored strings come from whoever wrote the cache."""
    import unicodedata

    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c in keep or c.isprintable() or unicodedata.category(c) == "Zs"
                   else c.encode("unicode_escape").decode("ascii") for c in text)


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
        return Plan.from_dict(read_manifest(store, entry.digest)["plan"]).describe()
    except SpmdAotError as exc:
        return f"CORRUPT: {exc}"


def _print_manifest(store, key: str, digest: str, m: dict) -> None:
    """Every line escaped (``_safe``): every field is stored data."""
    from .artifact import blob_list
    from .plan import Plan

    stats = m["stats"]
    plan = Plan.from_dict(m["plan"])
    by_kind = ", ".join(f"{k} {v}" for k, v in sorted((stats.get("by_kind") or {}).items()))
    _say(f"key:          {key}")
    if m["key"] != key:
        _say(f"              (the manifest says key {m['key']})")
    _say(f"digest:       {digest}")
    _say(f"format:       {m['format']}")
    _say(f"plan:         {plan.describe()}")
    for field, value in plan.to_dict().items():
        _say(f"  {field + ':':<24}{value}")
    _say(f"nodes:        {stats.get('nodes', '?')}")
    _say(f"collectives:  {stats.get('collectives', '?')}" + (f" ({by_kind})" if by_kind else ""))
    _say(f"bytes/step:   {stats.get('bytes_per_step', '?')} (each rank sends into collectives)")
    _say(f"trace time:   {stats.get('trace_seconds', '?')} s")
    if "peak_bytes" in stats:
        _say(f"peak memory:  {_human_bytes(stats['peak_bytes'])} of live tensors per rank, estimated from the "
              "graph (inputs, state and intermediates until their last use; tools/bench_memory.py "
              "measures eager FSDP2 the same way)")
    if stats.get("micro_batches", 1) > 1:
        _say(f"micro-batches: {stats['micro_batches']} backward() per optimizer step; gradients accumulate "
             "locally (shard: unsharded, per group) and are reduced once, after the last; their memory is "
             "in the peak above")
    _print_communication(stats.get("comm"))
    _say("blobs:")
    for name, d in blob_list(m, digest):
        blob_size = store.size(d)
        size = "MISSING" if blob_size is None else f"{blob_size} bytes"
        _say(f"  {name:<12}{d}  {size}")
    _say("ingredients:")
    width = max((len(n) for n in m["ingredients"]), default=0) + 2
    for name, d in m["ingredients"].items():
        _say(f"  {name:<{width}}{d}")


def _print_communication(comm) -> None:
    """One row per collective of a step, in issue order: buckets (replicate) and groups (shard).

    The stats are manifest content, so anything malformed is shown as such, not trusted."""
    if not isinstance(comm, list) or not comm:
        return
    _say(f"communication per step ({len(comm)} collectives, in issue order):")
    rows = []
    for entry in comm:
        if not isinstance(entry, dict):
            rows.append(["?", "(malformed entry)", "", ""])
            continue
        params = entry.get("params") if isinstance(entry.get("params"), list) else []
        shown = ", ".join(str(p) for p in params[:4]) + (f", ... (+{len(params) - 4})" if len(params) > 4 else "")
        rows.append([str(entry.get("kind", "?"))[:40], str(entry.get("label", ""))[:60],
                     _human_bytes(entry.get("bytes")), f"{len(params)}: {shown}" if params else ""])
    _print_table(["  KIND", "BUCKET/GROUP", "BYTES", "PARAMS"], [["  " + r[0]] + r[1:] for r in rows],
                 right={2})


def _human_bytes(n) -> str:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


# ---------------------------------------------------------------------------- verify
def cmd_verify(args) -> int:
    """Re-hash every blob, then run every check a load runs on every referenced artifact (read and
    hash every part, decode the graph against the op allowlist and load limits, run it on meta
    tensors against its layout: ``Artifact.check``); exit 1 on any problem.

    Read-only: an artifact whose blobs the re-hash already found damaged is reported without
    being read, since reading a corrupt blob moves it to quarantine/.
    """
    from .artifact import check_entry
    from .lookup import MAX_ENTRIES

    store = _existing_store(args.cache_dir)
    n_blobs = sum(1 for _ in store.blobs())
    blob_problems = store.verify()
    problems = [f"blob {p.digest}: {p.reason} ({p.path})" if p.digest else f"{p.reason} ({p.path})"
                for p in blob_problems]
    bad = {p.digest for p in blob_problems if p.digest}
    reported_paths = {os.path.abspath(p.path) for p in blob_problems}
    try:
        entries = _refs(store)
    except SpmdAotError as exc:  # refs/ cannot be listed at all (e.g. it is a planted link)
        problems.append(str(exc))
        entries = []
    for entry in entries:
        if os.path.abspath(entry.path) in reported_paths:
            continue  # a damaged ref, or one to a missing manifest: store.verify reported it
        if entry.error:
            problems.append(f"ref {entry.key}: {entry.error}")
            continue
        digest, seen = entry.digest, set()
        while digest is not None and digest not in seen and len(seen) < MAX_ENTRIES:  # what lookups walk
            seen.add(digest)
            problem = _entry_problem(store, entry.key, digest, bad, check_entry)
            if problem is not None:
                problems.append(f"artifact {entry.key[:12]} (manifest {digest[:12]}): {problem}")
                break
            digest = _previous(store, digest)  # an older entry gc removed ends the chain, as in lookups
    for line in problems:
        print(_safe(line))
    n = len(problems)
    print(f"{n_blobs} blobs, {len(entries)} artifacts checked, {n} problem{'s' if n != 1 else ''}")
    return EXIT_PROBLEMS if problems else EXIT_OK


def _entry_problem(store, key: str, digest: str, bad: set, check_entry) -> str | None:
    """Why the entry ``digest`` of ``key`` would not load, or None; read-only (a blob the re-hash
    found damaged is reported, not read: reading it would move it to quarantine/)."""
    from .artifact import blob_list, read_manifest

    if digest in bad:
        return "its manifest blob is damaged"
    try:
        damaged = [f"{name} blob {d}" for name, d in blob_list(read_manifest(store, digest), digest)[1:] if d in bad]
        if damaged:
            return f"{', '.join(damaged)} damaged"
        check_entry(store, key, digest)
    except SpmdAotError as exc:
        return str(exc)
    return None


def _previous(store, digest: str) -> str | None:
    from .artifact import read_manifest

    previous = read_manifest(store, digest)["previous"]
    return previous if previous is not None and store.has(previous) else None


def cmd_ops(args) -> int:
    """Print the op allowlist (``spmd_aot/allowed_ops.txt``), one overload per line."""
    from .allowlist import PYTHON_CALLABLES, TORCH_RELEASE, allowed_ops

    ops = sorted(allowed_ops()) + list(PYTHON_CALLABLES)
    print(f"# {len(ops)} call targets a stored graph may name (made for torch {TORCH_RELEASE})")
    for op in ops:
        print(op)
    return EXIT_OK


# ---------------------------------------------------------------------------- explain
def cmd_explain(args) -> int:
    """Compute the key of TARGET for one configuration without tracing; say hit or why not."""
    from .explain import explain_miss
    from .hints import build_command

    plan = _plan(args, args.world_size, args.placement)
    job = _load_job(args.target)
    from .builder import job_key

    key = job_key(job, plan)
    store = _store(args.cache_dir)
    root = _cache_root(args.cache_dir)
    digest = None
    if store is not None:  # a hit needs an entry whose guards hold here, not only a ref
        from .errors import SpmdAotError
        from .lookup import find_entry

        try:
            digest = find_entry(store, key).digest
        except SpmdAotError:
            digest = None
    if digest is not None:
        print(f"hit: {plan.describe()} is cached in {root}")
        print(f"  key     {key.key}")
        print(f"  digest  {digest}")
        return EXIT_OK
    print(f"miss: {plan.describe()} is not cached in {root}")
    print(f"  key     {key.key}")
    why = explain_miss(store, key) if store is not None else f"The cache directory {root} does not exist."
    print(f"  {why}")
    print(f"  build it with: {build_command(plan, target=args.target, cache_dir=root)}")
    return EXIT_PROBLEMS


# ---------------------------------------------------------------------------- push / pull
def cmd_push(args) -> int:
    """Copy artifacts from the cache to a remote store."""
    src = _existing_store(args.cache_dir)
    return _transfer(src, _open_location(args.remote), args.refs, "pushed", "to")


def cmd_pull(args) -> int:
    """Copy artifacts from a remote store into the cache."""
    return _transfer(_open_location(args.remote), _store(args.cache_dir, create=True), args.refs,
                     "pulled", "from")


def _transfer(src, dst, refs: list[str], verb: str, preposition: str) -> int:
    from .store import local_files
    from .store.transfer import copy_artifact

    entries = _select(src, refs)
    remote = dst if verb == "pushed" else src
    if not entries:
        print(f"no artifacts to copy in {src.root}")
        return EXIT_OK
    rows, failures = [], []
    blobs = copied = written = 0
    for key, digest in entries:
        try:
            # into a local cache under the key's build lock, as every writer (gc relies on it)
            with dst.lock(key) if local_files(dst) is not None else contextlib.nullcontext():
                result = copy_artifact(src, dst, key, digest)
        except SpmdAotError as exc:
            failures.append(f"{key[:12]}: {exc}")
            rows.append([key[:12], digest[:12], "-", "-", "-", "FAILED"])
            continue
        blobs, copied, written = blobs + result.blobs, copied + result.copied, written + result.bytes
        rows.append([key[:12], digest[:12], result.blobs, result.copied, result.bytes, "ok"])
    _print_table(["KEY", "DIGEST", "BLOBS", "COPIED", "BYTES", "STATUS"], rows, right={2, 3, 4})
    done = len(entries) - len(failures)
    print(f"{verb} {done} artifact{'s' if done != 1 else ''} {preposition} {remote.root}: "
          f"{copied} of {blobs} blobs copied ({written} bytes), the rest were already there")
    for line in failures:
        _error(line)
    return EXIT_ERROR if failures else EXIT_OK


def _select(store, refs: list[str]) -> list[tuple[str, str]]:
    """(key, digest) for each REF (resolved like `show`), or for every intact ref if none."""
    if not refs:
        entries = _refs(store)
        for e in entries:
            if e.error:
                _error(f"skipping damaged ref {e.key}: {e.error}")
        return [(e.key, e.digest) for e in entries if not e.error]
    return list(dict.fromkeys(_resolve_ref(store, ref) for ref in refs))


def _existing_store(cache_dir):
    """The store at ``cache_dir``; a directory that does not exist is an error (exit 2) for every
    command that reads a cache, so a mistyped path never looks like an empty, healthy cache."""
    store = _store(cache_dir)
    if store is None:
        raise SpmdAotError(f"cache directory {_cache_root(cache_dir)} does not exist; check "
                           "--cache-dir (or $SPMD_AOT_CACHE_DIR), or build into it with `spmd-aot build`")
    return store


# ---------------------------------------------------------------------------- rm / gc
def cmd_rm(args) -> int:
    """Remove refs; their blobs stay until gc (which spares any a job is loading)."""
    from .store.leases import forget_used

    store = _existing_store(args.cache_dir)
    for key, digest in list(dict.fromkeys(_resolve_ref(store, ref) for ref in args.refs)):
        store.delete_ref(key)
        forget_used(store, key)
        print(f"removed {key} (manifest {digest[:12]})")
    print("its blobs stay until `spmd-aot gc` removes them" if len(args.refs) == 1
          else "their blobs stay until `spmd-aot gc` removes them")
    return EXIT_OK


def cmd_gc(args) -> int:
    """Evict by age and LRU under the size bound, then remove unreferenced blobs."""
    import datetime

    from .store.gc import collect_garbage, format_size
    from .store.leases import last_used

    store = _existing_store(args.cache_dir)
    used = {}
    if args.dry_run or args.max_size is not None or args.max_age is not None:
        from .store import local_files

        if local_files(store) is not None:  # else collect_garbage says gc needs a local cache
            used = {key: last_used(store, key) for key in store.refs()}
    report = collect_garbage(store, max_size=args.max_size, max_age=args.max_age, grace=args.grace,
                             dry_run=args.dry_run)
    would = "would be " if report.dry_run else ""
    if report.evicted:
        rows = []
        for key, digest, reason in report.evicted:
            when = used.get(key)
            stamp = (datetime.datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S")
                     if when else "?")
            rows.append([key[:12], digest[:12], reason, stamp])
        print(f"{would}evicted:")
        _print_table(["KEY", "DIGEST", "REASON", "LAST USED"], rows)
    for key in report.skipped_leased:
        print(f"kept {key[:12]}: a job is loading it (reader lease)")
    if report.builds_running:
        print(f"a build is running ({', '.join(k[:12] for k in report.builds_running)}): unreferenced "
              "part blobs are kept until the next gc")
    bound = f" (bound {format_size(args.max_size)})" if args.max_size is not None else ""
    print(f"gc{' (dry run)' if report.dry_run else ''}: {report.artifacts_before} artifacts, "
          f"{format_size(report.bytes_before)} -> {report.artifacts_after} artifacts, "
          f"{format_size(report.bytes_after)}{bound}; {would}removed {report.blobs_removed} blobs "
          f"({format_size(report.bytes_removed)}), kept {report.kept_unreferenced} unreferenced")
    if args.max_size is not None and report.bytes_after > args.max_size and not report.dry_run:
        print("still over the bound: the rest is held by artifacts jobs are loading or by a running build")
    return EXIT_OK


# ---------------------------------------------------------------------------- export / import
def cmd_export(args) -> int:
    from .store.bundle import export_bundle

    store = _existing_store(args.cache_dir)
    refs = dict(_resolve_ref(store, ref) for ref in args.refs)
    summary = export_bundle(store, refs, args.output)
    print(f"exported {len(summary.refs)} artifact{'s' if len(summary.refs) != 1 else ''} "
          f"({summary.blobs} blobs, {summary.bytes} bytes) to {summary.path}")
    for key, digest in summary.refs.items():
        print(f"  {key[:12]}  {digest[:12]}")
    return EXIT_OK


def cmd_import(args) -> int:
    from .store.bundle import import_bundle

    store = _store(args.cache_dir, create=True)
    summary = import_bundle(store, args.bundle)
    print(f"imported {len(summary.refs)} artifact{'s' if len(summary.refs) != 1 else ''} "
          f"({summary.blobs} blobs, {summary.written} new, {summary.bytes} bytes) into {store.root}")
    for key, digest in summary.refs.items():
        print(f"  {key[:12]}  {digest[:12]}")
    return EXIT_OK


# ---------------------------------------------------------------------------- shared helpers
@dataclasses.dataclass
class _Ref:
    key: str
    path: str
    digest: str | None  # None when the ref file is damaged
    error: str | None


def _is_url(cache_dir) -> bool:
    from .store.registry import is_url

    return is_url(cache_dir)


def _cache_root(cache_dir):
    """The location ``--cache-dir`` means (a URL, or the cache directory), as the job resolves it."""
    from .store.registry import resolve_location

    return resolve_location(cache_dir)


def _store(cache_dir, *, create: bool = False):
    """The store at ``cache_dir``; ``None`` when it is a directory that does not exist and
    ``create`` is false (so ``ls`` or ``verify`` on a mistyped path does not create an empty
    cache). A URL gives that store itself (``s3://`` the bucket: ``S3Store``)."""
    from .store import LocalStore

    root = _cache_root(cache_dir)
    if _is_url(root):
        return _open_location(root)
    if not create and not root.is_dir():
        return None
    return LocalStore(root)


def _open_location(location: str):
    """A store URL (``s3://bucket/prefix``: ``S3Store``) or another cache directory."""
    from .store import open_location

    return open_location(location)


def _refs(store) -> list[_Ref]:
    """Every ref, with a damaged one reported in place rather than dropped (``refs()`` skips them)."""
    out = []
    for key in store.ref_keys():
        path = f"{store.root}/refs/{key}"
        try:
            digest = store.get_ref(key)
        except CorruptArtifactError as exc:
            out.append(_Ref(key, path, None, str(exc)))
            continue
        if digest is not None:  # removed since listing
            out.append(_Ref(key, path, digest, None))
    return out


def _print_table(headers: list[str], rows: list[list], right: set[int] = frozenset()) -> None:
    """Print aligned columns; a row shorter than the header has its last cell unpadded. Cells
    are escaped (``_safe``): many hold stored strings."""
    rows = [[_safe(c) for c in r] for r in rows]
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
    print(f"error: {_safe(message, keep=chr(10))}", file=sys.stderr)  # messages quote stored strings


if __name__ == "__main__":
    sys.exit(main())
