"""The bench's goal verdicts (dualvp.tools.bench.report.summarize) on hand-made result records."""

from dualvp.tools.bench.implementations import MODES
from dualvp.tools.bench.report import markdown_report, summarize


def _rec(impl, mode, fwdbwd, fwd=None, mem=1.0, dtype="float32", err=1e-7):
    return {"impl": impl, "mode": mode, "T": 8, "V_local": 16, "dtype": dtype, "world": 1, "fwdbwd_s": fwdbwd,
            "fwd_s": fwdbwd / 2 if fwd is None else fwd, "peak_extra_B": mem,
            "errors": {"logprob": err, "entropy": err, "grad": err}}


def _goals(results):
    return {g["goal"]: g for g in summarize(results)["goals"]}


def test_kernel_goals_read_the_right_ratios():
    res = []
    for m in MODES:
        res += [_rec("slime", m, 10.0), _rec("torch-eager", m, 2.0), _rec("dualvp-torch-eager", m, 2.9, mem=1.08),
                _rec("dualvp-torch-inplace", m, 2.0, mem=0.01), _rec("dualvp-jax", m, 3.0, mem=1.02)]
        # unmasked forward 1.0 s, masked 1.2 s; lp 4 s (2.5x slime), the rest 3 s (3.3x)
        res.append(_rec("dualvp-torch", m, 4.0 if m == "lp" else 3.0, fwd=1.2 if m.endswith(".keep") else 1.0))
    g = _goals(res)
    assert g["dualvp-torch lp+ent+grad >= 3x faster than slime"]["status"] == "met"
    assert abs(g["dualvp-torch lp+ent+grad >= 3x faster than slime"]["worst"] - 10 / 3) < 1e-12
    assert g["dualvp-torch lp >= 2x faster than slime"]["worst"] == 2.5
    assert g["dualvp-torch-inplace lp+ent+grad >= 4.5x faster than slime"]["worst"] == 5.0
    assert abs(g["dualvp-torch masked forward within 1.3x of the unmasked forward"]["worst"] - 1.2) < 1e-12
    assert g["dualvp-torch masked forward within 1.3x of the unmasked forward"]["n"] == 3  # lp, lp+ent, lp+ent+grad
    assert g["dualvp-torch-eager within 1.5x of torch-eager"]["status"] == "met"  # 1.45
    assert g["dualvp-torch-eager within 1.5x of torch-eager"]["n"] == len(MODES)
    assert g["dualvp-torch-eager peak extra memory <= 1.1 B"]["worst"] == 1.08
    assert g["dualvp-jax no slower than dualvp-torch"]["status"] == "met"  # 3 s against 3 s (and 4 s for lp)
    assert g["dualvp-jax no slower than dualvp-torch"]["worst"] == 1.0


def test_kernel_goals_miss_and_absent_impls():
    res = [_rec("slime", "lp+ent+grad", 5.0), _rec("dualvp-torch", "lp+ent+grad", 2.0, err=2e-6),
           _rec("dualvp-torch-eager", "lp+ent+grad", 4.0, mem=1.2), _rec("torch-eager", "lp+ent+grad", 2.0)]
    g = _goals(res)
    assert g["dualvp-torch lp+ent+grad >= 3x faster than slime"]["status"] == "missed"  # 2.5x
    assert g["dualvp-torch-eager within 1.5x of torch-eager"]["worst"] == 2.0
    assert g["dualvp-torch-eager peak extra memory <= 1.1 B"]["status"] == "missed"
    assert g["dualvp-torch float32 entropy and gradient errors <= 1e-6"]["status"] == "missed"
    assert g["dualvp-torch-inplace lp+ent+grad >= 4.5x faster than slime"]["status"] == "not measured"
    assert g["dualvp-jax no slower than dualvp-torch"]["status"] == "not measured"
    # --report recomputes the verdicts from the records, whatever summary the file holds
    doc = {"meta": {"command": "-", "machine": {}}, "results": res, "summary": {"goals": []}}
    assert "**missed** (worst 2)" in markdown_report(doc)


def test_jax_goal_by_mean_reads_every_call():
    # dualvp-torch's median call 1 s with one stalled call of 10 s in five (mean 2.8 s); dualvp-jax
    # steady at 2 s: slower by median, faster by mean. A record without the mean field (older result
    # files) has it computed from its calls.
    res = []
    for m in ("lp", "lp+ent"):
        t = _rec("dualvp-torch", m, 1.0)
        t["times_fwdbwd_s"] = [1.0, 1.0, 10.0, 1.0, 1.0]
        if m == "lp":
            t["mean_fwdbwd_s"] = 2.8
        j = _rec("dualvp-jax", m, 2.0)
        j["times_fwdbwd_s"] = [2.0] * 5
        res += [t, j]
    g = _goals(res)
    assert g["dualvp-jax no slower than dualvp-torch"]["status"] == "missed"
    assert g["dualvp-jax no slower than dualvp-torch"]["worst"] == 2.0
    by_mean = g["dualvp-jax no slower than dualvp-torch, by mean time per call"]
    assert by_mean["status"] == "met" and by_mean["n"] == 2
    assert abs(by_mean["worst"] - 2.0 / 2.8) < 1e-12


def test_gradient_precision_goal_is_judged_per_dtype():
    # float32: 20x smaller than the baseline; bfloat16: both at the rounding floor (a tie) -> both met.
    res = [_rec("dualvp-torch", "lp", 1.0, err=1e-7), _rec("megatron", "lp", 1.0, err=2e-6),
           _rec("dualvp-torch", "lp", 1.0, dtype="bfloat16", err=4e-3),
           _rec("megatron", "lp", 1.0, dtype="bfloat16", err=4e-3)]
    g = _goals(res)
    f32, bf16 = (g["float32 gradient error >= 10x smaller than every baseline"],
                 g["bfloat16 gradient error no larger than any baseline's"])
    assert f32["status"] == "met" and f32["n"] == 1 and abs(f32["worst"] - 20) < 1e-9
    assert bf16["status"] == "met" and bf16["n"] == 1 and bf16["worst"] == 1.0
    # a bfloat16 gradient further from float64 than the baseline's is a miss, whatever float32 does
    res[2] = _rec("dualvp-torch", "lp", 1.0, dtype="bfloat16", err=8e-3)
    assert _goals(res)["bfloat16 gradient error no larger than any baseline's"]["status"] == "missed"
