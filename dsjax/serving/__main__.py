"""`python -m dsjax.serving [flags]` = `dsjax serve [flags]`."""

import sys

from dsjax.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
