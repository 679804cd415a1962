"""`python -m pplab` is the `pplab` command."""

import sys

from pplab.cli import main

sys.exit(main())
