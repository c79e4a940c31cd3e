"""The argument parser: every command, its options and their types, in the order `--help` lists them."""

from __future__ import annotations

import argparse

from .build import cmd_build, cmd_explain
from .copy import cmd_export, cmd_import, cmd_pull, cmd_push
from .inspect import cmd_ls, cmd_ops, cmd_show, cmd_verify
from .maintenance import cmd_gc, cmd_rm
from .option_flags import add_option_flags
from .plan import add_plan_command


def _version() -> str:
    import importlib.metadata

    import torch

    try:
        mine = importlib.metadata.version("spmd-aot")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        mine = "(not installed)"
    return f"spmd-aot {mine} (torch {torch.__version__})"


def _common() -> argparse.ArgumentParser:
    """The options every command takes (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common)
    return common


def _add_common(p, groups: dict | None = None) -> None:
    """How much to log, and the options fields every command reads (where the cache is, what to
    trust: ``RunOptions``, generated)."""
    p.add_argument("-v", "--verbose", action="store_true",
                   help="Also log INFO lines (keys, hits, misses, timings) to stderr.")
    add_option_flags(p, "*", groups=groups, common=True)


def parser() -> argparse.ArgumentParser:
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
    add_plan_command(sub, add_option_flags, _add_common, _positive_int)
    return parser


_BUILD_EXAMPLE = """example:
  spmd-aot build train.py:job -w 8 -p replicate -p shard --mesh-shape 2x4 \\
      --param-placement '*.bias=replicate' --param-dtype bf16 --cache-dir /shared/spmd_aot

  builds job (a spmd_aot.Job in train.py) for 8 ranks twice: replicated (DDP) and sharded as
  2 replicas of 4 shards (HSDP), in bf16; --mesh-shape and --param-placement apply to 'shard'
  alone. A job compiles with the same options (spmd_aot.ParallelOptions, spmd_aot.RunOptions):
  docs/options.md lists them."""


def _build_command(sub, common) -> None:
    """``build``: trace configurations into the cache."""
    p = sub.add_parser("build", help="trace a job for some configurations into the cache",
                       description="Build TARGET for every WORLD_SIZE x PLACEMENT; already cached "
                                   "configurations are skipped.",
                       epilog=_BUILD_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = _target_group(p, "build")
    add_option_flags(p, "build", groups=groups, matrix=("placement",))
    _add_common(p, groups)
    p.set_defaults(func=cmd_build)


def _target_group(p, command: str) -> dict:
    """The job and the configuration's world size and device: what a job's ``compile`` reads from
    its process group and model, so no options field holds them."""
    target = p.add_argument_group("what to build")
    p.add_argument("target", metavar="TARGET",
                   help="'pkg.module:job' or 'path/to/file.py:job': a spmd_aot.Job, or a "
                        "zero-argument callable returning one")
    if command == "build":
        target.add_argument("-w", "--world-size", type=_positive_int, action="append", required=True,
                            metavar="N", help="World size to build for. Repeat for several.")
    else:
        target.add_argument("-w", "--world-size", type=_positive_int, required=True, metavar="N",
                            help="World size the job will run at.")
    target.add_argument("--device", default="cpu", help="Device type the job will run on. Default: cpu.")
    return {target.title: target}


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
    p = sub.add_parser("explain",
                       help="say whether a job's configuration is cached, and if not, why not",
                       description="Compute TARGET's cache key for one configuration WITHOUT tracing "
                                   "(fake tensors, a second or two) and look it up. Prints 'hit' (exit 0) "
                                   "or 'miss' and which key ingredients differ from the nearest stored "
                                   "artifact (exit 1), e.g. 'parallel' for another world size or 'batch' "
                                   "for other batch shapes.")
    groups = _target_group(p, "explain")
    add_option_flags(p, "explain", groups=groups)
    _add_common(p, groups)
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
    from ..store.eviction import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _age(text: str) -> float:
    from ..store.eviction import parse_age

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
