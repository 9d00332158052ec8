"""Ranks that disagree never hang: every rank raises the same error, within seconds.

The rank bodies are in ``_disagree.py``; they run inside the one spawn per W
of ``_sweep.suite`` (a hang there fails the whole run at its timeout).
"""

import pytest

pytest.importorskip("torch")

from . import _disagree  # noqa: E402
from ._sweep import suite  # noqa: E402

NAMES = list(_disagree.SCENARIOS)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_every_rank_raises_the_same_error(world, name):
    outcomes = [r["agreement"]["table"][NAMES.index(name)] for r in suite(world)]
    assert {o[0] for o in outcomes} == {"RuntimeError"}, outcomes
    assert len({o[1] for o in outcomes}) == 1, outcomes  # identical on every rank
    assert _disagree.SCENARIOS[name][1] in outcomes[0][1], outcomes[0][1]
    assert "rank 1" in outcomes[0][1], outcomes[0][1]
    assert max(o[2] for o in outcomes) < 10.0, outcomes  # seconds, not a collective timeout


@pytest.mark.parametrize("world", [2, 4])
def test_out_of_range_target_on_one_rank(world):
    per_rank = [r["agreement"]["out_of_range"] for r in suite(world)]
    assert all(kind == "ValueError" for kind, _ in per_rank), per_rank
    assert len({msg for _, msg in per_rank}) == 1
    assert per_rank[0][1].startswith("target:") and "rank 1" in per_rank[0][1]


@pytest.mark.parametrize("world", [2, 4])
def test_same_invalid_argument_everywhere_raises_the_argument_error(world):
    per_rank = [r["agreement"]["all_invalid"] for r in suite(world)]
    assert all(kind == "ValueError" and msg.startswith("temperature:") for kind, msg in per_rank), per_rank
