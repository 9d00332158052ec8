"""What a custom CPU kernel would give dualvp_jax's masked forward with the entropy: a measurement prototype.

Issue 14's last unmet goal on the CPU is the masked forward with the entropy,
whose XLA:CPU chunk is four library row reductions over materialised float32
buffers (docs/measurements.md). ``ffi_stats_prototype.cc`` computes the same
four statistics ``(m, s, t, sk)`` of ``spec.block_stats(kept_shift="max")``
as one XLA FFI custom call (two passes per row, OpenMP over rows). This
script builds it with ``g++`` into a temporary directory (jaxlib ships the
FFI headers), registers it, and times, calls alternating with a 50 ms pause
before each (``_alternating.times_ms``), ``--reps`` calls per variant:

- ``prototype``: the custom call alone (``jit``);
- ``xla stats``: ``dualvp_jax``'s own shard statistics (its chunked CPU path,
  ``function._shard_stats``), the part the custom call would replace;
- ``jax forward``: the whole ``dualvp_jax.logprob_entropy`` forward (``jit``);
- ``torch forward``: ``dualvp_torch.logprob_entropy``'s compiled forward
  (under ``no_grad``), when torch is installed.

Inputs are the bench's: ``N(10, 3)`` float32 logits, a top-64 keep mask, no
row owning its target (so that ``sk`` is the kept sum alone in both). It also
prints the relative error of ``s``, ``t`` and ``sk`` against float64 for the
prototype and for dualvp_jax's statistics (the prototype sums in float32
vector lanes). Nothing in dualvp uses the prototype; it restates the spec's
formulas, which is why it is not in a package.

Usage::

    python benchmarks/ffi_stats_prototype.py --V 32000,152064 --reps 9
"""

from __future__ import annotations

import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

# libgomp reads these when the prototype is loaded: without the passive wait
# its idle threads spin and take the cores from XLA's between calls.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from _alternating import size_parser, times_ms, widths  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import dualvp_jax  # noqa: E402
from dualvp_jax import function as jax_function  # noqa: E402


def build() -> str:
    """Compile the prototype; the path of the shared library (in a temporary directory)."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        sys.exit("ffi_stats_prototype: no C++ compiler (g++ / c++) on PATH")
    out = os.path.join(tempfile.mkdtemp(prefix="dualvp_ffi_"), "libffi_stats_prototype.so")
    subprocess.run([cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w",
                    "-I", jax.ffi.include_dir(), os.path.join(HERE, "ffi_stats_prototype.cc"), "-o", out], check=True)
    return out


def main() -> None:
    ap = size_parser(__doc__, "float32", V="32000,152064")
    a = ap.parse_args()
    lib = ctypes.cdll.LoadLibrary(build())
    jax.ffi.register_ffi_target("dualvp_ffi_stats_prototype", jax.ffi.pycapsule(lib.MaskedStats), platform="cpu")
    try:
        import torch

        from dualvp_torch import logprob_entropy as torch_op
    except ImportError:
        torch = None
    print(f"T={a.T}, reps {a.reps}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, jax {jax.__version__}"
          + (f", torch {torch.__version__}" if torch else ""))
    for v in widths(a):
        rng = np.random.default_rng(0)
        z_np = (rng.standard_normal((a.T, v)) * 3 + 10).astype(np.float32)
        top = np.argpartition(-z_np, 64, axis=-1)[:, :64]
        keep_np = np.zeros((a.T, v), bool)
        np.put_along_axis(keep_np, top, True, axis=-1)
        y_np = rng.integers(0, v, a.T)
        z, keep, y = jnp.asarray(z_np), jnp.asarray(keep_np), jnp.asarray(y_np, jnp.int32)
        local, owns = jnp.zeros(a.T, jnp.int32), jnp.zeros(a.T, bool)

        proto = jax.jit(lambda z, k: jax.ffi.ffi_call(
            "dualvp_ffi_stats_prototype", jax.ShapeDtypeStruct((z.shape[0], 4), jnp.float32))(z, k))
        xla = jax.jit(lambda z, k: jax_function._shard_stats(z, local, owns, k, 1.0, jnp.float32, True))
        op = jax.jit(lambda z, y, k: dualvp_jax.logprob_entropy(z, y, keep_mask=k))
        fns = {"prototype": lambda: jax.block_until_ready(proto(z, keep)),
               "xla stats": lambda: jax.block_until_ready(xla(z, keep)),
               "jax forward": lambda: jax.block_until_ready(op(z, y, keep))}
        if torch is not None:
            zt, yt, kt = torch.from_numpy(z_np), torch.from_numpy(y_np), torch.from_numpy(keep_np)

            def torch_forward():
                with torch.no_grad():
                    return torch_op(zt, yt, keep_mask=kt, impl="compiled")

            fns["torch forward"] = torch_forward
        ms = {k: statistics.median(t) for k, t in times_ms(fns, a.reps, warm=2, pause=0.05).items()}

        p, x = np.asarray(proto(z, keep), np.float64), np.asarray(xla(z, keep), np.float64)
        z64 = z_np.astype(np.float64)
        e64 = np.exp(z64 - z64.max(-1, keepdims=True))
        want = {"s": e64.sum(-1), "t": (e64 * (z64 - z64.max(-1, keepdims=True))).sum(-1),
                "sk": np.where(keep_np, e64, 0.0).sum(-1)}
        col_p, col_x = {"s": 1, "t": 2, "sk": 3}, {"s": 1, "t": 2, "sk": 4}

        def rel(got, name):
            return float(np.max(np.abs(got - want[name]) / np.abs(want[name])))

        errs = ", ".join(f"{n} {rel(p[:, col_p[n]], n):.1e} / {rel(x[:, col_x[n]], n):.1e}" for n in want)
        print(f"{a.T}x{v} float32, top-64 mask: " + ", ".join(f"{k} {t:.1f} ms" for k, t in ms.items())
              + f"; prototype / xla stats {ms['prototype'] / ms['xla stats']:.2f}"
              + f"; max relative error vs float64, prototype / xla: {errs}")


if __name__ == "__main__":
    main()
