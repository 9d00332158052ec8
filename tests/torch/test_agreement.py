"""The target / hidden fingerprints of the ``validate=True`` agreement record (``dualvp_torch.agreement``).

Unit tests of :func:`dualvp_torch.agreement.fingerprint` against an
independent Python-integer formulation, then one spawn of 2 gloo ranks
(``dualvp_torch.testing.run_ranks``) that runs every rank scenario: a target
that differs across the group, the data-parallel group passed for the
tensor-parallel one, replicated hidden states that differ (fused op): the same
``ValueError`` on every rank; agreeing inputs (a different target dtype, the
fused op with sequence parallelism, whose hidden rows legitimately differ):
results within tolerance of the float64 oracle; ``validate=False``: no
agreement step at all.
"""

import pytest

torch = pytest.importorskip("torch")

from dualvp_torch import agreement  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402

from . import _torchrun_worker as W  # noqa: E402

P = 2**31 - 1


def _python_prints(ids) -> tuple:
    """The target fingerprints in exact Python integers (no int64, no torch)."""
    u = [int(y) % P for y in ids]
    return sum(u), sum(x * ((48271 * (i + 1)) % P) % P for i, x in enumerate(u))


@pytest.mark.parametrize("ids", [
    [0, 3, 9, -100, 15],
    [],
    [2**63 - 1, -(2**63), 5, P, -1],
    list(range(1000, 0, -3)),
])
def test_target_fingerprint_matches_integer_formulation(ids):
    got = agreement.fingerprint(torch.tensor(ids, dtype=torch.int64)).tolist()
    assert tuple(got) == _python_prints(ids)


def test_target_fingerprint_separates_changes_and_ignores_dtype_and_shape():
    y = torch.randint(0, 50_000, (4, 64), generator=torch.Generator().manual_seed(0))
    base = agreement.fingerprint(y).tolist()
    assert agreement.fingerprint(y.to(torch.int32)).tolist() == base  # the ids, not their dtype
    assert agreement.fingerprint(y.reshape(-1)).tolist() == base  # row-major order, not the shape
    rolled = agreement.fingerprint(torch.roll(y.reshape(-1), 1)).tolist()
    assert rolled[0] == base[0] and rolled[1] != base[1]  # same multiset of ids: the weighted sum tells
    swapped = y.clone().reshape(-1)
    swapped[[3, 40]] = swapped[[40, 3]]
    assert agreement.fingerprint(swapped).tolist()[1] != base[1]
    one = y.clone()
    one[2, 7] += 1
    assert agreement.fingerprint(one).tolist()[0] != base[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_hidden_fingerprint_reads_bits_of_sampled_rows(dtype):
    y = torch.arange(40)
    h = torch.randn(40, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    base = agreement.fingerprint(y, h, fused=True).tolist()
    assert len(base) == 3 and base[:2] == agreement.fingerprint(y).tolist()
    assert agreement.fingerprint(y, h.clone(), fused=True).tolist() == base  # equal values, equal prints
    for row in (0, 39):  # first and last rows are always sampled
        changed = h.clone()
        changed[row, 5] = changed[row, 5] * 2 + 1
        assert agreement.fingerprint(y, changed, fused=True).tolist()[2] != base[2]
    assert agreement.fingerprint(y, h * 0.5, fused=True).tolist()[2] != base[2]  # partial sums
    assert agreement.fingerprint(y, None, fused=True).tolist()[2] == 0  # sequence parallel: not compared
    assert agreement.fingerprint(None, fused=True).tolist() == [0, 0, 0]  # a rank that failed its checks


def test_check_fingerprints_names_the_argument_and_the_ranks():
    agreement.check_fingerprints([[1, 2], [1, 2]])
    with pytest.raises(ValueError, match=r"^target: differs .*ranks 0, 2.*rank 1.*tensor-parallel group"):
        agreement.check_fingerprints([[1, 2], [1, 3], [1, 2]])
    with pytest.raises(ValueError, match=r"^hidden: differs .*rank 0; rank 1"):
        agreement.check_fingerprints([[1, 2, 5], [1, 2, 6]], fused=True)


# --- 2 gloo ranks ---------------------------------------------------------------------------------

T, V_LOCAL, H = 24, 32, 8


def _rank_scenarios(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dualvp_torch import agreement as agr
    from dualvp_torch import logprob_entropy

    g = dist.group.WORLD
    p = W.make_problem(1, T, world * V_LOCAL)
    lin = W.make_problem(2, T, world * V_LOCAL, H)
    y = torch.from_numpy(p["target"])
    c = {}
    c["agree"] = W.outcome(lambda: W.logits_failures(p, g))
    c["agree_target_int32_on_rank_1"] = W.outcome(
        lambda: W.logits_failures(p, g, target=y.to(torch.int32) if rank == 1 else None))
    c["agree_fused"] = W.outcome(lambda: W.linear_failures(lin, g))
    c["agree_fused_sequence_parallel"] = W.outcome(lambda: W.linear_failures(lin, g, sequence_parallel=True))
    c["target_rolled"] = W.outcome(lambda: W.logits_failures(p, g, target=torch.roll(y, 1) if rank == 1 else None))
    one = y.clone()
    one[5] = (one[5] + 1) % (world * V_LOCAL)
    c["target_one_id"] = W.outcome(lambda: W.logits_failures(p, g, target=one if rank == 1 else None))
    c["target_rolled_triton"] = W.outcome(lambda: W.logits_failures(
        p, g, target=torch.roll(y, 1) if rank == 1 else None, impl="triton"))
    c["target_rolled_fused"] = W.outcome(
        lambda: W.linear_failures(lin, g, target=torch.roll(torch.from_numpy(lin["target"]), 1) if rank else None))
    # the data-parallel group passed for the tensor-parallel one: each replica its own rows (seed)
    c["dp_group"] = W.outcome(lambda: W.logits_failures(W.make_problem(10 + rank, T, world * V_LOCAL), g))
    c["dp_group_fused"] = W.outcome(lambda: W.linear_failures(W.make_problem(20 + rank, T, world * V_LOCAL, H), g))
    # replicated hidden states that are not: partial sums of a row-parallel layer before its all-reduce
    c["hidden_partial_sums"] = W.outcome(lambda: W.linear_failures(lin, g, hidden=lin["hidden"] * (0.25 + rank)))
    # validate=False: the agreement step (and so the fingerprint) never runs
    calls = []
    real = agr.gather_checked
    agr.gather_checked = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        z = torch.from_numpy(p["logits"][:, rank * V_LOCAL:(rank + 1) * V_LOCAL]).float()
        logprob_entropy(z, y, group=g, validate=False, impl="eager")
        c["validate_false_calls"] = len(calls)
        logprob_entropy(z, y, group=g, validate=True, impl="eager")
        c["validate_true_calls"] = len(calls)
    finally:
        agr.gather_checked = real
    c["after"] = W.outcome(lambda: W.logits_failures(p, g))
    return c


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank_scenarios, 2, timeout=240, env={"DUALVP_COMPILE": "0"}, threads=1)


@pytest.mark.parametrize("name", ["agree", "agree_target_int32_on_rank_1", "agree_fused",
                                  "agree_fused_sequence_parallel", "after"])
def test_agreeing_inputs_match_the_oracle(ranks, name):
    for r in ranks:
        assert r[name] == ("ok", []), r[name]


@pytest.mark.parametrize("name,argument", [
    ("target_rolled", "target"),
    ("target_one_id", "target"),
    ("target_rolled_triton", "target"),
    ("target_rolled_fused", "target"),
    ("dp_group", "target"),
    ("dp_group_fused", "target"),
    ("hidden_partial_sums", "hidden"),
])
def test_differing_inputs_raise_the_same_error_on_every_rank(ranks, name, argument):
    seen = [r[name] for r in ranks]
    assert {s[0] for s in seen} == {"ValueError"}, seen
    assert len({s[1] for s in seen}) == 1, seen  # identical message on every rank
    assert seen[0][1].startswith(f"{argument}: differs across the process group's ranks"), seen[0][1]
    assert "rank 0; rank 1" in seen[0][1] and "tensor-parallel group" in seen[0][1], seen[0][1]


def test_validate_false_runs_no_agreement_step(ranks):
    for r in ranks:
        assert r["validate_false_calls"] == 0 and r["validate_true_calls"] == 1, r
