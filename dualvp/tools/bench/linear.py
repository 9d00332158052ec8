"""``dualvp bench --op linear``: the fused LM-head op against its baselines, in one process.

    python -m dualvp bench --op linear [--device cuda] [--shapes TxHxV,...] [--dtypes bfloat16,float32]
        [--impls dualvp-fused,dualvp-unfused,...] [--reps N] [--results FILE.csv]

bfloat16 runs before float32; the implementations run in the order named
(default: the baselines, then dualvp's Triton kernels, then the paths that
compile with inductor). One that raises, or cannot run at a dtype (``cce``
in float32: its backward takes 16-bit inputs only), is a row saying why
(``note``) and the run goes on; each row is appended as it comes.

Implementations (``--impls``; default all that can run here), each
differentiating ``sum(gl * logprob) + sum(ge * entropy)`` with respect to
the hidden states ``h [T, H]`` and the weight shard ``W [V_local, H]``:

* ``dualvp-fused``: ``dualvp_torch.linear_logprob_entropy`` (default impl);
* ``dualvp-fused-triton``: the same with ``impl="triton"`` (CUDA, or a CPU
  when named under ``TRITON_INTERPRET=1``; an error row when this dualvp
  lacks it);
* ``dualvp-unfused``: ``h @ W.T`` in the input dtype, then
  ``dualvp_torch.logprob_entropy``;
* ``cce``: Cut Cross-Entropy's ``linear_cross_entropy(h, W, y,
  reduction="none")`` with its defaults (gradient filtering on): log-prob
  only;
* ``liger-flce``: Liger-Kernel's fused linear cross-entropy
  (``reduction="none"``): log-prob only; its backward scales by one upstream
  gradient for all rows, so its loss is ``sum(logprob)`` (``gl = 1``);
* ``torch-linear-ce``: ``torch.nn.functional.linear_cross_entropy``
  (``reduction="none"``) where this torch has it: log-prob only.

The baselines without an entropy differentiate the log-prob term alone, and
are judged against the float64 gradients of that loss; ``err_entropy`` is
empty for them. Timing and memory: :func:`dualvp.tools.bench.timing.measure`
(CPU memory: the peak of torch's allocation trace of one call, as the
implementations share this process). ``peak_extra_B``: beyond the returned
``dh`` and ``dW``, over ``B = T * V_local * itemsize``. ``tflops``:
``8 * T * H * V_local`` (forward, recomputed tile and the two backward
products) over ``wall_ms``. Errors: max abs error against a float64 torch
formulation from the rounded inputs (:func:`oracle`), on the run's device.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable, Optional

import torch

from . import results, timing

_DEFAULT_SHAPES = {"cpu": ["2048x1024x32000"], "cuda": ["4096x2048x32000", "16384x4096x75968"]}
_QUICK_SHAPES = ["64x32x1000"]

# name -> (needs, devices, computes the entropy, per-row upstream gradients). The default order, the
# order they run in: the baselines, then dualvp's Triton kernels, then the paths that compile with
# inductor on first use (a run cut short keeps the baselines' rows).
IMPLS = {
    "cce": (("cut_cross_entropy", "triton"), ("cuda",), False, True),
    "liger-flce": (("liger_kernel", "triton"), ("cuda",), False, False),
    "torch-linear-ce": ((), ("cpu", "cuda"), False, True),
    "dualvp-fused-triton": (("triton",), ("cuda",), True, True),
    "dualvp-unfused": ((), ("cpu", "cuda"), True, True),
    "dualvp-fused": ((), ("cpu", "cuda"), True, True),
}
_TRITON = ("cce", "liger-flce", "dualvp-fused-triton")  # on a CPU: named, under TRITON_INTERPRET=1
# Cut Cross-Entropy's backward asserts 16-bit inputs (cut_cross_entropy/cce_backward.py)
_SKIP = {("cce", "float32"): "Cut Cross-Entropy's backward takes 16-bit inputs only (it asserts bfloat16/float16)"}


def oracle(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, gl: torch.Tensor, ge: torch.Tensor,
           rows: int = 1024) -> tuple:
    """float64 ``(logprob, entropy, dh, dW)`` of ``softmax(h W^T)`` for the loss ``sum(gl lp + ge H)``.

    In row chunks, on the inputs' device: ``p = softmax(z)``, ``lp = log p[y]``,
    ``H = -sum p log p``; ``dz = gl (onehot(y) - p) - ge p (log p + H)``,
    ``dh = dz W``, ``dW = dz^T h``.
    """
    w64 = w.double()
    lp, en, dh = [], [], []
    dw = torch.zeros_like(w64)
    for a in range(0, h.shape[0], rows):
        h64 = h[a:a + rows].double()
        logp = torch.log_softmax(h64 @ w64.T, dim=-1)
        p = logp.exp()
        H = -(p * logp).sum(-1)
        yy = y[a:a + rows]
        dz = -p * gl[a:a + rows, None].double()
        dz[torch.arange(len(yy), device=dz.device), yy] += gl[a:a + rows].double()
        dz -= ge[a:a + rows, None].double() * p * (logp + H[:, None])
        lp.append(logp.gather(-1, yy[:, None])[:, 0])
        en.append(H)
        dh.append(dz @ w64)
        dw += dz.T @ h64
    return torch.cat(lp), torch.cat(en), torch.cat(dh), dw


def _available(name: str, device: str, named: bool = False) -> Optional[str]:
    needs, devices, _, _ = IMPLS[name]
    interpreted = named and name in _TRITON and device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if device not in devices and not interpreted:
        return f"runs on {'/'.join(devices)} only" + (" (or a CPU under TRITON_INTERPRET=1)" if name in _TRITON else "")
    for mod in needs:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} not importable"
    if name == "torch-linear-ce" and not hasattr(torch.nn.functional, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy"
    return None


def _forward(name: str, y: torch.Tensor) -> Callable:
    """``f(h, W, validate) -> (logprob, entropy or None)`` of one implementation."""
    from dualvp_torch import linear_logprob_entropy, logprob_entropy

    if name == "dualvp-fused":
        return lambda h, w, validate=True: linear_logprob_entropy(h, w, y, validate=validate)
    if name == "dualvp-fused-triton":
        return lambda h, w, validate=True: linear_logprob_entropy(h, w, y, validate=validate, impl="triton")
    if name == "dualvp-unfused":
        return lambda h, w, validate=True: logprob_entropy(h @ w.T, y, validate=validate)
    if name == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, validate=True: (-linear_cross_entropy(h, w, y, reduction="none").float(), None)
    if name == "liger-flce":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda h, w, validate=True: (-liger_fused_linear_cross_entropy(h, w, y, reduction="none").float(),
                                            None)
    if name == "torch-linear-ce":
        return lambda h, w, validate=True: (-torch.nn.functional.linear_cross_entropy(
            h, w, y, reduction="none").float(), None)
    raise KeyError(name)


def _allocation_peak(fn) -> int:
    """The most bytes allocated at once during ``fn()`` (torch's CPU allocation trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _maxabs(x, ref) -> Optional[float]:
    return None if x is None else float((x.detach().double() - ref).abs().max())


def _note_row(env: dict, name: str, T: int, H: int, V: int, dtype: str, note: str) -> dict:
    return dict(env, impl=name, op="linear", dtype=dtype, T=T, V_local=V, H=H, W=1, note=note[:300])


def run_shape(T: int, H: int, V: int, dtype: torch.dtype, impls: list, device: str, env: dict, bandwidth: float,
              reps: int, warmup: int, loop: int, profiled: int,
              on_row: Optional[Callable[[dict], None]] = None) -> list:
    """One (shape, dtype): a results row per implementation, printed and passed to ``on_row`` as it comes.

    An implementation that is skipped at this dtype (:data:`_SKIP`) or raises (any exception: a
    compile error, an assertion, out of memory) gets a row saying so (``note``), and the loop goes on.
    """
    g = torch.Generator().manual_seed(0)
    # LM-like scale: logits of std ~3 (hidden ~N(0,1), weight ~N(0, 9/H))
    h0 = torch.randn(T, H, generator=g).to(dtype).to(device)
    w0 = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dtype).to(device)
    y = torch.randint(0, V, (T,), generator=g).to(device)
    gl = torch.randn(T, generator=g).to(device)
    ge = (torch.randn(T, generator=g) * 0.1).to(device)
    ones, zeros = torch.ones_like(gl), torch.zeros_like(ge)
    itemsize = h0.element_size()
    B, grads = T * V * itemsize, (T * H + V * H) * itemsize
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    dname = str(dtype).replace("torch.", "")
    refs: dict = {}
    rows = []

    def emit(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)

    for name in impls:
        if (name, dname) in _SKIP:
            print(f"skipping {name} in {dname}: {_SKIP[name, dname]}", flush=True)
            emit(_note_row(env, name, T, H, V, dname, f"skipped: {_SKIP[name, dname]}"))
            continue
        _, _, has_entropy, per_row = IMPLS[name]
        ugl, uge = (gl if per_row else -ones), (ge if has_entropy else zeros)
        h = w = lp = en = dh = dw = None
        try:
            f = _forward(name, y)
            h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)

            def fwd(validate=True, h=h, w=w, f=f):
                return f(h, w, validate)

            def bwd(out, ugl=ugl, uge=uge, has_entropy=has_entropy):
                lp, en = out
                loss = (lp.float() * ugl).sum() + ((en.float() * uge).sum() if has_entropy else 0)
                loss.backward()

            def clear(h=h, w=w):
                h.grad = w.grad = None

            rec, (lp, en, dh, dw) = timing.measure(
                (fwd, bwd), clear, B, reps=reps, warmup=warmup, loop=loop, sync=sync,
                peak=(lambda: timing.CudaPeak(torch)) if cuda else timing.NoPeak, fast_step=(lambda: fwd(False), bwd),
                torch=torch if cuda else None, profiled=profiled if cuda else 0,
                snapshot=lambda out, h=h, w=w: (out[0].detach(), None if out[1] is None else out[1].detach(),
                                                h.grad, w.grad))
            if not cuda:
                extra = _allocation_peak(lambda: (bwd(fwd()), clear())) - grads
            else:
                extra = rec["peak_extra_B"] * B - grads
            key = (per_row, has_entropy)
            if key not in refs:
                refs[key] = oracle(h0, w0, y, ugl, uge)
            r = refs[key]
            row = dict(env, impl=name, op="linear", dtype=dname, mode="lp+ent+grad" if has_entropy else "lp", T=T,
                       V_local=V, H=H, W=1, wall_ms=rec["wall_ms"], fwd_ms=rec["fwd_ms"], bwd_ms=rec["bwd_ms"],
                       kernel_ms=rec.get("kernel_ms"), queued_ms=rec.get("queued_ms"), host_us=rec.get("host_us"),
                       launches=rec.get("launches"), first_ms=rec.get("first_ms"), peak_extra_B=extra / B,
                       floor_ms=timing.floor_ms(B, bandwidth), tflops=8 * T * H * V / (rec["wall_ms"] * 1e-3) / 1e12,
                       err_logprob=_maxabs(lp, r[0]), err_entropy=_maxabs(en, r[1]) if has_entropy else None,
                       err_dh=_maxabs(dh, r[2]), err_dW=_maxabs(dw, r[3]), reps=rec["reps"])
        except Exception as e:  # a row with the error; the next implementation runs
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            print(f"{dname:9s} {T}x{H}x{V} {name:20s} failed: {msg}", flush=True)
            emit(_note_row(env, name, T, H, V, dname, f"error: {msg}"))
            del h, w, lp, en, dh, dw
            if cuda:
                torch.cuda.empty_cache()
            continue
        emit(row)
        print(f"{row['dtype']:9s} {T}x{H}x{V} {name:20s} {row['wall_ms']:9.2f} ms  {row['tflops']:7.2f} TFLOP/s  "
              f"extra {row['peak_extra_B']:6.3f} B  err lp {row['err_logprob']:.1e} H "
              f"{'-' if row['err_entropy'] is None else format(row['err_entropy'], '.1e')} dh {row['err_dh']:.1e} "
              f"dW {row['err_dW']:.1e}", flush=True)
        del lp, en, dh, dw, h, w
    return rows


def run_args(args) -> int:
    """``dualvp bench --op linear`` (the bench's parsed arguments); returns the exit status (1 when an
    implementation failed: its rows say why)."""
    device = args.device
    # bfloat16 first, whatever the order asked: the op's main case comes back first from a run cut short
    dtypes = sorted((args.dtypes or "bfloat16,float32").split(","), key=lambda d: d != "bfloat16")
    named = args.impls is not None
    impls = (args.impls or ",".join(IMPLS)).split(",")
    bad = [i for i in impls if i not in IMPLS] + [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad:
        print(f"dualvp bench: --op linear: unknown {bad}; --impls from {','.join(IMPLS)}, --dtypes float32,bfloat16")
        return 2
    run = []
    env = results.environment(device)
    path = args.results or results.default_path(device)
    n = 0
    failed = False

    def on_row(row):  # appended as it comes: a run cut short keeps its rows
        nonlocal n, failed
        failed = failed or str(row.get("note") or "").startswith("error")
        if path != "none":
            n += results.append(path, [row])

    for i in impls:
        why = _available(i, device, named)
        if why:
            print(f"skipping {i}: {why}")
        else:
            run.append(i)
    shapes = (args.shapes.split(",") if args.shapes else _QUICK_SHAPES if args.quick else _DEFAULT_SHAPES[device])
    cuda = device == "cuda"
    reps = args.reps or (3 if cuda else 1 if args.quick else 3)
    bandwidth = timing.copy_bandwidth(device)
    for d in dtypes:
        for s in shapes:
            T, H, V = (int(x) for x in s.lower().split("x"))
            run_shape(T, H, V, getattr(torch, d), run, device, env, bandwidth, reps,
                      warmup=1 if args.warmup is None else args.warmup, loop=args.loop or 3, profiled=1, on_row=on_row)
    if n:
        print(f"appended {n} rows to {path}")
    return 1 if failed else 0
