"""`python -m flows.cli`: the `r1flow` command."""

import sys

from flows.cli import main

if __name__ == "__main__":  # importing this module (tests/test_imports.py) runs nothing
    sys.exit(main())
