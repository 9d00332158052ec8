"""The options of ``dualvp bench`` and the plan a run makes of them."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

from .. import _proc
from .implementations import IMPLS, MODES, locate

__all__ = ["add_arguments", "Plan", "plan"]

# defaults per device: (sizes, dtypes, modes); --quick: (sizes, dtypes, modes)
_DEFAULTS = {
    "cpu": (["2048x32000", "2048x152064"], ["float32", "bfloat16"], list(MODES)),
    "cuda": (["16384x19008", "4096x75968", "4096x32000"], ["float32", "bfloat16"],
             ["lp", "lp+ent+grad", "lp+ent+grad.keep"]),
}
_QUICK = {
    "cpu": (["64x2048"], ["float32"], list(MODES)),
    "cuda": (["4096x32000"], ["float32"], ["lp", "lp+ent+grad"]),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``dualvp bench`` options."""
    p.add_argument("--quick", action="store_true", help="one small size, float32, few reps (a minute or two)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu, or cuda: one GPU (torch workers on the GPU, memory from torch.cuda.max_memory_allocated, "
                        "kernel time and launches from torch.profiler; JAX only if it has a GPU backend)")
    p.add_argument("--op", default="logits", choices=["logits", "linear"],
                   help="logits: the op on logits shards (default); linear: the fused LM-head op vs its baselines "
                        "(uses --shapes, --dtypes, --impls, --reps, --results)")
    p.add_argument("--shapes", default=None, help="--op linear: comma list of TxHxV_local "
                   "(default cpu 2048x1024x32000; cuda 4096x2048x32000,16384x4096x75968; --quick 64x32x1000)")
    p.add_argument("--sizes", default=None, help="comma list of TxV_local (default cpu 2048x32000,2048x152064; "
                   "cuda 16384x19008,4096x75968,4096x32000); 'none': only the W>1 runs of --worlds")
    p.add_argument("--dtypes", default=None, help="comma list of float32,bfloat16 (default both)")
    listing = "; ".join(f"{i.name}: {i.about}" for i in IMPLS.values())
    p.add_argument("--impls", default=None, help="comma list of implementations, run in this order (default all "
                   f"available, those that compile dualvp's path with inductor last): {listing}")
    p.add_argument("--modes", default=None, help=f"comma list of {','.join(MODES)} (default cpu all; "
                   "cuda lp,lp+ent+grad,lp+ent+grad.keep)")
    p.add_argument("--slime-path", default=None, metavar="DIR",
                   help="a slime checkout (DIR/slime/utils/ppo_utils.py) for the 'slime' implementation "
                   "(default: an importable slime, else slime is skipped)")
    p.add_argument("--reps", type=int, default=None, help="timed (synchronised) calls per mode "
                   "(default 3, 2 for >1e8 elements or --quick; cuda 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls after the first one (default 0; cuda 1)")
    p.add_argument("--loop", type=int, default=None, help="calls of the queued loop that gives host_us "
                   "(default 5; cuda 10)")
    p.add_argument("--worlds", default=None, help="comma list of world sizes W>1 run on W gloo ranks (cpu default "
                   "2,4, --quick 2; cuda default none: --worlds 2 runs 2 ranks sharing the GPU); 'none' to skip")
    p.add_argument("--gloo-size", default=None, help="TxV_local per rank of the W>1 run "
                   "(default cpu 256x4096, --quick 32x512; cuda 4096x16000)")
    p.add_argument("--err-rows", type=int, default=256, help="rows whose gradient is compared with float64 "
                   "(log-prob and entropy: the first max(err-rows, 1024) rows)")
    p.add_argument("--results", default=None, metavar="CSV",
                   help="results file the rows are appended to (default bench-results/<cpu|cuda>.csv, ignored "
                   "by git; a run worth keeping names benchmarks/results/<cpu|cuda>.csv; 'none': do not write one)")
    p.add_argument("--out", default=None, metavar="JSON", help="also write every record as JSON (not committed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, metavar="CSV",
                   help="print a results file's last commit as a Markdown table (no run)")
    p.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds per worker process")
    p.add_argument("--per-impl-workers", action="store_true",
                   help="one worker per implementation for every (size, dtype), the inputs made in the background "
                   "(the default with --device cuda; on a CPU for the GPU check's rehearsal)")
    p.add_argument("--interleave", action="store_true",
                   help="run the implementations of each (size, dtype) at once, in their own processes, taking "
                   "turns: one computes at a time and their timed calls alternate, so that all see the same "
                   "phases of a shared machine's load")


def _split(s: Optional[str], default) -> list:
    if s is None:
        return list(default)
    return [x.strip() for x in s.split(",") if x.strip()]


def _size(s: str) -> tuple:
    return tuple(int(x) for x in s.lower().split("x"))


@dataclass
class Plan:
    """What one run does, from the options."""

    device: str
    sizes: list
    dtypes: list
    modes: list
    impls: list  # the ones that run here
    skipped: dict  # impl -> why not
    options: dict  # impl -> options for its workers (from `locate`)
    worlds: list
    gloo_size: tuple
    reps: int
    big_reps: int  # for sizes of more than 1e8 elements
    warmup: int
    loop: int
    quick: bool
    gloo_impls: list = field(default_factory=list)
    explicit: bool = False  # --impls given: an implementation named but unable to run is a results row
    per_impl_workers: bool = False

    def reps_for(self, T: int, V: int) -> int:
        return self.big_reps if T * V > 1e8 else self.reps

    def modes_of(self, impl: str) -> list:
        return [m for m in self.modes if m in IMPLS[impl].modes]


def plan(args) -> Plan:
    """The plan, or ``ValueError`` naming the bad option value."""
    q, device = args.quick, args.device
    d_sizes, d_dtypes, d_modes = (_QUICK if q else _DEFAULTS)[device]
    sizes = [] if args.sizes == "none" else [_size(s) for s in _split(args.sizes, d_sizes)]
    dtypes = _split(args.dtypes, d_dtypes)
    modes = _split(args.modes, d_modes)
    explicit = args.impls is not None
    impls = _split(args.impls, IMPLS)
    for name, vals, allowed in (("dtype", dtypes, ("float32", "bfloat16")), ("mode", modes, MODES),
                                ("impl", impls, IMPLS)):
        bad = [v for v in vals if v not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad}; expected {list(allowed)}")
    if any(len(s) != 2 for s in sizes):
        raise ValueError(f"--sizes: expected TxV_local, got {args.sizes}")
    found: dict = {}
    for i in impls:
        impl = IMPLS[i]
        if device not in impl.devices:
            found[i] = f"runs on {'/'.join(impl.devices)} only"
        elif not explicit and device not in impl.default_devices:
            continue  # only when asked for by name
        elif not set(modes) & set(impl.modes):
            found[i] = f"computes only the modes {list(impl.modes)}"
        else:
            found[i] = locate(impl, args)
    if device == "cuda":
        jax_impls = [i for i in found if IMPLS[i].framework == "jax" and isinstance(found[i], dict)]
        why = _jax_gpu_problem() if jax_impls else None
        for i in jax_impls if why else ():
            found[i] = why
    run_impls = [i for i in found if isinstance(found[i], dict)]
    if not explicit:  # the baselines first: a run cut short during inductor's compiles keeps their rows
        run_impls.sort(key=lambda i: IMPLS[i].inductor)
    cuda = device == "cuda"
    reps = args.reps or (5 if cuda else 2 if q else 3)
    worlds = _split(args.worlds, [] if cuda else ["2"] if q else ["2", "4"])
    p = Plan(
        device=device, sizes=sizes, dtypes=dtypes, modes=modes, impls=run_impls,
        skipped={i: why for i, why in found.items() if isinstance(why, str)},
        options={i: found[i] for i in run_impls},
        worlds=[] if worlds == ["none"] else [int(w) for w in worlds],
        gloo_size=_size(args.gloo_size or ("4096x16000" if cuda else "32x512" if q else "256x4096")),
        reps=reps, big_reps=args.reps or (5 if cuda else 2), warmup=args.warmup if args.warmup is not None else
        (1 if cuda else 0), loop=args.loop or (10 if cuda else 5), quick=q, explicit=explicit,
        per_impl_workers=cuda or bool(getattr(args, "per_impl_workers", False)),
    )
    # on W ranks: the gloo-capable implementations that run here; on a CPU dualvp's eager kernels
    # stand for dualvp (each rank would compile the others for itself)
    gloo = [i for i in IMPLS if IMPLS[i].gloo and device in IMPLS[i].devices]
    if cuda:
        p.gloo_impls = [i for i in gloo if i in run_impls and i != "dualvp-torch-eager"]
    else:
        dualvp_run = any(i.startswith("dualvp-torch") for i in run_impls)
        p.gloo_impls = [i for i in gloo if (i in run_impls and not i.startswith("dualvp-torch")) or
                        (i == "dualvp-torch-eager" and dualvp_run)]
    return p


def _jax_gpu_problem() -> Optional[str]:
    """``None`` when JAX has a GPU backend here, else why not (probed in a child: JAX would
    otherwise take GPU memory in this process for the whole run)."""
    code = "import jax; print(len(jax.devices('gpu')))"
    try:
        p = subprocess.run([sys.executable, "-c", code], env=_proc.child_env(1, {"JAX_PLATFORMS": "cuda"}),
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "jax GPU probe timed out (120 s)"
    if p.returncode == 0:
        return None
    last = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
    return f"jax has no GPU backend (jax.devices('gpu') failed: {last})"
