"""``dualvp bench``: speed, memory and precision against baselines, in one run.

Every implementation runs in its own subprocess (:mod:`dualvp._bench_worker`),
once per (size, dtype), so the peak memory it reports is its own. The parent
makes the inputs (confident-LM logits: N(10, 3) with +25 spikes, targets
sampled from the softmax, a top-k=64 keep mask, random upstream gradients),
computes the float64 oracle (:mod:`dualvp.reference`) once per (size, dtype),
compares each implementation's outputs with it, prints a table while it runs,
and writes a JSON file and a PNG chart.

Implementations:

- ``dualvp-torch``: :func:`dualvp_torch.logprob_entropy`, compiled kernels;
- ``dualvp-torch-eager``: the same with ``DUALVP_COMPILE=0``;
- ``dualvp-jax``: :func:`dualvp_jax.logprob_entropy` under ``jax.jit``;
- ``torch-eager``: ``log_softmax`` + ``gather``, entropy ``-(p * log p).sum``,
  autograd, in the input dtype (masked log-prob: ``log_softmax`` over
  ``where(keep | onehot, z, -inf)``);
- ``jax-naive``: the same in JAX under ``jit`` (``jax.vjp``);
- ``megatron``: Megatron-core's ``fused_vocab_parallel_cross_entropy``
  (gloo group) plus an unfused vocab-parallel entropy (all-reduce MAX, SUM,
  SUM; saves the softmax), the path RL frameworks used before fusing; only
  when ``megatron-core`` is importable.

Timing: wall clock of forward and backward separately, median over ``reps``
calls after the first call (reported apart as ``first_call_s``: it includes
compilation) and ``warmup`` untimed calls. ``fwdbwd_s`` is the median of the
per-call sums.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from . import cases, reference
from ._bench_worker import MODES

IMPLS = ("dualvp-torch", "dualvp-torch-eager", "dualvp-jax", "torch-eager", "jax-naive", "megatron")
BASELINES = ("torch-eager", "jax-naive", "megatron")
_NEEDS = {
    "dualvp-torch": ("torch", "dualvp_torch"),
    "dualvp-torch-eager": ("torch", "dualvp_torch"),
    "dualvp-jax": ("jax", "dualvp_jax"),
    "torch-eager": ("torch",),
    "jax-naive": ("jax",),
    "megatron": ("torch", "megatron.core"),
}
TOPK = 64
MEMORY_METHOD = (
    "peak extra RSS of one forward+backward in the implementation's own process: "
    "after gc.collect() and malloc_trim(0), the kernel's peak-RSS counter is reset "
    "(echo 5 > /proc/self/clear_refs); extra = VmHWM after the call - VmRSS before it. "
    "Inputs are allocated before; the returned gradient counts. Reported as a multiple of "
    "B = bytes of the logits (shard) in their dtype."
)


# --------------------------------------------------------------------------- options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny size, float32, few reps (about a minute)")
    p.add_argument("--sizes", default=None, help="comma list of TxV_local (default 2048x32000,2048x152064)")
    p.add_argument("--dtypes", default=None, help="comma list of float32,bfloat16 (default both)")
    p.add_argument("--impls", default=None, help=f"comma list of {','.join(IMPLS)} (default all available)")
    p.add_argument("--modes", default=None, help=f"comma list of {','.join(MODES)} (default all)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per mode (default 3; 2 for >1e8 elements)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls after the first, untimed one (default 0)")
    p.add_argument("--worlds", default=None, help="comma list of gloo world sizes W>1 for the collectives run "
                   "(default 2,4; 'none' to skip)")
    p.add_argument("--gloo-size", default=None, help="TxV_local of the gloo run (default 256x4096)")
    p.add_argument("--err-rows", type=int, default=256, help="rows whose gradient is compared with float64")
    p.add_argument("--out", default="bench-results/bench.json", help="JSON path; the PNG goes next to it")
    p.add_argument("--png", default=None, help="chart path (default: --out with .png)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, metavar="JSON",
                   help="print the Markdown tables of an existing result file (no run)")
    p.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds per worker process")


def _split(s: Optional[str], default):
    if s is None:
        return list(default)
    return [x.strip() for x in s.split(",") if x.strip()]


def _size(s: str) -> tuple[int, int]:
    t, v = s.lower().split("x")
    return int(t), int(v)


# --------------------------------------------------------------------------- environment


def _available(impl: str) -> Optional[str]:
    """``None`` when ``impl`` can run here, else the reason it cannot."""
    for mod in _NEEDS[impl]:
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} not importable"
        except (ImportError, ValueError) as e:
            return f"{mod} not importable ({e})"
    if impl in ("dualvp-torch", "dualvp-torch-eager") and importlib.util.find_spec("dualvp_torch.function") is None:
        return "dualvp_torch.function missing"
    return None


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def _git() -> Optional[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "dualvp", "dualvp_torch",
                                "dualvp_jax"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) or None
    except Exception:
        return None


def _machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "jax": _version("jax"),
        "numpy": np.__version__,
        "megatron-core": _version("megatron-core"),
        "gpu": None,
    }


# --------------------------------------------------------------------------- inputs and oracle


def make_inputs(T: int, V: int, seed: int, chunk: int = 64) -> dict:
    """Confident-LM logits (float64 in chunks -> float32), sampled targets,
    top-k keep mask and upstream gradients; deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    z = np.empty((T, V), dtype=np.float32)
    target = np.empty(T, dtype=np.int64)
    keep = np.zeros((T, V), dtype=bool)
    k = min(TOPK, V)
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        zc = cases.confident_lm_logits(rng, (b - a, V))
        z[a:b] = zc
        # the sampled token: Gumbel-max over softmax(z)
        g = rng.gumbel(size=(b - a, V))
        target[a:b] = np.argmax(zc + g, axis=-1)
        del g
        top = np.argpartition(-z[a:b], k - 1, axis=-1)[:, :k]
        np.put_along_axis(keep[a:b], top, True, axis=-1)
    gl = rng.normal(size=T).astype(np.float32)
    gh = rng.normal(size=T).astype(np.float32)
    return {"logits": z, "target": target, "keep": keep, "gl": gl, "gh": gh}


def round_logits(z32: np.ndarray, dtype: str, chunk: int = 256) -> np.ndarray:
    if dtype == "float32":
        return z32
    out = np.empty_like(z32)
    for a in range(0, z32.shape[0], chunk):
        out[a : a + chunk] = cases.round_to_dtype(z32[a : a + chunk], dtype)
    return out


class Oracle:
    """float64 reference outputs on the full (unsharded) logits.

    Log-prob and entropy over all rows; the gradient over the first
    ``err_rows`` rows (the rows are i.i.d., the row subset keeps the float64
    gradient small). Computed lazily per (mask, entropy-grad) and cached.
    """

    def __init__(self, inputs: dict, z: np.ndarray, err_rows: int, chunk: int = 64):
        self.inp, self.z, self.rows, self.chunk = inputs, z, min(err_rows, z.shape[0]), chunk
        self._fwd: dict = {}
        self._grad: dict = {}

    def forward(self, masked: bool):
        if masked not in self._fwd:
            T = self.z.shape[0]
            lp, h = np.empty(T), np.empty(T)
            for a in range(0, T, self.chunk):
                sl = slice(a, a + self.chunk)
                km = self.inp["keep"][sl] if masked else None
                lp[sl], h[sl] = reference.logprob_entropy(self.z[sl], self.inp["target"][sl], keep_mask=km)
            self._fwd[masked] = (lp, h)
        return self._fwd[masked]

    def grad(self, masked: bool, ent_grad: bool):
        key = (masked, ent_grad)
        if key not in self._grad:
            g = np.empty((self.rows, self.z.shape[1]))
            for a in range(0, self.rows, self.chunk):
                sl = slice(a, min(self.rows, a + self.chunk))
                km = self.inp["keep"][sl] if masked else None
                g[sl] = reference.logprob_entropy_grad(
                    self.z[sl], self.inp["target"][sl], self.inp["gl"][sl].astype(np.float64),
                    self.inp["gh"][sl].astype(np.float64) if ent_grad else None, keep_mask=km,
                )
            self._grad[key] = g
        return self._grad[key]


def _maxabs(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    d = np.abs(x - ref)
    both_inf = (x == ref)  # equal infinities are no error
    d = np.where(both_inf, 0.0, d)
    return float(np.max(d)) if d.size else 0.0


def errors(oracle: Oracle, mode: str, lp, h, g) -> dict:
    with_ent, ent_grad, masked = MODES[mode]
    rlp, rh = oracle.forward(masked)
    out = {"logprob": _maxabs(lp, rlp), "entropy": _maxabs(h, rh) if with_ent else None}
    rg = oracle.grad(masked, ent_grad)
    out["grad"] = _maxabs(g[: rg.shape[0]], rg)
    out["grad_rows"] = int(rg.shape[0])
    return out


# --------------------------------------------------------------------------- workers


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(impl: str) -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("DUALVP_COMPILE", None)
    if impl == "dualvp-torch-eager":
        env["DUALVP_COMPILE"] = "0"
    # one host device for JAX in the workers, whatever the caller set
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f)
    env["XLA_FLAGS"] = flags
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_workers(specs: list[dict], work: str, timeout: float, on_record) -> list[str]:
    """Start one worker per spec (all at once: the ranks of one gloo group, or
    a single implementation); stream their records; return error strings."""
    procs = []
    for i, spec in enumerate(specs):
        path = os.path.join(work, f"spec_{i}.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        log = open(os.path.join(work, f"worker_{spec['impl']}_{i}.log"), "w")
        p = subprocess.Popen(
            [sys.executable, "-m", "dualvp._bench_worker", path],
            stdout=subprocess.PIPE, stderr=log, text=True, env=_env(spec["impl"]),
        )
        procs.append((p, log, spec))
    errs: list[str] = []
    deadline = time.monotonic() + timeout
    import threading

    def pump(p, spec):
        for line in p.stdout:
            if line.startswith("@@"):
                rec = json.loads(line[2:])
                if rec["kind"] == "error":
                    errs.append(rec["error"])
                    tb = rec.get("traceback", "")
                    if tb:
                        print(tb, file=sys.stderr)
                else:
                    on_record(rec, spec)

    threads = [threading.Thread(target=pump, args=(p, s), daemon=True) for p, _, s in procs]
    for t in threads:
        t.start()
    for (p, log, spec), t in zip(procs, threads):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            errs.append(f"timeout after {timeout:.0f}s")
        except BaseException:  # interrupted: take the workers down with us
            for q, _, _ in procs:
                q.kill()
            raise
        t.join(timeout=10)
        log.close()
        if p.returncode not in (0, None) and not errs:
            with open(log.name) as f:
                tail = f.read()[-2000:]
            errs.append(f"exit code {p.returncode}: {tail.strip().splitlines()[-1] if tail.strip() else ''}")
    return errs


# --------------------------------------------------------------------------- table


def _progress(msg: str) -> None:
    if sys.stdout.isatty():
        sys.stdout.write("\r" + msg[:110].ljust(110) + ("\r" if not msg else ""))
        sys.stdout.flush()


_COLS = (
    ("size", 14), ("dtype", 9), ("mode", 17), ("impl", 19), ("first", 8), ("fwd", 8), ("bwd", 8),
    ("f+b", 8), ("cpu", 8), ("mem/B", 6), ("err lp", 9), ("err H", 9), ("err grad", 9),
)


def _fmt_s(x):
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _fmt_e(x):
    return "-" if x is None else f"{x:.1e}"


def header() -> str:
    return "  ".join(f"{n:>{w}}" if i >= 4 else f"{n:<{w}}" for i, (n, w) in enumerate(_COLS))


def row(r: dict) -> str:
    e = r.get("errors") or {}
    first = r.get("first_call_s")
    vals = (
        f"{r['T']}x{r['V_local']}" + (f"/W{r['world']}" if r.get("world", 1) > 1 else ""),
        r["dtype"], r["mode"], r["impl"],
        _fmt_s(first["fwd"] + first["bwd"]) if first else "-",
        _fmt_s(r.get("fwd_s")), _fmt_s(r.get("bwd_s")), _fmt_s(r.get("fwdbwd_s")), _fmt_s(r.get("cpu_fwdbwd_s")),
        "-" if r.get("peak_extra_B") is None else f"{r['peak_extra_B']:.2f}",
        _fmt_e(e.get("logprob")), _fmt_e(e.get("entropy")), _fmt_e(e.get("grad")),
    )
    return "  ".join(f"{v:>{w}}" if i >= 4 else f"{v:<{w}}" for i, ((_, w), v) in enumerate(zip(_COLS, vals)))


# --------------------------------------------------------------------------- summary / goals


def summarize(results: list[dict]) -> dict:
    """Ratios behind the goals of the benchmark issue, per (size, dtype, mode)."""
    key = lambda r: (r["T"], r["V_local"], r["dtype"], r["mode"])  # noqa: E731
    by: dict = {}
    for r in results:
        if r.get("world", 1) == 1 and r.get("fwdbwd_s") is not None:
            by.setdefault(key(r), {})[r["impl"]] = r
    rows = []
    for k, d in sorted(by.items()):
        t = d.get("dualvp-torch")
        if t is None:
            continue
        s = {"T": k[0], "V_local": k[1], "dtype": k[2], "mode": k[3], "dualvp_torch_fwdbwd_s": t["fwdbwd_s"],
             "dualvp_torch_mem_B": t["peak_extra_B"]}
        for b in BASELINES:
            if b in d:
                s[f"speedup_vs_{b}"] = d[b]["fwdbwd_s"] / t["fwdbwd_s"]
                if d[b].get("cpu_fwdbwd_s") and t.get("cpu_fwdbwd_s"):
                    s[f"cpu_speedup_vs_{b}"] = d[b]["cpu_fwdbwd_s"] / t["cpu_fwdbwd_s"]
                for q in ("entropy", "grad"):
                    te, be = (t.get("errors") or {}).get(q), (d[b].get("errors") or {}).get(q)
                    if te is not None and be is not None:
                        s[f"{q}_err_ratio_{b}"] = be / te if te > 0 else float("inf")
        if "dualvp-jax" in d:
            s["jax_over_torch"] = d["dualvp-jax"]["fwdbwd_s"] / t["fwdbwd_s"]
        if "dualvp-torch-eager" in d:
            s["eager_over_compiled"] = d["dualvp-torch-eager"]["fwdbwd_s"] / t["fwdbwd_s"]
        rows.append(s)

    def check(name, vals, ok):
        vals = [v for v in vals if v is not None]
        if not vals:
            return {"goal": name, "status": "not measured"}
        return {"goal": name, "status": "met" if all(ok(v) for v in vals) else "missed",
                "worst": min(vals) if ok(1e300) else max(vals), "n": len(vals)}

    goals = [
        check("dualvp-torch fwd+bwd >= 4x faster than torch-eager", [s.get("speedup_vs_torch-eager") for s in rows],
              lambda v: v >= 4),
        check("dualvp-torch fwd+bwd >= 3x faster than megatron", [s.get("speedup_vs_megatron") for s in rows],
              lambda v: v >= 3),
        check("dualvp-torch peak extra memory <= 1.1 B", [s.get("dualvp_torch_mem_B") for s in rows],
              lambda v: v <= 1.1),
        check("entropy error >= 10x smaller than every baseline",
              [s.get(f"entropy_err_ratio_{b}") for s in rows for b in BASELINES], lambda v: v >= 10),
        check("gradient error >= 10x smaller than every baseline",
              [s.get(f"grad_err_ratio_{b}") for s in rows for b in BASELINES], lambda v: v >= 10),
        check("dualvp-jax within 2x of dualvp-torch", [s.get("jax_over_torch") for s in rows], lambda v: v <= 2),
    ]
    return {"per_case": rows, "goals": goals}


# --------------------------------------------------------------------------- chart


def chart(doc: dict, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # matplotlib is the bench extra
        return f"no chart: {e}"
    res = [r for r in doc["results"] if r.get("world", 1) == 1 and r.get("fwdbwd_s") is not None]
    if not res:
        return "no chart: no results"
    groups = sorted({(r["T"], r["V_local"], r["dtype"]) for r in res})
    impls = [i for i in IMPLS if any(r["impl"] == i for r in res)]
    modes = [m for m in MODES if any(r["mode"] == m for r in res)]
    fig, axes = plt.subplots(3, len(groups), figsize=(5.5 * len(groups), 11), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for j, g in enumerate(groups):
        for row_i, (field, label, log) in enumerate(
            (("fwdbwd_s", "fwd+bwd seconds (median)", True), ("peak_extra_B", "peak extra RSS / B", False),
             ("grad_err", "max abs grad error vs float64", True))
        ):
            ax = axes[row_i][j]
            for k, impl in enumerate(impls):
                ys = []
                for m in modes:
                    r = next((r for r in res if (r["T"], r["V_local"], r["dtype"]) == g and r["impl"] == impl
                              and r["mode"] == m), None)
                    if r is None:
                        ys.append(np.nan)
                    elif field == "grad_err":
                        ys.append((r.get("errors") or {}).get("grad", np.nan) or np.nan)
                    else:
                        ys.append(r[field])
                ax.bar(np.arange(len(modes)) + (k - (len(impls) - 1) / 2) * width, ys, width, label=impl)
            ax.set_xticks(np.arange(len(modes)))
            ax.set_xticklabels(modes, rotation=30, ha="right", fontsize=7)
            if log:
                ax.set_yscale("log")
            if row_i == 0:
                ax.set_title(f"T={g[0]} V_local={g[1]} {g[2]}", fontsize=9)
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
            if row_i == 1:
                ax.axhline(1.1, color="k", lw=0.6, ls="--")
    axes[0][0].legend(fontsize=7)
    m = doc["meta"]["machine"]
    fig.suptitle(f"dualvp bench on {m['cpu']} ({m['cpus']} CPUs), no GPU", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- main


def _write(doc: dict, path: str, t_start: float, complete: bool) -> None:
    """Write the JSON (also after every worker, so an interrupted run keeps its results)."""
    doc["summary"] = summarize(doc["results"])
    doc["meta"]["elapsed_s"] = time.monotonic() - t_start
    doc["meta"]["complete"] = complete
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_report(doc: dict) -> str:
    """Markdown tables of a result file: speed, memory and precision side by side."""
    impls = ["dualvp-torch", "torch-eager", "megatron", "dualvp-jax", "jax-naive", "dualvp-torch-eager"]
    by: dict = {}
    for r in doc["results"]:
        if r.get("world", 1) == 1:
            by.setdefault((r["T"], r["V_local"], r["dtype"]), {}).setdefault(r["mode"], {})[r["impl"]] = r
    present = [i for i in impls if any(i in m for d in by.values() for m in d.values())]
    m = doc["meta"]
    out = [f"Command: `{m['command']}`  ", f"Machine: {m['machine'].get('cpu')}, {m['machine'].get('cpus')} CPUs, "
           f"no GPU; torch {m['machine'].get('torch')}, jax {m['machine'].get('jax')}; git {m.get('git')}; "
           f"{m.get('date')}.", ""]
    for (T, V, dt), modes in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "float32")):
        out.append(f"**T={T}, V_local={V}, {dt}**: forward+backward seconds (median), speed-up of dualvp-torch, "
                   "peak extra memory / B, max abs error vs float64 (entropy, gradient)")
        out.append("")
        head = ["mode"] + [f"{i} s" for i in present] + ["x eager", "x megatron", "mem/B dualvp/eager/megatron",
                                                          "err H dualvp/eager/megatron", "err grad dualvp/eager/megatron"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for mode in [x for x in MODES if x in modes]:
            d = modes[mode]
            t = d.get("dualvp-torch", {})

            def get(i, k):
                return d.get(i, {}).get(k)

            def err(i, q):
                return (d.get(i, {}).get("errors") or {}).get(q)

            row = [mode] + [_fmt(get(i, "fwdbwd_s"), ".3f") for i in present]
            for b in ("torch-eager", "megatron"):
                tb, tt = get(b, "fwdbwd_s"), t.get("fwdbwd_s")
                row.append(_fmt(tb / tt if tb and tt else None, ".1f"))
            trio = ("dualvp-torch", "torch-eager", "megatron")
            row.append(" / ".join(_fmt(get(i, "peak_extra_B"), ".2f") for i in trio))
            row.append(" / ".join(_fmt(err(i, "entropy"), ".1e") for i in trio))
            row.append(" / ".join(_fmt(err(i, "grad"), ".1e") for i in trio))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    goals = (doc.get("summary") or {}).get("goals", [])
    if goals:
        out.append("Goals: " + "; ".join(f"{g['goal']}: **{g['status']}**"
                                          + (f" (worst {g['worst']:.3g})" if "worst" in g else "") for g in goals))
    return "\n".join(out)


def run(args) -> int:
    if args.report:
        with open(args.report) as f:
            print(markdown_report(json.load(f)))
        return 0
    quick = args.quick
    sizes = [_size(s) for s in _split(args.sizes, ["64x2048"] if quick else ["2048x32000", "2048x152064"])]
    dtypes = _split(args.dtypes, ["float32"] if quick else ["float32", "bfloat16"])
    modes = _split(args.modes, MODES)
    impls = _split(args.impls, IMPLS)
    worlds = [] if args.worlds == "none" else [int(w) for w in _split(args.worlds, ["2"] if quick else ["2", "4"])]
    gT, gV = _size(args.gloo_size or ("32x512" if quick else "256x4096"))
    for name, vals, allowed in (("dtype", dtypes, ("float32", "bfloat16")), ("mode", modes, MODES),
                                ("impl", impls, IMPLS)):
        bad = [v for v in vals if v not in allowed]
        if bad:
            print(f"dualvp bench: unknown {name} {bad}; expected {list(allowed)}", file=sys.stderr)
            return 2

    skipped = {}
    for impl in impls:
        why = _available(impl)
        if why:
            skipped[impl] = why
    run_impls = [i for i in impls if i not in skipped]
    out_json = args.out
    out_png = args.png or os.path.splitext(out_json)[0] + ".png"
    meta = {
        "command": "python -m dualvp bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git": _git(),
        "machine": _machine(),
        "sizes": [{"T": t, "V_local": v} for t, v in sizes],
        "dtypes": dtypes,
        "modes": modes,
        "impls": run_impls,
        "skipped": skipped,
        "memory_method": MEMORY_METHOD,
        "timing_method": ("wall clock (perf_counter), median of reps after the first call and warm-up; first_call_s "
                          "includes compile; cpu_fwdbwd_s = process CPU time of fwd+bwd (all threads), median"),
        "error_method": ("max abs error vs float64 dualvp.reference on the dtype-rounded inputs; log-prob and entropy "
                         "over all rows, gradient over the first --err-rows rows (default 256)"),
        "inputs": f"confident-LM logits N(10,3) + three +25 spikes per row; target sampled from softmax; "
                  f"keep mask = top-{TOPK} (+ target); upstream grads N(0,1); seed {args.seed}",
        "notes": "CPU only; the machine may be shared, so timings are noisy.",
    }
    doc = {"meta": meta, "results": [], "collectives": [], "failures": []}
    for impl, why in skipped.items():
        print(f"skipping {impl}: {why}")
    work = tempfile.mkdtemp(prefix="dualvp-bench-")

    def _term(signum, frame):  # so that the finally below removes the inputs
        raise KeyboardInterrupt(f"signal {signum}")

    import signal

    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread
        pass
    t_start = time.monotonic()
    try:
        print(f"dualvp bench: sizes {sizes}, dtypes {dtypes}, impls {run_impls}, modes {modes}")
        print(header())
        n_jobs = len(sizes) * len(dtypes) * len(run_impls)
        job = 0
        for T, V in sizes:
            big = T * V > 1e8
            reps = args.reps if args.reps is not None else (2 if big or quick else 3)
            warmup = args.warmup if args.warmup is not None else 0
            inp = make_inputs(T, V, args.seed)
            z32 = inp.pop("logits")
            for dtype in dtypes:
                ddir = os.path.join(work, f"data_{T}x{V}_{dtype}")
                os.makedirs(ddir)
                z = round_logits(z32, dtype)
                np.save(os.path.join(ddir, "logits.npy"), z)
                for k, v in inp.items():
                    np.save(os.path.join(ddir, k + ".npy"), v)
                oracle = Oracle(inp, z, args.err_rows)
                # the oracle first, so that it never competes with a worker for the CPU
                t_or = time.monotonic()
                for m in modes:
                    oracle.forward(MODES[m][2])
                    oracle.grad(MODES[m][2], MODES[m][1])
                print(f"  (float64 oracle for {T}x{V} {dtype}: {time.monotonic() - t_or:.0f}s)", flush=True)
                for impl in run_impls:
                    job += 1
                    outd = os.path.join(work, f"out_{impl}_{T}x{V}_{dtype}")
                    os.makedirs(outd)
                    spec = dict(impl=impl, T=T, V=V, dtype=dtype, modes=modes, reps=reps, warmup=warmup,
                                data_dir=ddir, out_dir=outd, err_rows=args.err_rows,
                                port=_free_port() if impl == "megatron" else None)

                    got = []

                    def on_record(rec, spec, got=got):
                        got.append(rec)
                        _progress(f"  {impl} {T}x{V} {dtype} {rec['mode']}: f+b {rec['fwdbwd_s']:.3f}s")

                    errs = run_workers([spec], work, args.worker_timeout, on_record)
                    _progress("")
                    # errors after the worker has exited (no CPU competition while it times)
                    for rec in got:
                        f = os.path.join(outd, f"out_{modes.index(rec['mode'])}_r0.npz")
                        with np.load(f) as o:
                            rec["errors"] = errors(oracle, rec["mode"], o["lp"], o["h"], o["g"])
                        doc["results"].append(rec)
                        print(row(rec), flush=True)
                    for e in errs:
                        doc["failures"].append({"impl": impl, "T": T, "V_local": V, "dtype": dtype, "error": e})
                        print(f"  ! {impl} {T}x{V} {dtype}: {e}", flush=True)
                    print(f"  [{job}/{n_jobs} done, {time.monotonic() - t_start:.0f}s]", flush=True)
                    _write(doc, out_json, t_start, complete=False)
                    shutil.rmtree(outd, ignore_errors=True)
                del oracle, z
                shutil.rmtree(ddir, ignore_errors=True)
            del z32, inp

        # collectives on W gloo ranks
        coll_impls = [i for i in ("dualvp-torch-eager", "megatron") if i in run_impls or
                      (i == "dualvp-torch-eager" and "dualvp-torch" in run_impls)]
        if worlds and coll_impls:
            print(f"\ncollectives per call on W gloo ranks (T={gT}, V_local={gV}, float32; "
                  f"dualvp with DUALVP_COMPILE=0: the collectives are outside the compiled kernels)")
        for W in worlds:
            if not coll_impls:
                break
            V = gV * W
            inp = make_inputs(gT, V, args.seed + W)
            ddir = os.path.join(work, f"data_gloo_{W}")
            os.makedirs(ddir)
            for k, v in inp.items():
                np.save(os.path.join(ddir, k + ".npy"), v)
            oracle = Oracle(inp, inp["logits"].astype(np.float64), gT)
            for impl in coll_impls:
                outd = os.path.join(work, f"out_gloo_{impl}_{W}")
                os.makedirs(outd)
                port = _free_port()
                specs = [dict(impl=impl, T=gT, V=V, dtype="float32", modes=modes, reps=1, warmup=0, data_dir=ddir,
                              out_dir=outd, err_rows=gT, world=W, rank=r, port=port, threads=1) for r in range(W)]
                got: dict = {}

                def on_record(rec, spec, got=got):
                    got.setdefault(rec["mode"], {})[rec["rank"]] = rec

                errs = run_workers(specs, work, args.worker_timeout, on_record)
                for e in errs:
                    doc["failures"].append({"impl": impl, "world": W, "error": e})
                    print(f"  ! {impl} W={W}: {e}", flush=True)
                for i, mode in enumerate(modes):
                    ranks = got.get(mode, {})
                    if len(ranks) != W:
                        continue
                    files = [os.path.join(outd, f"out_{i}_r{r}.npz") for r in range(W)]
                    outs = [dict(np.load(f)) for f in files]
                    g = np.concatenate([o["g"] for o in outs], axis=-1)
                    err = errors(oracle, mode, outs[0]["lp"], outs[0]["h"], g)
                    c0 = ranks[0]["collectives"]
                    agree = all(ranks[r]["collectives"] == c0 for r in range(W))
                    entry = {"impl": impl, "world": W, "T": gT, "V_local": gV, "mode": mode, "per_call": c0,
                             "ranks_agree": agree, "errors": err, "fwdbwd_s": ranks[0]["fwdbwd_s"]}
                    doc["collectives"].append(entry)
                    f, b = c0["fwd"], c0["bwd"]
                    print(f"  W={W} {impl:<19} {mode:<17} fwd {f['count']} coll {f['bytes']:>9} B {f['by_op']}  "
                          f"bwd {b['count']} coll {b['bytes']} B  ranks agree: {agree}  "
                          f"err lp {_fmt_e(err['logprob'])} H {_fmt_e(err['entropy'])} grad {_fmt_e(err['grad'])}",
                          flush=True)
                shutil.rmtree(outd, ignore_errors=True)
            shutil.rmtree(ddir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    _write(doc, out_json, t_start, complete=True)
    note = chart(doc, out_png)
    print("\ngoals:")
    for g in doc["summary"]["goals"]:
        extra = f" (worst {g['worst']:.3g} over {g['n']} cases)" if "worst" in g else ""
        print(f"  {g['status']:<13} {g['goal']}{extra}")
    print(f"\nwrote {out_json}" + (f" and {out_png}" if note is None else f" ({note})"))
    print(f"memory: {MEMORY_METHOD}")
    print("timings are wall clock on a CPU that may be shared with other work: expect noise.")
    return 1 if doc["failures"] else 0
