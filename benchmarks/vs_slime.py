"""Side by side, in one process: dualvp_torch vs slime's fused op, the previous
dualvp revision, and a plain eager torch baseline (W = 1, CPU or one GPU).

slime is not a dependency and none of its code is in this repository: pass the
root of a checkout (the directory that holds ``slime/utils/ppo_utils.py``) with
``--slime-path``; only that file is loaded (it imports nothing but torch).
The previous revision is optional: ``--prev-path`` is a directory holding that
revision's ``dualvp/`` and ``dualvp_torch/`` (e.g. ``git archive f070efc dualvp
dualvp_torch | tar -x -C /tmp/prev``); it is imported under its own module
names next to the current one.

Implementations (each timed as forward + backward with ``torch.autograd.grad``
with respect to non-leaf logits, upstream gradients random; the in-place ones
get a fresh copy of the logits per repetition, made outside the timer):

  slime             slime's _VocabParallelLogProbEntropy (group None)
  dualvp            dualvp_torch.logprob_entropy, impl="compiled"
  dualvp-inplace    the same with inplace_grad=True
  dualvp-eager      impl="eager" (the fallback without a compiler)
  prev, prev-inplace, prev-eager   the previous revision, same modes
  torch-eager       plain torch: log_softmax, gather, entropy, autograd

Modes: ``lp`` (log-prob only), ``ent`` (log-prob + entropy, both
differentiated), ``mask`` (ent with a 50% keep mask), and the forwards alone
``fwd`` / ``fwd-mask`` (dualvp, compiled). Floors: reading the shard once
(``amax``), writing a fresh gradient-sized buffer (``empty + fill``), one
read + write pass (``mul``), and, compiled, one exponential per element summed
with float64 accumulation (what every forward does: ``exp+sum``) or written to
a fresh buffer (what every backward that writes a fresh gradient does:
``exp+write``).

Comparing two dualvp revisions: run this script once per revision, each as the
current code (``python DIR/benchmarks/vs_slime.py`` with ``DIR`` that
revision's tree): ``--prev-path`` loads the previous revision into the same
process under the same module names, and dynamo's guards resolve the spec by
module name, so a compiled ``prev`` falls back to eager there.

Timing: for every (dtype, mode), ``--rounds`` rounds; in each round every
implementation runs ``--reps`` repetitions back to back (implementations
interleaved round by round); each implementation's figure is the best over
rounds of the per-round median. Errors are against the float64 oracle on the
first ``--check-rows`` rows. Peak extra memory (bytes allocated beyond the
inputs, forward + backward, in units of the shard's bytes ``B``) comes from
the profiler's allocation trace on CPU (dualvp's eager path measured with its
chunks in the calling thread: the trace misses worker threads) and from
``torch.cuda.max_memory_allocated`` on a GPU.

Usage::

    python benchmarks/vs_slime.py --slime-path /tmp/slime --prev-path /tmp/prev \\
        --T 2048 --V 32000 --dtypes float32,bfloat16 --out bench.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_slime(path):
    file = os.path.join(path, "slime", "utils", "ppo_utils.py")
    spec = importlib.util.spec_from_file_location("_slime_ppo_utils", file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._VocabParallelLogProbEntropy


def _load_dualvp(path=None):
    """Import dualvp + dualvp_torch from ``path`` (or the repo) under private names."""
    saved = {k: v for k, v in sys.modules.items() if k == "dualvp" or k.startswith(("dualvp.", "dualvp_torch"))}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, path or HERE)
    try:
        import dualvp_torch  # noqa: F401

        mods = {k: v for k, v in sys.modules.items() if k == "dualvp" or k.startswith(("dualvp.", "dualvp_torch"))}
    finally:
        sys.path.pop(0)
        for k in list(sys.modules):
            if k == "dualvp" or k.startswith(("dualvp.", "dualvp_torch")):
                del sys.modules[k]
        sys.modules.update(saved)
    return mods["dualvp_torch"]


def _torch_eager(z, y, keep, with_entropy):
    logp = torch.log_softmax(z.float(), dim=-1)
    if keep is not None:  # the target is always kept
        keep = keep.scatter(-1, y[:, None], True)
    lq = logp if keep is None else torch.log_softmax(z.float().masked_fill(~keep, float("-inf")), dim=-1)
    lp = lq.gather(-1, y[:, None])[:, 0]
    if not with_entropy:
        return lp, None
    h = -(logp.exp() * logp).sum(-1)
    return lp, h


class _Env:
    def __init__(self, **kw):
        self.kw = kw

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in self.kw}
        os.environ.update(self.kw)

    def __exit__(self, *a):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_impls(slime_path, prev_path):
    cur = _load_dualvp()
    impls = {}

    def dualvp_fn(mod, inplace, eager=False):
        # The implementation through DUALVP_COMPILE (read at each call), which
        # revisions before the impl= argument understand too.
        def f(z, y, keep, with_entropy):
            with _Env(DUALVP_COMPILE="0" if eager else "1"):
                return mod.logprob_entropy(z, y, keep_mask=keep, with_entropy=with_entropy, inplace_grad=inplace)
        f.inplace = inplace
        f.kernels = mod.kernels
        return f

    if slime_path:
        op = _load_slime(slime_path)

        def slime(z, y, keep, with_entropy):
            lp, h = op.apply(z, y, keep, None, with_entropy, True)
            return lp.reshape(-1), (h if with_entropy else None)

        slime.inplace = False
        impls["slime"] = slime
    impls["dualvp"] = dualvp_fn(cur, False)
    impls["dualvp-inplace"] = dualvp_fn(cur, True)
    impls["dualvp-eager"] = dualvp_fn(cur, False, eager=True)
    if prev_path:
        prev = _load_dualvp(prev_path)
        impls["prev"] = dualvp_fn(prev, False)
        impls["prev-inplace"] = dualvp_fn(prev, True)
        impls["prev-eager"] = dualvp_fn(prev, False, eager=True)
    te = lambda z, y, keep, w: _torch_eager(z, y, keep, w)  # noqa: E731
    te.inplace = False
    impls["torch-eager"] = te
    return impls


@torch.compile(dynamic=True)
def _exp_sum(z):
    return torch.exp(z.float()).sum(-1, dtype=torch.float64)


@torch.compile(dynamic=True)
def _exp_write(z):
    return torch.exp(z.float()).to(z.dtype)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _step(fn, base, y, keep, with_entropy, gl, ge, fwd_only=False):
    leaf = base  # requires grad
    z = leaf.clone() if fn.inplace else leaf.view_as(leaf)  # non-leaf logits
    return z, (lambda: _run(fn, z, y, keep, with_entropy, gl, ge, fwd_only))


def _run(fn, z, y, keep, with_entropy, gl, ge, fwd_only):
    if fwd_only:
        with torch.no_grad():
            return fn(z, y, keep, with_entropy)
    lp, h = fn(z, y, keep, with_entropy)
    loss = (lp * gl).sum()
    if h is not None and h.requires_grad:
        loss = loss + (h * ge).sum()
    (g,) = torch.autograd.grad(loss, z)
    return lp.detach(), (None if h is None else h.detach()), g


def _peak_extra(fn, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _errors(out, ref, rows):
    lp, h, g = out
    rl, rh, rg = ref
    e = {"logprob": float(np.max(np.abs(lp[:rows].detach().double().cpu().numpy() - rl)))}
    if h is not None and rh is not None:
        e["entropy"] = float(np.max(np.abs(h[:rows].detach().double().cpu().numpy() - rh)))
    if g is not None:
        e["grad"] = float(np.max(np.abs(g[:rows].detach().double().cpu().numpy() - rg)))
    return e


MODES = {
    "lp": dict(with_entropy=False, mask=False),
    "ent": dict(with_entropy=True, mask=False),
    "mask": dict(with_entropy=True, mask=True),
    "fwd": dict(with_entropy=True, mask=False, fwd_only=True),
    "fwd-mask": dict(with_entropy=True, mask=True, fwd_only=True),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slime-path", default=None)
    ap.add_argument("--prev-path", default=None)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="lp,ent,mask,fwd,fwd-mask")
    ap.add_argument("--impls", default=None, help="comma-separated subset")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--check-rows", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    impls = make_impls(args.slime_path, args.prev_path)
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    from dualvp import reference

    results = {"T": args.T, "V": args.V, "device": str(dev), "threads": torch.get_num_threads(), "rows": []}
    rng = torch.Generator().manual_seed(0)
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        z0 = (torch.randn(args.T, args.V, generator=rng) * 2.0)
        z0[:, :8] += 8.0  # a few confident columns, as in an LM
        z0 = z0.to(dtype).to(dev)
        y = torch.randint(0, args.V, (args.T,), generator=rng).to(dev)
        keep = (torch.rand(args.T, args.V, generator=rng) < 0.5).to(dev)
        gl, ge = torch.randn(args.T, generator=rng).to(dev), torch.randn(args.T, generator=rng).to(dev)
        B = z0.numel() * z0.element_size()
        zr = z0[: args.check_rows].double().cpu().numpy()
        yr = y[: args.check_rows].cpu().numpy()
        floors = {}
        for name, f in (
            ("read (amax)", lambda: torch.amax(z0, dim=-1)),
            ("write (empty+fill)", lambda: torch.empty_like(z0).fill_(1.0)),
            ("read+write (mul)", lambda: z0 * 2),
            # what any forward must do: one exponential per element, summed
            ("exp+sum (compiled)", lambda: _exp_sum(z0)),
            # what any fresh-buffer backward must do: one exponential per element, written
            ("exp+write (compiled)", lambda: _exp_write(z0)),
        ):
            f()  # compile
            ts = []
            for _ in range(5):
                _sync(dev)
                t0 = time.perf_counter()
                f()
                _sync(dev)
                ts.append(time.perf_counter() - t0)
            floors[name] = min(ts)
        results.setdefault("floors", {})[dname] = floors
        print(f"# {dname} T={args.T} V={args.V} B={B / 2**20:.0f} MiB floors: "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in floors.items()), flush=True)
        for mode in args.modes.split(","):
            m = MODES[mode]
            k = keep if m["mask"] else None
            fwd_only = m.get("fwd_only", False)
            names = [n for n in impls if not (fwd_only and "inplace" in n)]
            km = None if k is None else k[: args.check_rows].cpu().numpy()
            rl, rh = reference.logprob_entropy(zr, yr, keep_mask=km)
            rg = reference.logprob_entropy_grad(
                zr, yr, gl[: args.check_rows].double().cpu().numpy(),
                ge[: args.check_rows].double().cpu().numpy() if m["with_entropy"] else np.zeros(args.check_rows),
                keep_mask=km,
            )
            ref = (rl, rh if m["with_entropy"] else None, rg)
            times = {n: [] for n in names}
            info = {}
            for n in names:  # warm-up (compilation), errors, memory
                leaf = z0.clone().requires_grad_(True)
                z, run = _step(impls[n], leaf, y, k, m["with_entropy"], gl, ge, fwd_only)
                t0 = time.perf_counter()
                out = run()
                info[n] = {"first_call_s": time.perf_counter() - t0}
                if not fwd_only:
                    info[n]["errors"] = _errors(out, ref, args.check_rows)
                del out, z, run
                if not args.no_memory:
                    z, run = _step(impls[n], leaf, y, k, m["with_entropy"], gl, ge, fwd_only)
                    # The eager path's chunks in the calling thread, where the
                    # profiler sees their allocations (on worker threads it
                    # does not; one worker's chunks hold the whole budget).
                    kern = getattr(impls[n], "kernels", None)
                    kern = kern if hasattr(kern, "MAX_EAGER_WORKERS") else None
                    saved = kern and kern.MAX_EAGER_WORKERS
                    if kern:
                        kern.MAX_EAGER_WORKERS = 1
                    try:
                        info[n]["peak_extra_B"] = _peak_extra(run, dev) / B
                    finally:
                        if kern:
                            kern.MAX_EAGER_WORKERS = saved
                    del z, run
            for _ in range(args.rounds):
                for n in names:
                    leaf = z0.clone().requires_grad_(True)
                    ts = []
                    for _ in range(args.reps):
                        z, run = _step(impls[n], leaf, y, k, m["with_entropy"], gl, ge, fwd_only)
                        _sync(dev)
                        t0 = time.perf_counter()
                        out = run()
                        _sync(dev)
                        ts.append(time.perf_counter() - t0)
                        del out, z, run
                    times[n].append(statistics.median(ts))
            for n in names:
                row = {"dtype": dname, "mode": mode, "impl": n, "time_s": min(times[n]), "rounds": times[n], **info[n]}
                results["rows"].append(row)
                err = row.get("errors", {})
                print(f"{dname:9s} {mode:9s} {n:15s} {row['time_s'] * 1e3:8.1f} ms  "
                      f"mem {row.get('peak_extra_B', float('nan')):.3f} B  "
                      + " ".join(f"{q} {v:.1e}" for q, v in err.items()), flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
