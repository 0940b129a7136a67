"""`python -m dsjax.cli ...` is the `dsjax` command."""

import sys

from dsjax.cli import main

sys.exit(main())
