"""Every Triton kernel compiles for an H100/H200 (sm_90) through the repository's own launch code, no GPU needed.

A child process (``dualvp.tools.static.hopper_target``) makes the host code
believe it runs on one sm_90 device, then runs forward + backward of the
public ops with ``impl="triton"`` at each input dtype and each mode the host
launches: the logits op (log-prob; + entropy; + keep mask; the extended op's
K targets with a temperature per row, sum p^2 and a keep mask), the fused
LM-head op (the same, plus frozen hidden / frozen weight in bfloat16) and the
KL op (plain; + row_mask; + ref_logits gradient, those two in bfloat16). Each
``kernel[grid](...)`` compiles with the launch parameters and runtime
specialisation the host picks, and only compiles. For every compiled kernel:

- it compiles, with no spills in the compiled cubin (``cuobjdump -res-usage``:
  no local memory, no stack; no ``STL``/``LDL`` in the SASS);
- no 64-bit integer division or remainder in its PTX;
- streaming kernels (all but the O(T) merge): 16-byte global loads (``.128``
  / ``cp.async`` of 16 bytes) in the streaming loop (the loop body, or the
  whole kernel when it has no loop) carry at least half of its global load
  bytes (the logits' loads; a keep mask or per-row statistics may come in
  narrower loads); a kernel that stores there stores only 16-byte vectors;
- the fused backward: no ``acq_rel`` atomic (relaxed reductions) and no
  GPU-scope memory barrier (``MEMBAR.GPU``/``SYS``); with in-kernel
  products (the option ``triton_linear_backward="atomic"``, compiled here in
  16-bit) its atomics are 16-byte; writing ``G`` for cuBLAS (the default) it
  stores 16-byte vectors and has no atomics but, under the default
  ``gradient_rounding="fixed"`` (``FIX_G``), the two residual slots' 8-byte
  relaxed min / max per row.

The test process runs kernels under ``TRITON_INTERPRET=1`` (tests/conftest.py
where there is no GPU): Triton reads it when kernels are defined, so the
compiles run in a child without it.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

_CHILD = r"""
import json, sys
from dualvp.tools import static
from dualvp_torch import tuning

LOGITS = [(64, 19008)]  # T, V_local: the goal sizes' specialisation (sizes and strides divisible by 16)
FUSED = [(128, 256, 2048)]  # T, H, V: two 16-bit dW chunks of the default budget
DTYPES = ("float32", "bfloat16", "float16")
with static.hopper_target() as launches:
    for dt in DTYPES:
        for mode in static.LOGITS_MODES:
            for T, V in LOGITS:
                static.drive_logits(launches, T, V, dt, mode)
        for mode in static.EXT_LOGITS_MODES:  # K targets, a temperature per row, sum p^2 (dualvp_torch.extended)
            for T, V in LOGITS:
                static.drive_logits_ext(launches, T, V, dt, mode)
    for dt in DTYPES:
        modes = list(static.FUSED_MODES) if dt == "bfloat16" else ["lp+ent"]
        # the default G rounding ("fixed": G rounded once + the residual slots; with a keep mask its most
        # registers) and, 16-bit, the option "split" (hi + lo) in the same modes
        for setting in [tuning.DEFAULT] + ([tuning.Tuning(gradient_rounding="split")] if dt != "float32" else []):
            with tuning.using(setting):
                for mode in modes:
                    for T, H, V in FUSED:
                        static.drive_fused(launches, T, H, V, dt, mode)
        if dt != "float32":  # the in-kernel products with atomics: the 16-bit backward's option
            with tuning.using(tuning.Tuning(triton_linear_backward="atomic")):
                static.drive_fused(launches, *FUSED[0], dt, "lp+ent")
    # V_local = 8192: two vocabulary splits of the forward, merged by linear_merge_splits_kernel
    static.drive_fused(launches, 128, 256, 8192, "bfloat16", "lp+ent")
    for dt in DTYPES:
        for mode in (static.KL_MODES if dt == "bfloat16" else ["kl"]):
            for T, V in LOGITS:
                static.drive_kl(launches, T, V, dt, mode)
import hashlib
def asm_of(launch):
    return launch.kernel, hashlib.sha256(launch.compiled.asm["ptx"].encode() + launch.compiled.asm["cubin"]).hexdigest()
# a specialisation whose PTX and cubin equal another's (the fused backward's G kernel with a frozen input: the
# host drops a product, the kernel is the same) is read once: its figures are the same. The listings come from
# one disassembler process (static.sass_listings); the largest kernel's is checked against cuobjdump's own.
unique = {}
for launch in launches:
    unique.setdefault(asm_of(launch), launch)
sass = dict(zip(unique, static.sass_listings(u.compiled.asm["cubin"] for u in unique.values())))
big = max(unique, key=lambda k: len(unique[k].compiled.asm["cubin"]))
own = static.cuobjdump_sass(unique[big].compiled.asm["cubin"])
ins_batch, ins_own = static.sass_instructions(sass[big]), static.sass_instructions(own)
print(json.dumps(dict(listing_check=big[0], instructions=len(ins_own), equal=ins_batch == ins_own,
                      loops_equal=static.sass_loops(ins_batch) == static.sass_loops(ins_own))), flush=True)
seen, figures = set(), {}
for launch in launches:
    key = (launch.kernel, id(launch.compiled))
    if key in seen:
        continue
    seen.add(key)
    k = asm_of(launch)
    if k not in figures:
        figures[k] = static.analyse(launch, sass=sass[k])
    a = dict(figures[k], label=launch.label, grid=launch.grid, constexprs=launch.constexprs)
    def share16(fig, kind):
        w = fig["widths"]
        total = sum(n * c for (k, n), c in w.items() if k == kind)
        return (sum(16 * c for (k, n), c in w.items() if k == kind and n == 16) / total) if total else None
    print(json.dumps(dict(
        kernel=a["kernel"], label=a["label"], constexprs={k: str(v) for k, v in a["constexprs"].items()},
        registers=a["registers"], local=a["local"], stack=a["stack"], local_accesses=a["local_accesses"],
        div64=a["div64"], acq_rel=a["acq_rel_atomics"],
        membar_gpu=a["membar_gpu"], load16=share16(a["loop"], "load"), store16=share16(a["loop"], "store"),
        atomic16=share16(a["whole"], "atomic"), store16_whole=share16(a["whole"], "store"),
        narrow_stores=sum(c for (k, n), c in a["loop"]["widths"].items() if k == "store" and n != 16))), flush=True)
print("done")
"""


@pytest.fixture(scope="module")
def _child():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=900,
                         cwd=root)
    assert res.returncode == 0 and res.stdout.rstrip().endswith("done"), res.stdout[-3000:] + res.stderr[-6000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return [r for r in rows if "listing_check" in r], [r for r in rows if "listing_check" not in r]


@pytest.fixture(scope="module")
def compiled(_child):
    return _child[1]


@pytest.mark.slow
def test_one_process_listing_equals_cuobjdumps(_child):
    # every figure below reads SASS disassembled in one process for all kernels (static.sass_listings):
    # the largest kernel's instructions and loops equal cuobjdump's listing of its own cubin
    (check,) = _child[0]
    assert check["instructions"] > 500 and check["equal"] and check["loops_equal"], check


def _kernels(rows, name):
    return [r for r in rows if r["kernel"] == name]


@pytest.mark.slow
def test_every_launched_kernel_compiles(compiled):
    names = {r["kernel"] for r in compiled}
    # the logits op launches a statistics and a gradient kernel at least (the extended op its own gradient
    # kernel); the fused op its pair
    assert any("stats" in n for n in names) and any("grad" in n for n in names), names
    assert "logits_ext_grad_kernel" in names, names
    ext_stats = [r for r in _kernels(compiled, "logits_stats_kernel") if r["constexprs"].get("HAS_TARGET") == "False"]
    assert {r["constexprs"]["WITH_SUM_P2"] for r in ext_stats} == {"True", "False"}, ext_stats
    assert {"linear_stats_kernel", "linear_grad_kernel", "linear_merge_splits_kernel",
            "linear_fix_dw_kernel"} <= names, names
    assert {"kl_stats_kernel", "kl_grad_kernel"} <= names, names
    # every dtype of the fused pair (the 16-bit ones failed on dot() before) and of the KL pair compiled
    for name in ("linear_stats_kernel", "linear_grad_kernel", "kl_stats_kernel", "kl_grad_kernel"):
        labels = {r["label"].split()[2] for r in _kernels(compiled, name)}
        assert labels == {"float32", "bfloat16", "float16"}, (name, labels)


@pytest.mark.slow
def test_no_spills_and_no_64bit_division(compiled):
    for r in compiled:
        what = (r["kernel"], r["label"], r["constexprs"])
        assert r["local"] == 0 and r["stack"] == 0 and r["local_accesses"] == 0, ("local memory (spills)", what)
        assert not r["div64"], ("64-bit division", what)


@pytest.mark.slow
def test_streaming_loops_move_16_byte_vectors(compiled):
    for r in compiled:
        if "merge" in r["kernel"]:
            continue  # O(T) per-row statistics, no [T, V] stream
        what = (r["kernel"], r["label"], r["constexprs"])
        # by bytes per thread: the stream's logits in 16-byte vectors, beside per-row scalars (target, statistics,
        # upstream gradients) and, in the gradient kernel (one tile per program, no loop), the keep mask in the
        # logits' own layout (8-byte vectors beside 16-bit logits): at least a third; scalar code would give ~0
        least = 1 / 3 if r["kernel"] in ("logits_grad_kernel", "logits_ext_grad_kernel") else 1 / 2
        assert r["load16"] is not None and r["load16"] >= least, ("16-byte loads", r["load16"], what)
        # every store of the stream is a 16-byte vector; the logits gradient kernel adds one narrow store per
        # row after its tile (the target column's value, written once: no per-element compare with the target)
        narrow_ok = 1 if r["kernel"] == "logits_grad_kernel" else 0
        assert r["store16"] is None or r["narrow_stores"] <= narrow_ok, ("16-byte stores", r["store16"], what)


@pytest.mark.slow
def test_fused_backward_adds_without_fences(compiled):
    rows = _kernels(compiled, "linear_grad_kernel")
    assert rows
    for r in rows:
        what = (r["label"], r["constexprs"])
        assert r["acq_rel"] == 0, ("acq_rel atomics", what)
        assert r["membar_gpu"] == 0, ("GPU-scope memory barriers", what)
        # the products' atomics 16-byte; FIX_G: only the residual slots' 8-byte min / max (below)
        fix = r["constexprs"].get("FIX_G") == "True"
        assert r["atomic16"] in ((0.0,) if fix else (None, 1.0)), ("16-byte atomics", r["atomic16"], what)
    # both 16-bit backwards compiled: products in the kernel (atomics) and G written for cuBLAS
    store_g = [r for r in rows if r["constexprs"].get("STORE_G") == "True"]
    atomic = [r for r in rows if r["constexprs"].get("STORE_G") == "False" and r["label"].split()[2] != "float32"]
    assert store_g and atomic, "both 16-bit backwards"
    for r in store_g:
        # G in 16-byte vectors; with FIX_G also one 8-byte store per row (the target's residual slot: at most
        # 8 B per thread beside the tile's 64 B of G per thread at the CUDA tile: >= 0.75 of the bytes) and
        # the p > 1/3 slots' 8-byte atomic min / max (no 16-byte atomics: no products in the kernel)
        fix = r["constexprs"].get("FIX_G") == "True"
        assert r["atomic16"] == 0.0 if fix else r["atomic16"] is None, ("atomics beside the G chunk", r)
        assert r["store16_whole"] >= (0.75 if fix else 1.0), ("G chunk in 16-byte stores", r)
    assert any(r["constexprs"].get("SPLIT_G") == "True" for r in store_g), "the split option's backward compiled"
    fixed = [r for r in store_g if r["constexprs"].get("FIX_G") == "True"]
    assert fixed, "the default fixed rounding's backward compiled"
    assert any(r["constexprs"].get("HAS_KEEP") == "True" for r in fixed), "the fixed rounding with a keep mask"
    for r in atomic:
        assert r["atomic16"] == 1.0, ("16-byte atomics", r)
