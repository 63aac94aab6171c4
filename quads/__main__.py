"""``python -m quads``: the ``quads`` console script (:mod:`quads.cli`)."""

import sys

from quads.cli import main

sys.exit(main())
