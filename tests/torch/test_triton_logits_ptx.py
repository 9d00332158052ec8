"""The logits op's Triton kernels compile for an H100/H200 (sm_90) without a GPU, with 16-byte accesses.

Triton lowers a kernel to PTX and assembles it with the ``ptxas`` its wheel
ships, no device needed. Each variant (input dtype, keep mask, entropy) must
compile, and its loads and stores of the ``[T, V_local]`` tiles must be
16-byte vectors (``ld.global.v4.b32`` / ``v2.b64``, stores alike) when the shard's width
and strides are multiples of 16 elements (what Triton's launcher specialises
at run time); no 64-bit integer division may appear. Runs in a child process:
under ``TRITON_INTERPRET=1`` (set by test_triton_logits.py) kernels are not
compiled.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_CHILD = r"""
import re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dualvp_torch.triton_kernels.logits_grad import logits_grad_kernel
from dualvp_torch.triton_kernels.logits_merge import logits_merge_kernel
from dualvp_torch.triton_kernels.logits_stats import logits_stats_kernel

def vec(ptx, op):  # a 16-byte access: 4 x 32 or 2 x 64 bits
    return re.search(op + r"\.global[.\w:]*\.(v4\.b32|v2\.b64)", ptx) is not None

def compile_(fn, types, consts, num_warps):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types[n] for n in names}
    # what the launcher specialises for 16-aligned pointers and ints divisible by 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in types
             if types[n].startswith("*") or n.startswith("stride") or n == "V"}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]

for zdt, ct, cdt, bv in (("*fp32", "*fp32", tl.float32, 4096), ("*bf16", "*fp32", tl.float32, 8192),
                         ("*fp64", "*fp64", tl.float64, 2048)):
    for keep in (False, True):
        for ent in (False, True):
            ptx = compile_(logits_stats_kernel, dict(
                z_ptr=zdt, stride_z="i32", y_ptr="*i64", keep_ptr="*u8", stride_k="i32", out_ptr=ct, bad_ptr="*i32",
                T="i32", V="i32", v_lo="i32", vocab="i32", ignore_index="i32", tau="fp64"), dict(
                HAS_KEEP=keep, WITH_ENTROPY=ent, COMPUTE=cdt, ACC=tl.float64, BLOCK_T=1, BLOCK_V=bv), 8)
            assert vec(ptx, "ld") and not re.search(r"(div|rem)\.[su]64", ptx), ("stats", zdt, keep, ent)
            ptx = compile_(logits_grad_kernel, dict(
                z_ptr=zdt, stride_z="i32", g_ptr=zdt, stride_g="i32", y_ptr="*i64", keep_ptr="*u8", stride_k="i32",
                res_ptr=ct, gl_ptr="*fp32", stride_gl="i32", ge_ptr="*fp32", stride_ge="i32", T="i32", V="i32",
                v_lo="i32", ignore_index="i32", tau="fp64"), dict(
                HAS_KEEP=keep, ENTROPY=ent, COMPUTE=cdt, BLOCK_T=4, BLOCK_V=1024), 4)
            assert vec(ptx, "ld") and vec(ptx, "st"), ("grad", zdt, keep, ent)
            assert not re.search(r"(div|rem)\.[su]64", ptx), ("grad", zdt, keep, ent)
    compile_(logits_merge_kernel, dict(stats_ptr=ct, y_ptr="*i64", logprob_ptr=ct, entropy_ptr=ct, res_ptr=ct,
                                       T="i32", W="i32", ignore_index="i32", tau="fp64"), dict(BLOCK_T=256), 4)
print("ok")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_vector_accesses():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-3000:] + res.stderr[-6000:]
