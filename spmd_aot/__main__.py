"""``python -m spmd_aot``: the ``spmd-aot`` command line."""

import sys

from .cli.app import main

if __name__ == "__main__":
    sys.exit(main())
