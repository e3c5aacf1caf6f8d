"""`python -m dsagen ...`: the `dsagen` command line (dsagen.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
