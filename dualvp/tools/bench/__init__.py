"""``dualvp bench``: speed, memory and precision of every implementation against baselines, in one run.

:mod:`.options` (the options and the plan), :mod:`.driver` (the logits op's
run), :mod:`.linear` (``--op linear``), :mod:`.implementations` (what is
compared), :mod:`.worker` and :mod:`.procs` (one process per
implementation), :mod:`.timing` (how a call is timed and measured: the one
timing helper, also used by ``benchmarks/``), :mod:`.results` (the CSV
results file), :mod:`.report` (what is printed).
"""

from .driver import run
from .options import add_arguments

__all__ = ["add_arguments", "run"]
