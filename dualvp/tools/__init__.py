"""The ``dualvp`` command and its tools (not imported by :mod:`dualvp`).

- :mod:`dualvp.tools.cli`: argument parsing, ``python -m dualvp verify|bench``;
- :mod:`dualvp.tools.verify`: torch and JAX on one problem against the float64 oracle;
- :mod:`dualvp.tools.bench`: speed, memory and precision against baselines
  (``driver``: options and run loop; ``worker``: the measuring subprocess;
  ``implementations``: the registry; ``inputs``: inputs and oracle;
  ``report``: table, JSON, PNG, Markdown).

The tools import torch, jax, megatron-core and matplotlib lazily, where they
are used; install them with the ``[bench]`` extra (plus ``[torch]`` and
``[jax]`` for the backends).
"""
