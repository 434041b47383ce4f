"""`python -m stepcredit ...`: the `stepcredit` command."""

import sys

from stepcredit.cli import main

sys.exit(main())
