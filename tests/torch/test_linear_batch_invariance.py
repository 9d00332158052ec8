"""Batch invariance and determinism of the fused LM-head op on the CPU, every engine.

A row's log-prob, entropy and hidden-gradient row ``dh`` must be bitwise the
same whether the row is computed alone (T = 1) or inside a call of T = 7, 64
or 200 rows (Triton: 7 or 40) at a random position among random other rows, and the same from
run to run, at a fixed weight, dtype and options (docs/decisions.md, "Fused
op: batch invariance and G rounding"). ``dW`` sums over the rows, so it
depends on them by definition and is exempt. The reference is the engine
itself on the row alone (agreement with the float64 oracle is checked in
test_linear.py / test_linear_triton.py). The helpers are those of
``tests/cross/test_batch_invariance.py`` (random placement, bitwise compare).

Tables (weights fixed, hidden rows random): the torch tile path at V_local =
4099 (several vocabulary blocks, the last ragged) in float32, and in
bfloat16 with a keep mask; a shard wider than ATen's grain (40000 columns);
an explicit ``memory_budget``; ``keep_ids``. The Triton kernels under the
interpreter at a small shard (V_local = 130: 5 column blocks of 32 in 3
forward splits, the last block ragged; 200's 7 blocks reached no other
path), T = 40 (3 row blocks, the last partial) in the slow tier.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.cross.test_batch_invariance import CHECKED, check_invariance  # noqa: E402

from dualvp_torch import linear_logprob_entropy  # noqa: E402


def _round_to(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(x).to(dtype)


def make_fused_table(v: int, h: int, dtype: str = "float32", keep: str = "none", tau: float = 0.7,
                     n_other: int = 1000, seed: int = 49) -> dict:
    """Hidden rows ``[CHECKED + n_other, h]``, one weight ``[v, h]``, targets, upstream gradients, kept sets."""
    rng = np.random.default_rng(seed)
    n = CHECKED + n_other
    dt = getattr(torch, dtype)
    hid = _round_to(rng.standard_normal((n, h)).astype(np.float32), dt)
    w = _round_to((rng.standard_normal((v, h)) * (3.0 / np.sqrt(h))).astype(np.float32), dt)
    y = rng.integers(0, v, n).astype(np.int64)
    y[CHECKED + 1::17] = -100  # some ignored rows among the others
    t = dict(hid=hid, w=w, y=torch.from_numpy(y), gl=torch.from_numpy(rng.standard_normal(n).astype(np.float32)),
             ge=torch.from_numpy(rng.standard_normal(n).astype(np.float32)), tau=tau, n_other=n_other,
             keep_mask=None, keep_ids=None)
    if keep == "mask":
        t["keep_mask"] = torch.from_numpy(rng.random((n, v)) < 0.5)
    elif keep == "ids":
        ids = rng.integers(0, v, (n, 9))
        ids[:, -2:] = -1  # padding
        t["keep_ids"] = torch.from_numpy(ids)
    return t


def fused_runner(table: dict, impl: str, **kw):
    def run(idx):
        i = torch.from_numpy(idx)
        x = table["hid"][i].clone().requires_grad_(True)
        extra = {}
        for k in ("keep_mask", "keep_ids"):
            if table[k] is not None:
                extra[k] = table[k][i]
        lp, ent = linear_logprob_entropy(x, table["w"], table["y"][i], temperature=table["tau"], impl=impl,
                                         **extra, **kw)
        torch.autograd.backward([lp, ent], [table["gl"][i], table["ge"][i]])
        return lp.detach().float().numpy(), ent.detach().float().numpy(), x.grad.float().numpy()

    return run


TORCH_TABLES = {
    "V4099-H64-f32": dict(v=4099, h=64, n_other=200),
    "V4099-H32-bf16-keep": dict(v=4099, h=32, dtype="bfloat16", keep="mask", tau=1.3, n_other=200),
}


@pytest.mark.parametrize("table_id", ["V4099-H64-f32", pytest.param("V4099-H32-bf16-keep", marks=pytest.mark.slow)])
@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_tile_path_batch_invariant(impl, table_id):
    # T = 200: several token chunks on both engines at V_local = 4099 (eager 37 rows x 586 columns per tile,
    # compiled 2 chunks of 100 rows x 1367 columns), the columns in 7 / 3 blocks, the last ragged; T = 1000
    # (6 compiled chunks) cost 3-4x the CPU for the same paths
    table = make_fused_table(**TORCH_TABLES[table_id])
    check_invariance(fused_runner(table, impl), table, (7, 64, 200))


def test_tile_path_compiled_batch_invariant_f32():
    # the compiled stages' one fast-tier check (the masked bfloat16 table: slow tier above)
    table = make_fused_table(v=1000, h=32, n_other=200)
    check_invariance(fused_runner(table, "compiled"), table, (7, 64, 200))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["eager", "compiled"])
def test_tile_path_wide_shard_batch_invariant(impl):
    # V_local above ATen's grain (32768): a tile never takes a row wider than it (an eager
    # reduction over a few such rows would split each between the intra-op threads)
    table = make_fused_table(v=40000, h=8, n_other=64)
    check_invariance(fused_runner(table, impl), table, (7, 64))


@pytest.mark.slow
def test_tile_path_explicit_budget_batch_invariant():
    # an explicit memory_budget is an option: the tile's columns follow it, never T
    table = make_fused_table(v=1001, h=16, n_other=200)
    check_invariance(fused_runner(table, "eager", memory_budget=64 << 10), table, (7, 64, 200))


def test_tile_path_keep_ids_batch_invariant():
    table = make_fused_table(v=1001, h=16, keep="ids", n_other=200)
    check_invariance(fused_runner(table, "eager"), table, (7, 64, 200))


# --- the fused Triton kernels, under the interpreter ----------------------------------------

TRITON_TABLES = {
    "V130-H24-f32": dict(v=130, h=24, n_other=1000),
    "V130-H24-bf16-keep": dict(v=130, h=24, dtype="bfloat16", keep="mask", tau=1.3, n_other=1000),
    "V130-H24-f32-ids": dict(v=130, h=24, keep="ids", n_other=1000),
    "V130-H24-bf16": dict(v=130, h=24, dtype="bfloat16", tau=0.3),  # low temperature: rows with p > 1/2
}


def _interpreting():
    pytest.importorskip("triton")
    from dualvp_torch import triton_kernels

    if not triton_kernels.interpreting():
        pytest.skip("the fused Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")


@pytest.mark.parametrize(
    "table_id, ts",
    # fast: float32 with keep_ids at T = 7 (one partial row block); the T = 40 runs (several blocks and groups) slow
    # T = 40: 3 row blocks of 16 under the interpreter, the last partial (8 rows), in 2 dh groups of
    # group_rows = 2 blocks, the last group partial; T = 7 one partial block. (T = 130's 9 blocks and T = 64's 4
    # whole ones reached no other path, at 3x / 1.5x the interpreter's time.)
    [pytest.param("V130-H24-f32", (7, 40), id="f32-T7-40", marks=pytest.mark.slow),
     pytest.param("V130-H24-bf16-keep", (7, 40), id="bf16-keep-T7-40", marks=pytest.mark.slow),
     pytest.param("V130-H24-f32-ids", (7,), id="f32-ids-T7"),
     pytest.param("V130-H24-bf16", (7, 40), id="bf16-split-T7-40", marks=pytest.mark.slow)])
def test_triton_batch_invariant(table_id, ts):
    # 16-bit tables: the masked one at the default G rounding ("fixed": G rounded once + the rank-1 residual
    # terms, dh adds its row's own; tau 0.3 gives rows with p > 1/3), "V130-H24-bf16" under the option
    # "split" (G_hi + G_lo)
    from dualvp_torch import tuning

    _interpreting()
    table = make_fused_table(**TRITON_TABLES[table_id])
    if table_id == "V130-H24-bf16":
        with tuning.using(tuning.Tuning(gradient_rounding="split")):
            check_invariance(fused_runner(table, "triton"), table, ts)
        return
    assert tuning.current().gradient_rounding == "fixed"
    check_invariance(fused_runner(table, "triton"), table, ts)
