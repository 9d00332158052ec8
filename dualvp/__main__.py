"""``python -m dualvp verify|bench``: the command lives in :mod:`dualvp.tools.cli`."""

from __future__ import annotations


from .tools.cli import console_main, main  # noqa: F401  (console_main: also the console script's entry point)

if __name__ == "__main__":
    console_main()
