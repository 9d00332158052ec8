"""Alias of :mod:`dualvp.testing.cases` (the shared scenarios, bad inputs and tolerances).

Kept for this session only, so that code written against the old location
(``from dualvp import cases``, ``dualvp.cases.tolerance``) keeps working while
the branches that use it are merged; new code imports :mod:`dualvp.testing`.
"""

from .testing.cases import *  # noqa: F401,F403
from .testing.cases import __all__  # noqa: F401
