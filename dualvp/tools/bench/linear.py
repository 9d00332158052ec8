"""``dualvp bench --op linear``: the fused LM-head op against its baselines, side by side in one process.

    python -m dualvp bench --op linear [--T 2048 --hidden 1024 --V 32000 --reps 3]
        [--dtypes float32,bfloat16] [--impls fused,unfused,...] [--slime-path DIR] [--out FILE.json]

Implementations (``--impls``, default all that can run):

* ``fused``: ``dualvp_torch.linear_logprob_entropy``;
* ``unfused``: torch matmul, then ``dualvp_torch.logprob_entropy``;
* ``unfused-naive``: torch matmul, then ``log_softmax`` + ``gather`` and the
  entropy ``-(p * log p).sum``, autograd (what a first implementation does);
* ``unfused-slime``: torch matmul, then slime's fused op (``--slime-path``
  DIR holding ``slime/utils/ppo_utils.py``, or an importable ``slime``;
  skipped otherwise; no slime code is in this repository);
* ``torch-linear-ce``: ``torch.nn.functional.linear_cross_entropy``
  (``reduction="none"``): log-prob only (no entropy), so only its log-prob
  term is differentiated and its entropy error is not reported;
* ``jax-fused``: ``dualvp_jax.linear_logprob_entropy`` under
  ``jax.jit(jax.value_and_grad(loss, (0, 1)))``, the same loss; the inputs are
  placed on the JAX device before the clock starts and the clock stops at
  ``block_until_ready``. Its memory is XLA's ``memory_analysis()`` temp bytes
  of the compiled forward + backward (scratch beyond the arguments and the
  returned gradients), not the torch allocation trace.

For each dtype: forward + backward time (median and minimum of ``--reps``
after one warm-up, the two paths interleaved so that they see the same machine load),
the peak extra memory beyond the returned gradients (CPU allocation trace of
the torch profiler, one step, as a multiple of ``B = T * V_local * itemsize``),
and the errors of log-prob, entropy, ``dh`` and ``dW`` against the float64
oracle (``dualvp.reference``, evaluated in row chunks: rows are independent
for log-prob, entropy and ``dh``; ``dW`` is the sum of the chunks' ``G^T h``).
The machine load (``os.getloadavg``) is recorded before and after.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from dualvp import reference
from dualvp_torch import linear_logprob_entropy, logprob_entropy


def _allocation_peak(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _oracle(h, w, y, gl, ge, rows=256):
    hn, wn = h.double().numpy(), w.double().numpy()
    lp, en, dh = [], [], []
    dw = np.zeros_like(wn)
    for i in range(0, hn.shape[0], rows):
        sl = slice(i, i + rows)
        a, b = reference.linear_logprob_entropy(hn[sl], wn, y[sl].numpy())
        d_h, d_w = reference.linear_logprob_entropy_grad(hn[sl], wn, y[sl].numpy(), gl[sl].double().numpy(), ge[sl].double().numpy())
        lp.append(a), en.append(b), dh.append(d_h)
        dw += d_w
    return np.concatenate(lp), np.concatenate(en), np.concatenate(dh), dw


def _errors(out, ref) -> dict:
    names = ("logprob", "entropy", "dh", "dW")
    res = {}
    for name, x, r in zip(names, out, ref):
        if x is None:  # not computed by this implementation (torch-linear-ce: no entropy)
            continue
        err = np.abs(x.detach().double().cpu().numpy() - r)
        res[name] = {"max_abs": float(err.max()), "max_abs_over_max_ref": float(err.max() / np.abs(r).max())}
    return res


def _jax_fused(h0: torch.Tensor, w0: torch.Tensor, y, gl, ge):
    """``(step, temp_bytes)``: the JAX fused op's forward + backward, compiled, on the same inputs."""
    import jax
    import jax.numpy as jnp

    import dualvp_jax

    jdt = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[h0.dtype]
    hj = jnp.asarray(h0.float().numpy()).astype(jdt)
    wj = jnp.asarray(w0.float().numpy()).astype(jdt)
    yj, glj, gej = jnp.asarray(y.numpy()), jnp.asarray(gl.numpy()), jnp.asarray(ge.numpy())

    def loss(h, w):
        lp, en = dualvp_jax.linear_logprob_entropy(h, w, yj)
        return jnp.sum(lp * glj + en * gej), (lp, en)

    compiled = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True)).lower(hj, wj).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes

    def step(*_):
        (_, (lp, en)), (dh, dw) = compiled(hj, wj)
        jax.block_until_ready(dw)
        return tuple(torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(h0.dtype if i > 1 else torch.float32)
                     for i, x in enumerate((lp, en, dh, dw)))

    def timed(*_):
        jax.block_until_ready(compiled(hj, wj))

    return step, timed, temp


IMPLS = ("fused", "unfused", "unfused-naive", "unfused-slime", "torch-linear-ce", "jax-fused")


def _naive(z, y):
    lsm = torch.log_softmax(z.float(), dim=-1)
    return lsm.gather(-1, y[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)


def _cuda_peak(fn) -> int:
    # the same quantity as _allocation_peak on the GPU: the most bytes allocated at once during fn
    from .worker import CudaPeak

    with CudaPeak(torch) as pk:
        fn()
    return pk.extra


def run(T: int, H: int, V: int, dtype: torch.dtype, reps: int, impls=("fused", "unfused"), slime=None,
        device: str = "cpu") -> dict:
    """One dtype: every implementation in ``impls`` timed, its peak memory taken and its errors judged.

    The inputs are drawn on the CPU (the float64 oracle reads them there) and
    copied to ``device``; on ``cuda`` the clock reads follow
    ``torch.cuda.synchronize()`` and the memory is ``max_memory_allocated``.
    """
    g = torch.Generator().manual_seed(0)
    # LM-like scale: logits of std ~3 (hidden ~N(0,1), weight ~N(0, 9/H))
    h0 = torch.randn(T, H, generator=g).to(dtype)
    w0 = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    gl = torch.randn(T, generator=g)
    ge = torch.randn(T, generator=g) * 0.1
    itemsize = h0.element_size()
    B = T * V * itemsize
    grads_bytes = (T * H + V * H) * itemsize
    cuda = device == "cuda"
    hd, wd = h0.to(device), w0.to(device)
    yd, gld, ged = y.to(device), gl.to(device), ge.to(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def leaves():
        return hd.clone().requires_grad_(True), wd.clone().requires_grad_(True)

    def fused(h, w):
        lp, en = linear_logprob_entropy(h, w, yd)
        (lp * gld + en * ged).sum().backward()
        return lp.detach(), en.detach(), h.grad, w.grad

    def unfused(h, w):
        lp, en = logprob_entropy(h @ w.t(), yd)
        (lp * gld + en * ged).sum().backward()
        return lp.detach(), en.detach(), h.grad, w.grad

    def unfused_naive(h, w):
        lp, en = _naive(h @ w.t(), yd)
        (lp * gld + en * ged).sum().backward()
        return lp.detach(), en.detach(), h.grad, w.grad

    def unfused_slime(h, w):
        lp, en = slime.calculate_log_probs_and_entropy(h @ w.t(), yd, torch.distributed.group.WORLD, with_entropy=True)
        (lp.reshape(-1) * gld + en * ged).sum().backward()
        return lp.detach().reshape(-1).float(), en.detach().float(), h.grad, w.grad

    def linear_ce(h, w):
        lp = -torch.nn.functional.linear_cross_entropy(h, w, yd, reduction="none")
        (lp * gld).sum().backward()
        return lp.detach().float(), None, h.grad, w.grad

    paths = {"fused": fused, "unfused": unfused, "unfused-naive": unfused_naive, "torch-linear-ce": linear_ce}
    if slime is not None:
        paths["unfused-slime"] = unfused_slime
    jax_temp = None
    if "jax-fused" in impls:
        jax_step, jax_timed, jax_temp = _jax_fused(h0, w0, y, gl, ge)
        paths["jax-fused"] = jax_step
    paths = {k: f for k, f in paths.items() if k in impls}
    outs = {k: f(*leaves()) for k, f in paths.items()}  # warm-up (compilation) and the outputs judged
    timed = dict(paths, **({"jax-fused": jax_timed} if "jax-fused" in paths else {}))
    times = {k: [] for k in paths}
    for _ in range(reps):
        for k, f in timed.items():
            args = leaves()
            sync()
            t0 = time.perf_counter()
            f(*args)
            sync()
            times[k].append(time.perf_counter() - t0)
            del args
    peaks = {}
    for k, f in paths.items():
        if k == "jax-fused":
            peaks[k] = jax_temp + grads_bytes  # XLA scratch beyond arguments and returned gradients
            continue
        args = leaves()  # outside the trace: only the step's own allocations count
        peaks[k] = (_cuda_peak if cuda else _allocation_peak)(lambda: f(*args))
        del args
    ref = _oracle(h0, w0, y, gl, ge)
    ref_lp_only = _oracle(h0, w0, y, gl, torch.zeros_like(ge))  # the gradients of a log-prob-only loss
    res = {"dtype": str(dtype).replace("torch.", ""), "B_bytes": B, "device": device}
    for k in paths:
        extra = peaks[k] - grads_bytes
        res[k] = {
            "seconds_median": statistics.median(times[k]),
            "seconds_min": min(times[k]),
            "seconds_all": times[k],
            "peak_alloc_bytes": peaks[k],
            "peak_extra_beyond_grads_over_B": extra / B,
            "errors_vs_float64": _errors(outs[k], ref_lp_only if k == "torch-linear-ce" else ref),
        }
    if dtype != torch.float32:
        # The floor for gradients returned in a 16-bit dtype: the float64 oracle rounded once to it.
        res["oracle_rounded_to_dtype"] = {
            name: _errors((torch.tensor(r).to(dtype),), (r,))["logprob"]
            for name, r in (("dh", ref[2]), ("dW", ref[3]))
        }
    if "fused" in res and "unfused" in res:
        res["time_ratio_fused_over_unfused"] = res["fused"]["seconds_median"] / res["unfused"]["seconds_median"]
        # the fastest run of each is the least disturbed by other jobs on a shared machine
        res["time_ratio_min_fused_over_min_unfused"] = res["fused"]["seconds_min"] / res["unfused"]["seconds_min"]
    if "jax-fused" in res and "fused" in res:
        res["jax-fused"]["memory_source"] = "XLA memory_analysis temp bytes"
        res["time_ratio_min_jax_fused_over_min_fused"] = res["jax-fused"]["seconds_min"] / res["fused"]["seconds_min"]
        res["time_ratio_jax_fused_over_fused"] = (res["jax-fused"]["seconds_median"]
                                                  / res["fused"]["seconds_median"])
    return res


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _one_rank_group(device: str = "cpu") -> None:
    import torch.distributed as dist

    from dualvp_torch.testing import free_port

    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def run_args(args) -> int:
    """``dualvp bench --op linear`` (the bench's parsed arguments); returns the exit status."""
    from .implementations import _locate_slime, load_slime_ops

    device = getattr(args, "device", "cpu")
    dtypes = (args.dtypes or "float32,bfloat16").split(",")
    impls = (args.impls or ",".join(IMPLS)).split(",")
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        print(f"dualvp bench: --impls with --op linear: expected a subset of {','.join(IMPLS)}, got {bad}")
        return 2
    slime = None
    if "unfused-slime" in impls:
        found = _locate_slime(args)
        if isinstance(found, str):
            print(f"skipping unfused-slime: {found}")
            impls.remove("unfused-slime")
        else:
            slime = load_slime_ops(found["slime_file"])
            _one_rank_group(device)  # slime's op all-reduces over its group, even at W = 1
    if "jax-fused" in impls and importlib.util.find_spec("jax") is None:
        print("skipping jax-fused: jax is not installed")
        impls.remove("jax-fused")
    if "jax-fused" in impls and device == "cuda":
        # JAX would take the GPU beside torch (and preallocate most of it): not in this process
        print("skipping jax-fused: not with --device cuda (benchmarks/jax_linear.py runs JAX alone)")
        impls.remove("jax-fused")
    if "torch-linear-ce" in impls and not hasattr(torch.nn.functional, "linear_cross_entropy"):
        print(f"skipping torch-linear-ce: torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
        impls.remove("torch-linear-ce")
    T, H, V = (64, 32, 1000) if args.quick else (args.T, args.hidden, args.V)
    reps = args.reps or (1 if args.quick else 3)
    result = {
        "T": T, "H": H, "V_local": V, "reps": reps, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "impls": impls, "uptime_before": _uptime(), "loadavg_before": os.getloadavg(), "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "memory_note": ("torch.cuda.max_memory_allocated during" if device == "cuda" else
                        "peak of the CPU allocation trace of") + " one forward+backward step "
        "(inputs allocated before) minus the returned gradients dh, dW; as a multiple of B = T * V_local * itemsize",
        "runs": [],
    }
    for name in dtypes:
        r = run(T, H, V, getattr(torch, name), reps, impls, slime, device)
        result["runs"].append(r)
        for k in impls:
            e = r[k]["errors_vs_float64"]
            errs = "  ".join(f"{q} {e[q]['max_abs']:.1e}" for q in ("logprob", "entropy", "dh", "dW") if q in e)
            print(f"{name:9s} {k:16s} {r[k]['seconds_median'] * 1e3:9.2f} ms  extra {r[k]['peak_extra_beyond_grads_over_B']:6.3f} B"
                  f"  {errs}", flush=True)
    result["loadavg_after"] = os.getloadavg()
    result["uptime_after"] = _uptime()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)
    return 0
