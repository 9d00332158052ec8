"""Ranks that disagree never hang: every rank raises the same error, within seconds."""

import pytest

pytest.importorskip("torch")

from dualvp_torch.testing import run_ranks  # noqa: E402

import _disagree  # noqa: E402  (tests/torch is on sys.path under pytest)

NAMES = list(_disagree.SCENARIOS)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"W{w}")
def seen(request):
    world = request.param
    # The whole table in one spawn; a hang anywhere fails the run at the timeout.
    per_rank = run_ranks(_disagree.run_all, world, NAMES, timeout=240)
    return world, per_rank


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_raises_the_same_error(seen, name):
    world, per_rank = seen
    i = NAMES.index(name)
    outcomes = [r[i] for r in per_rank]
    kinds = {o[0] for o in outcomes}
    assert kinds == {"RuntimeError"}, outcomes
    messages = {o[1] for o in outcomes}
    assert len(messages) == 1, messages  # identical on every rank
    assert _disagree.SCENARIOS[name][1] in outcomes[0][1], outcomes[0][1]
    assert "rank 1" in outcomes[0][1], outcomes[0][1]
    assert max(o[2] for o in outcomes) < 10.0, outcomes


@pytest.mark.parametrize("world", [2, 4])
def test_out_of_range_target_on_one_rank(world):
    per_rank = run_ranks(_disagree.out_of_range, world, timeout=120)
    assert all(kind == "ValueError" for kind, _ in per_rank), per_rank
    assert len({msg for _, msg in per_rank}) == 1
    assert per_rank[0][1].startswith("target:") and "rank 1" in per_rank[0][1]


def test_same_invalid_argument_everywhere_raises_the_argument_error():
    per_rank = run_ranks(_disagree.all_invalid, 2, timeout=120)
    assert all(kind == "ValueError" and msg.startswith("temperature:") for kind, msg in per_rank), per_rank
