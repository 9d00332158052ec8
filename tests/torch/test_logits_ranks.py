"""W = 2 and W = 4 real gloo ranks: the case table, the compat layer, and ranks that disagree.

One spawn per W (``dualvp_torch.testing.run_ranks``) runs everything of
``_sweep.rank_suite`` on the eager kernels; every test below reads its results (they live in one
file so that a pytest-xdist worker that runs them spawns the ranks once). The compiled kernels at
W = 2: every case in tests/cross/test_cross_backends.py.

Ranks that disagree never hang: every rank raises the same error, within
seconds. The rank bodies are in ``_disagree.py``; they run inside that spawn
(a hang there fails the whole run at its timeout).
"""

import pytest

torch = pytest.importorskip("torch")

from . import _disagree  # noqa: E402
from ._sweep import suite as _suite  # noqa: E402

NAMES = list(_disagree.SCENARIOS)

pytestmark = pytest.mark.slow  # gloo ranks spawned


@pytest.mark.parametrize("world", [2, 4])
def test_table_against_reference(world):
    res = _suite(world)
    failures = [f for r in res for f in r["sweep_eager"]]
    assert not failures, "\n".join(failures[:30])


@pytest.mark.parametrize("world", [2, 4])
def test_compat_world_group(world):
    for r in _suite(world):
        c = r["compat"]
        assert c["lp_shape"] == (5, 1) and c["h_shape"] == (5,)
        assert c["lp_ok"] and c["h_ok"] and c["loss_ok"], c


# --- ranks that disagree ------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_every_rank_raises_the_same_error(world, name):
    outcomes = [r["agreement"]["table"][NAMES.index(name)] for r in _suite(world)]
    assert {o[0] for o in outcomes} == {"RuntimeError"}, outcomes
    assert len({o[1] for o in outcomes}) == 1, outcomes  # identical on every rank
    assert _disagree.SCENARIOS[name][1] in outcomes[0][1], outcomes[0][1]
    assert "rank 1" in outcomes[0][1], outcomes[0][1]
    assert max(o[2] for o in outcomes) < 10.0, outcomes  # seconds, not a collective timeout


@pytest.mark.parametrize("world", [2, 4])
def test_out_of_range_target_on_one_rank(world):
    per_rank = [r["agreement"]["out_of_range"] for r in _suite(world)]
    assert all(kind == "ValueError" for kind, _ in per_rank), per_rank
    assert len({msg for _, msg in per_rank}) == 1
    assert per_rank[0][1].startswith("target:") and "rank 1" in per_rank[0][1]


@pytest.mark.parametrize("world", [2, 4])
def test_same_invalid_argument_everywhere_raises_the_argument_error(world):
    per_rank = [r["agreement"]["all_invalid"] for r in _suite(world)]
    assert all(kind == "ValueError" and msg.startswith("temperature:") for kind, msg in per_rank), per_rank
