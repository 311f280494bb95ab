"""`python -m everystep`: the operations CLI."""

import sys

from everystep.cli import main

sys.exit(main())
