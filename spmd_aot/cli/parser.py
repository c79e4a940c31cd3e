"""The argument parser: every command, its options and their types, in the order `--help` lists them."""

from __future__ import annotations

import argparse

from ..parallel.dims import PLACEMENT_NAMES
from .build import cmd_build, cmd_explain
from .copy import cmd_export, cmd_import, cmd_pull, cmd_push
from .inspect import cmd_ls, cmd_ops, cmd_show, cmd_verify
from .maintenance import cmd_gc, cmd_rm


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
                             "(as $SPMD_AOT_TRUST_CACHE=1; see docs/security.md)")
    common.add_argument("--allow-op", action="append", default=[], metavar="OP",
                        help="also allow operator overload OP ('namespace::op.overload') beyond the op "
                             "allowlist, in builds and loads (repeatable; as $SPMD_AOT_ALLOW_OPS); every job "
                             "loading such an entry must opt in too")
    return common


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
    add_shard_options(p)
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
    add_shard_options(p)
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


def add_shard_options(p) -> None:
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
                        "every ModuleList/Sequential/ModuleDict)")
    p.add_argument("--keep-params-after-forward", action="store_true",
                   help="for placement shard: keep gathered parameters from forward to backward "
                        "(more memory, fewer all_gathers) instead of gathering them again")
    p.add_argument("--tp-plan", action="append", type=_tp_style, default=[], metavar="PATTERN=STYLE",
                   help="tensor parallel on the last mesh dimension: modules whose FQN matches PATTERN "
                        "(fnmatch) run STYLE (colwise, rowwise or a sequence-parallel style, see docs/parallelism.md), "
                        "e.g. 'blocks.*.attn.q=colwise'; or 'hf': a transformers model's own plan "
                        "(config.base_model_tp_plan) "
                        "(repeat for several; first match wins). Without --mesh-shape TP alone over the "
                        "world (placement replicate); with it, TP on its last dimension")
    p.add_argument("--bucket-cap-mb", type=_positive_float, default=25.0, metavar="MIB",
                   help="for placement replicate: gradient bucket size (default 25, as DDP)")
    p.add_argument("--first-bucket-cap-mb", type=_positive_float, default=1.0, metavar="MIB",
                   help="for placement replicate: size of the first gradient bucket (default 1, as DDP)")
    _add_precision_options(p)


def _add_precision_options(p) -> None:
    """A mixed-precision policy (``parallel/mixed_precision.py``, FSDP2's fields), for every placement."""
    from ..parallel.mixed_precision import DTYPES

    names = ", ".join(DTYPES)
    p.add_argument("--param-dtype", choices=list(DTYPES), metavar="DTYPE",
                   help=f"mixed precision: compute in DTYPE ({names}) with fp32 master weights (FSDP2's param_dtype)")
    p.add_argument("--reduce-dtype", choices=list(DTYPES), metavar="DTYPE",
                   help="mixed precision: average gradients in DTYPE (default: the param dtype)")
    p.add_argument("--output-dtype", choices=list(DTYPES), metavar="DTYPE",
                   help="mixed precision: cast the model's floating-point outputs to DTYPE")
    p.add_argument("--no-cast-forward-inputs", action="store_true",
                   help="mixed precision: leave the model's floating-point inputs in their dtype")


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
    from ..parallel.tp_plan import HF_REFUSED_STYLES, HF_STYLE_NAMES, MODEL_PLAN_NAMES, STYLE_NAMES

    if text in MODEL_PLAN_NAMES:
        return text
    return _pattern_pair(text, "STYLE", [*STYLE_NAMES, *HF_STYLE_NAMES, *HF_REFUSED_STYLES])
