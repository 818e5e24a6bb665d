"""`python -m cothink.eval [eval] <suite>|all [options]`."""

import sys

from cothink.eval.cli import main

sys.exit(main())
