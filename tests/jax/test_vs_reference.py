"""dualvp_jax against the float64 NumPy oracle (dualvp.reference) over the shared case table."""

import pytest

jax = pytest.importorskip("jax")

from dualvp.testing import cases  # noqa: E402
from ._helpers import (  # noqa: E402
    check_close, inputs, reference_of, shard_map_runner, sharded_runner, x64_for,
)

def _check_outputs(case, outs, refs):
    for name, x, ref in zip(("logprob", "entropy", "grad"), outs, refs):
        check_close(case.name, x, ref, case.dtype, name)


# Every case through the global-array API (jax.make_mesh, explicit axes) is checked, with 4-row
# chunks, by tests/jax/test_chunks.py::test_chunked_vs_reference at W = 2 or 4, and with the default chunks by
# tests/cross/test_cross_backends.py at W = 2 and 8 (the same API, against the oracle and torch).


# The fast tier's conformance sample: the public global-array API with its default forward, W = 1 and 2,
# masked and unmasked, float32 and bfloat16.
# basic and bfloat16 in the slow tier (the fast tier: a masked case at W = 2 and one unsharded).
_FAST = [("basic", 2), ("random_mask_temp", 2), ("bfloat16", 2), ("neg_inf_masked", 1)]
_SLOW = {"basic", "bfloat16"}


@pytest.mark.parametrize("name,world", [pytest.param(n, w, id=f"{n}-W{w}",
                                                     marks=pytest.mark.slow if n in _SLOW else ())
                                        for n, w in _FAST])
def test_sharded_vs_reference(name, world):
    case = cases.case(name)
    prob = cases.make(case)
    with x64_for(case.dtype):
        z, y, k, gl, ge = inputs(prob)
        outs = sharded_runner(world, "explicit", case.temperature, case.ignore_index, k is not None)(z, y, k, gl, ge)
        _check_outputs(case, outs, reference_of(prob))


# The user-level shard_map path on jax.sharding.Mesh (auto axes), at the largest W of a
# representative subset (every dtype, mask kind, extreme row kind and the empty problem).
_SM_NAMES = ("empty", "batch_dims", "float64", "bfloat16", "float16", "drop_target", "all_but_target",
             "extreme_temp", "neg_inf_masked", "ties", "confident_lm_bf16", "everything")
_SM_PARAMS = [pytest.param(c, max(c.worlds), id=f"{c.name}-W{max(c.worlds)}")
              for c in cases.CASES if c.name in _SM_NAMES]


@pytest.mark.slow
@pytest.mark.parametrize("case,world", _SM_PARAMS)
def test_shard_map_auto_mesh_vs_reference(case, world):
    prob = cases.make(case)
    ref_lp, ref_h, ref_g = reference_of(prob)
    with x64_for(case.dtype):
        z, y, k, gl, ge = inputs(prob)
        out = shard_map_runner(world, "auto", case.temperature, case.ignore_index, k is not None)(z, y, k, gl, ge)
        _check_outputs(case, out, (ref_lp, ref_h, ref_g))


_OPTION_CASES = ("nucleus", "bfloat16", "neg_inf", "everything")


# Each case at one W, alternating W = 1 (no axis) and 4 over the cases, unmasked and masked at each W;
# both options at each (the option modes on both paths in float64: tests/jax/test_naive_oracle.py).
_OPTION_WORLDS = {"nucleus": 1, "bfloat16": 4, "neg_inf": 1, "everything": 4}


@pytest.mark.slow
@pytest.mark.parametrize("name,world", [(n, _OPTION_WORLDS[n]) for n in _OPTION_CASES],
                         ids=[f"{n}-{_OPTION_WORLDS[n]}" for n in _OPTION_CASES])
@pytest.mark.parametrize("with_entropy,entropy_grad", [(True, False), (False, True)],
                         ids=["no_entropy_grad", "no_entropy"])
def test_options_vs_reference(name, world, with_entropy, entropy_grad):
    """entropy_grad=False / with_entropy=False: values as before, gradient of the log-prob only."""
    case = cases.case(name)
    prob = cases.make(case)
    ref_lp, ref_h, ref_g = reference_of(prob, entropy_grad=False)
    with x64_for(case.dtype):
        z, y, k, gl, ge = inputs(prob)
        run = sharded_runner(world, "auto", case.temperature, case.ignore_index, k is not None,
                             with_entropy=with_entropy, entropy_grad=entropy_grad)
        lp, h, g = run(z, y, k, gl, ge)
        check_close(name, lp, ref_lp, case.dtype, "logprob")
        if with_entropy:
            check_close(name, h, ref_h, case.dtype, "entropy")
        else:
            assert h is None
        check_close(name, g, ref_g, case.dtype, "grad")


def test_residuals_are_o_of_t(capsys):
    """Between forward and backward only the input and O(T) statistics are kept."""
    from jax.ad_checkpoint import print_saved_residuals

    import dualvp_jax

    prob = cases.make(cases.case("nucleus"))
    z, y, k, _, _ = inputs(prob)
    print_saved_residuals(lambda z: dualvp_jax.logprob_entropy(z, y, keep_mask=k, temperature=0.7), z)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    big = [ln for ln in lines if f"[{z.shape[0]},{z.shape[1]}]" in ln.replace(" ", "")]
    # the logits themselves and the caller's keep mask, nothing computed
    assert all("from the argument" in ln or "bool" in ln for ln in big), lines
    assert sum("from the argument" in ln for ln in big) == 1, lines
