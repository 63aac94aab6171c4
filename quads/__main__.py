"""``python -m quads``: the ``quads`` console script (:mod:`quads.cli`)."""

import sys

from quads.cli import main

if __name__ == "__main__":  # importing the module (e.g. walking the package) runs nothing
    sys.exit(main())
