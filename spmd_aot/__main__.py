"""``python -m spmd_aot``: the ``spmd-aot`` command line."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
