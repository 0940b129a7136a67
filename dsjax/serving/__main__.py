"""`python -m dsjax.serving [flags]` = `dsjax serve [flags]`."""

import sys

from dsjax.serving.command import main

sys.exit(main(sys.argv[1:]))
