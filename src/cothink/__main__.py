"""`python -m cothink`: the `cothink` command line."""

import sys

from cothink.cli import main

if __name__ == "__main__":
    sys.exit(main())
