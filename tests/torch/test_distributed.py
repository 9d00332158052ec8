"""W = 2 and W = 4 real gloo ranks: the case table, the agreement step, the compat layer.

One spawn per W (``dualvp_torch.testing.run_ranks``) runs everything of
``_torch_sweep.rank_suite``; the tests below read its results.
"""

import pytest

torch = pytest.importorskip("torch")

from dualvp_torch.testing import run_ranks  # noqa: E402

from _torch_sweep import rank_suite  # noqa: E402

_RESULTS = {}


def _suite(world):
    if world not in _RESULTS:
        # The compiled path joins the collectives at W = 2 only: every rank
        # compiles on its own and 4 ranks on 2 CI cores would take a minute.
        _RESULTS[world] = run_ranks(rank_suite, world, world == 2, timeout=240)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 4])
def test_table_against_reference(world):
    res = _suite(world)
    failures = [f for r in res for f in r["sweep_eager"] + r["sweep_compiled"]]
    assert not failures, "\n".join(failures[:30])


@pytest.mark.parametrize("world", [2, 4])
def test_disagreeing_ranks_all_raise(world):
    res = _suite(world)
    for key in ("temperature", "with_entropy", "mask_present", "rows", "one_rank_invalid"):
        got = [r["agreement"][key] for r in res]
        assert all(g is not None and g[0] == "RuntimeError" for g in got), (key, got)
        assert len({g[1] for g in got}) == 1, (key, got)  # the same message on every rank
    got = [r["agreement"]["bad_target_one_rank"] for r in res]
    assert all(g is not None and g[0] == "ValueError" and g[1].startswith("target:") for g in got), got
    got = [r["agreement"]["all_ranks_invalid"] for r in res]
    assert all(g is not None and g[0] == "ValueError" and g[1].startswith("temperature:") for g in got), got
    assert all(r["agreement"]["ok_after"] is None for r in res)  # the group still works


@pytest.mark.parametrize("world", [2, 4])
def test_compat_world_group(world):
    for r in _suite(world):
        c = r["compat"]
        assert c["lp_shape"] == (5, 1) and c["h_shape"] == (5,)
        assert c["lp_ok"] and c["h_ok"] and c["loss_ok"], c
