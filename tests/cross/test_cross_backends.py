"""torch (W real gloo ranks) and JAX (W host devices) on identical inputs, where tests/torch and
tests/jax do not reach: each backend against the float64 oracle and against the other.

* every case of :data:`dualvp.testing.cases.CASES` at W = 2 with the *compiled*
  torch kernels (tests/torch compiles the whole table at W = 1 only);
* every case at W = 8 (tests/torch stops at W = 4), eager torch kernels;
* ten seeded random scenarios at W = 8, in the same spawn as that table (eager
  kernels: one compilation per drawn shape would cost more than the check;
  W = 2 runs the whole table above, and a spawn of their own, once at W = 4,
  cost 8 rank starts more for no path the W = 8 ranks do not take).

One spawn per W runs all torch scenarios; everything goes through the shared
adapters :func:`dualvp.testing.run_all`.
"""

import functools

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from dualvp import testing  # noqa: E402
from dualvp.testing import cases  # noqa: E402

# W -> torch kernels. Compiled at W = 2 only: 8 processes each compiling every
# dtype/mask variant would cost minutes on 2 CI cores, and the code W exercises
# (statistics all-gather, combine, owning-shard logic) is the same on both paths.
IMPL = {2: "compiled", 8: "eager"}


# the random scenarios ride with the table's spawn at this W
RANDOM_WORLD = 8


@functools.lru_cache(maxsize=None)
def _table_results(world: int) -> dict:
    problems = [cases.make(c) for c in cases.CASES if world in c.worlds]
    if world == RANDOM_WORLD:
        problems += [cases.make(c) for c in random_cases(world, 10, seed=world)]
    torch_out = testing.run_all("torch", problems, world, impl=IMPL[world])
    return {p.case.name: (p, t) for p, t in zip(problems, torch_out)}


# every W > 1 spawns its ranks once for the whole table: the slow tier
_PARAMS = [pytest.param(c, w, marks=pytest.mark.slow, id=f"{c.name}-W{w}")
           for w in IMPL for c in cases.CASES if w in c.worlds]


@pytest.mark.parametrize("c,world", _PARAMS)
def test_backends_agree_with_oracle_and_each_other(c, world):
    prob, torch_out = _table_results(world)[c.name]
    assert testing.failures(prob, {"torch": torch_out, "jax": testing.run("jax", prob, world)}) == []


# --- random scenarios ------------------------------------------------------------

_CHOICES = dict(
    lead=[(0,), (1,), (5,), (2, 3)],
    dtype=["float32", "bfloat16", "float64"],
    temperature=[0.3, 0.8, 1.0, 2.0],
    mask=["none", "nucleus", "drop_target", "all_but_target", "random"],
    logits=["normal", "extreme", "neg_inf", "ties", "dominant", "confident_lm"],
    ignore_frac=[0.0, 0.3],
)


def random_cases(world: int, n: int, seed: int) -> list:
    """``n`` scenarios with every option drawn at random (seeded: the same on every run)."""
    rng = np.random.default_rng(seed)
    pick = lambda k: _CHOICES[k][rng.integers(len(_CHOICES[k]))]  # noqa: E731
    return [cases.Case(name=f"random{i}", lead=pick("lead"), vocab=world * int(rng.integers(1, 25)), worlds=(world,),
                       dtype=pick("dtype"), temperature=pick("temperature"), mask=pick("mask"), logits=pick("logits"),
                       ignore_frac=pick("ignore_frac"), seed=int(rng.integers(2**16)))
            for i in range(n)]


@pytest.mark.slow
def test_random_scenarios_multi_rank():
    # Computed by the W = 8 table's spawn (the costly part). Drawn with a seeded
    # generator, not hypothesis: its first example is the minimal one (ten empty
    # problems), and every further example would be another spawn.
    results = _table_results(RANDOM_WORLD)
    names = [c.name for c in random_cases(RANDOM_WORLD, 10, seed=RANDOM_WORLD)]
    assert len(names) == 10 and all(n in results for n in names)
    for name in names:
        prob, t = results[name]
        assert testing.failures(prob, {"torch": t, "jax": testing.run("jax", prob, RANDOM_WORLD)}) == [], prob.case
