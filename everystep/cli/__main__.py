"""`python -m everystep.cli`: the same as `everystep`."""

import sys

from everystep.cli import main

sys.exit(main())
