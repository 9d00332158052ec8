"""``python -m dualvp verify|bench``: the command lives in :mod:`dualvp.tools.cli`."""

from __future__ import annotations

import sys

from .tools.cli import main  # noqa: F401  (also the console script's entry point)

if __name__ == "__main__":
    sys.exit(main())
