"""`python -m minidsa ...` is `minidsa ...`."""

import sys

from minidsa.cli import main

sys.exit(main())
