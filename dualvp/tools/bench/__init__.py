"""``dualvp bench``: speed, memory and precision of every implementation against baselines, in one run.

See :mod:`dualvp.tools.bench.driver` (the run), :mod:`.implementations` (what
is compared), :mod:`.worker` (how one implementation is measured) and
:mod:`.report` (what is written).
"""

from .driver import add_arguments, run

__all__ = ["add_arguments", "run"]
