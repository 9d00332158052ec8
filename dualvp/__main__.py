"""The ``dualvp`` command: ``verify`` and ``bench``."""

from __future__ import annotations

import sys

from .cli import main  # noqa: F401  (console script entry point)

if __name__ == "__main__":
    sys.exit(main())
