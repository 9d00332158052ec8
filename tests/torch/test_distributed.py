"""W = 2 and W = 4 real gloo ranks: the case table and the compat layer.

One spawn per W (``dualvp_torch.testing.run_ranks``) runs everything of
``_sweep.rank_suite``; the tests below (and those of
``test_torch_rank_disagreement.py``) read its results.
"""

import pytest

torch = pytest.importorskip("torch")

from ._sweep import suite as _suite  # noqa: E402

@pytest.mark.parametrize("world", [2, 4])
def test_table_against_reference(world):
    res = _suite(world)
    failures = [f for r in res for f in r["sweep_eager"] + r["sweep_compiled"]]
    assert not failures, "\n".join(failures[:30])


@pytest.mark.parametrize("world", [2, 4])
def test_compat_world_group(world):
    for r in _suite(world):
        c = r["compat"]
        assert c["lp_shape"] == (5, 1) and c["h_shape"] == (5,)
        assert c["lp_ok"] and c["h_ok"] and c["loss_ok"], c
