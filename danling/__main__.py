"""`python -m danling`: the `danling` command (see [`danling.cli`][danling.cli])."""

import sys

from danling.cli import main

if __name__ == "__main__":
    sys.exit(main())
