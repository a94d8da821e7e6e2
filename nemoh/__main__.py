"""python -m nemoh: the command line (nemoh.cli)."""

import sys

from nemoh.cli import main

if __name__ == "__main__":
    sys.exit(main())
