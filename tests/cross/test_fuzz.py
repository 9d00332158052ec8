"""Hypothesis fuzzing of shapes, dtypes, masks and extreme values, both backends vs the oracle.

Bounded for CI at 20 examples (the ``dualvp`` hypothesis profile of tests/conftest.py,
derandomized, with this test's own count: each example costs a JAX compilation); set
``DUALVP_FUZZ_EXAMPLES=2000`` for a longer run. Values mix ordinary logits,
+-1e4, banned (-inf) columns and rows with a NaN or +inf (which must come back
NaN in that row only, like the oracle). torch runs unsharded in-process on
its eager kernels (a compilation per drawn shape is not what this tests); JAX
runs on a mesh of W host devices.
"""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("torch")
pytest.importorskip("jax")

from dualvp import testing  # noqa: E402
from dualvp.testing import cases  # noqa: E402

_VALUES = st.one_of(
    st.floats(-30, 30, width=32),
    st.sampled_from([1e4, -1e4, 1e4 - 1.0, -np.inf, 0.0, 25.0]),
)


@st.composite
def fuzz_problems(draw) -> cases.Problem:
    world = draw(st.sampled_from([1, 2, 4]))
    vocab = world * draw(st.integers(1, 12))
    lead = draw(st.sampled_from([(0,), (1,), (3,), (2, 2), (1, 1, 3)]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16", "float64"]))
    z = draw(hnp.arrays(np.float64, lead + (vocab,), elements=_VALUES))
    if dtype == "float16":
        z = np.clip(z, -6e4, 6e4)  # float16 overflows past 65504: keep the intent of +-1e4 rows only
    n = int(np.prod(lead))
    flat = z.reshape(n, vocab)
    if n:
        # every row keeps a finite entry (a row of only -inf is its own, NaN, case below)
        flat[np.arange(n), draw(hnp.arrays(np.int64, (n,), elements=st.integers(0, vocab - 1)))] = 1.0
        poison = draw(st.sampled_from([None, np.nan, np.inf]))
        if poison is not None:
            flat[draw(st.integers(0, n - 1)), draw(st.integers(0, vocab - 1))] = poison
    target = draw(hnp.arrays(np.int64, lead, elements=st.integers(0, vocab - 1)))
    if n and draw(st.booleans()):
        target.reshape(-1)[draw(st.integers(0, n - 1))] = -100
    keep = draw(st.one_of(st.none(), hnp.arrays(np.bool_, lead + (vocab,))))
    c = cases.Case("fuzz", lead=lead, vocab=vocab, worlds=(world,), dtype=dtype,
                   temperature=draw(st.sampled_from([0.25, 1.0, 3.0])))
    z = cases.round_to_dtype(flat.reshape(z.shape), dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return cases.Problem(c, z, target, keep, rng.normal(size=lead), rng.normal(size=lead))


@given(fuzz_problems())
@settings(max_examples=int(os.environ.get("DUALVP_FUZZ_EXAMPLES", "0") or 0) or 20)
@pytest.mark.slow
def test_fuzz_against_oracle(prob):
    world = prob.case.worlds[0]
    torch_out = testing.run("torch", prob, 1, impl="eager")  # unsharded; W > 1: test_cross_backends
    assert testing.failures(prob, {"torch": torch_out, "jax": testing.run("jax", prob, world)}) == []
