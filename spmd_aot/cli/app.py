"""The ``spmd-aot`` command line: build train steps ahead of time, then list, inspect and verify
the cache they live in.

    spmd-aot build train.py:job --world-size 2 --world-size 8 [--placement replicate] [--device cpu]
    spmd-aot ls
    spmd-aot show 6580734a [--code]
    spmd-aot verify                                     spmd-aot ops
    spmd-aot explain train.py:job --world-size 8 [--placement replicate]
    spmd-aot plan train.py:job --world-size 1024 --gpu-memory 80GiB    (what fits: docs/plan.md)
    spmd-aot push [REF...] --to s3://bucket/prefix      spmd-aot pull [REF...] --from s3://bucket/prefix
    spmd-aot export REF... -o bundle.tar                spmd-aot import bundle.tar
    spmd-aot rm REF...                                  spmd-aot gc --max-size 2G --max-age 7d

Every subcommand takes ``--cache-dir`` (default: $SPMD_AOT_CACHE_DIR, else
$XDG_CACHE_HOME/spmd_aot, else ~/.cache/spmd_aot; the same rule the training job uses). A store
URL there works too (``s3://bucket/prefix``, ``memory://NAME``: ``store/registry.py``): ``build``
opens it as a job does (an s3:// bucket behind a local cache, $SPMD_AOT_LOCAL_CACHE, written
through), the other subcommands inspect the store itself.

Exit status (docs/api.md's table):
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

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from ..errors import SpmdAotError
from ..format.allowlist import opted_in
from .parser import parser
from .report import EXIT_BUG, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_PIPE, Failed, error

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    _configure_logging(args.verbose)
    try:
        with _trusting(args.trust_cache), opted_in(args.allow_ops or ()):
            status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not as a traceback at interpreter exit
        return status
    except BrokenPipeError:
        return _stdout_closed()
    except Failed as exc:
        return exc.status
    except SpmdAotError as exc:
        error(str(exc))
        return EXIT_ERROR
    except KeyboardInterrupt:
        error("interrupted")
        return EXIT_INTERRUPTED
    except OSError as exc:  # an environment fault (full disk, read-only, permissions): no traceback
        from ..errors import os_error

        error(str(os_error(exc, exc.filename or "the cache directory", "access")))
        return EXIT_ERROR
    except Exception as exc:  # a bug: keep the traceback, still exit cleanly
        traceback.print_exc()
        error(f"unexpected {type(exc).__name__}: {exc}")
        return EXIT_BUG


@contextlib.contextmanager
def _trusting(trust: bool):
    """``--trust-cache``: ``$SPMD_AOT_TRUST_CACHE=1`` for this command only (store/trust.py)."""
    from ..store.trust import ENV_TRUST_CACHE

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


if __name__ == "__main__":
    sys.exit(main())
