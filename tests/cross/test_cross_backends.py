"""torch (W real gloo ranks) and JAX (W host devices) on identical inputs, where tests/torch and
tests/jax do not reach: each backend against the float64 oracle and against the other.

* every case of :data:`dualvp.testing.cases.CASES` at W = 2 with the *compiled*
  torch kernels (tests/torch compiles the whole table at W = 1 only);
* every case at W = 8 (tests/torch stops at W = 4), eager torch kernels;
* hypothesis-drawn random scenarios on W = 2 and 4 ranks (eager kernels: one
  compilation per drawn shape would cost more than the check).

One spawn per W runs all torch scenarios; everything goes through the shared
adapters :func:`dualvp.testing.run_all`.
"""

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("jax")

from dualvp import testing  # noqa: E402
from dualvp.testing import cases  # noqa: E402

# W -> torch kernels. Compiled at W = 2 only: 8 processes each compiling every
# dtype/mask variant would cost minutes on 2 CI cores, and the code W exercises
# (statistics all-gather, combine, owning-shard logic) is the same on both paths.
IMPL = {2: "compiled", 8: "eager"}


@functools.lru_cache(maxsize=None)
def _table_results(world: int) -> dict:
    problems = [cases.make(c) for c in cases.CASES if world in c.worlds]
    torch_out = testing.run_all("torch", problems, world, impl=IMPL[world])
    return {p.case.name: (p, t) for p, t in zip(problems, torch_out)}


_PARAMS = [(c, w) for w in IMPL for c in cases.CASES if w in c.worlds]


@pytest.mark.parametrize("c,world", _PARAMS, ids=[f"{c.name}-W{w}" for c, w in _PARAMS])
def test_backends_agree_with_oracle_and_each_other(c, world):
    prob, torch_out = _table_results(world)[c.name]
    assert testing.failures(prob, {"torch": torch_out, "jax": testing.run("jax", prob, world)}) == []


# --- random scenarios ------------------------------------------------------------


@st.composite
def random_case(draw, world: int) -> cases.Case:
    return cases.Case(
        name="random",
        lead=draw(st.sampled_from([(0,), (1,), (5,), (2, 3)])),
        vocab=world * draw(st.integers(1, 24)),
        worlds=(world,),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float64"])),
        temperature=draw(st.sampled_from([0.3, 0.8, 1.0, 2.0])),
        mask=draw(st.sampled_from(["none", "nucleus", "drop_target", "all_but_target", "random"])),
        logits=draw(st.sampled_from(["normal", "extreme", "neg_inf", "ties", "dominant", "confident_lm"])),
        ignore_frac=draw(st.sampled_from([0.0, 0.3])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("world", (2, 4))
@settings(max_examples=2)
@given(data=st.data())
def test_random_scenarios_multi_rank(world, data):
    # One spawn per example, a batch of scenarios inside it.
    batch = [cases.make(data.draw(random_case(world))) for _ in range(5)]
    torch_outs = testing.run_all("torch", batch, world, impl="eager")
    for prob, t in zip(batch, torch_outs):
        assert testing.failures(prob, {"torch": t, "jax": testing.run("jax", prob, world)}) == [], prob.case
