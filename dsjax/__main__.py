"""`python -m dsjax ...` is the `dsjax` command."""

import sys

from dsjax.cli import main

sys.exit(main())
