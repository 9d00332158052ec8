"""dualvp_torch's forward over the current ``dualvp/spec.py`` against an older revision's, on the CPU.

A change to :mod:`dualvp.spec` changes every backend; ``jax_chunked.py
--old-spec REV`` measures the JAX side in one process. The torch side cannot
swap the spec inside one process (the compiled kernels are traced once per
process and re-tracing under another module trips torch.compile's recompile
limit, so the second variant silently runs eagerly). So each variant runs in
processes of its own, alternating: ``--rounds`` times the old tree then the
current one, each process timing every case (``--reps`` calls after two
warm-up calls, a 50 ms pause before each; median). The old tree is a copy of
the current ``dualvp`` and ``dualvp_torch`` with ``dualvp/spec.py`` from
``REV``: the comparison isolates the spec. Per case the median over rounds of
each variant's median, and their ratio (current / old).

Inputs: the bench's (N(10, 3) logits, a top-64 keep mask, seed 0); the
forward under ``no_grad``.

Usage::

    python benchmarks/torch_spec_ab.py --old-spec 3a167ca^ --modes lp.keep --impls compiled,eager
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {  # name: (with_entropy, masked)
    "lp": (False, False), "lp+ent": (True, False), "lp.keep": (False, True), "lp+ent.keep": (True, True),
}


def worker(root: str, a: argparse.Namespace) -> dict:
    """Median forward milliseconds per ``"V dtype mode impl"`` with the packages under ``root``."""
    sys.path.insert(0, root)
    import torch

    import dualvp
    from dualvp_torch import logprob_entropy

    assert os.path.dirname(os.path.dirname(dualvp.__file__)) == root, dualvp.__file__
    out = {}
    for v in (int(x) for x in a.V.split(",")):
        g = torch.Generator().manual_seed(0)
        z32 = torch.randn(a.T, v, generator=g) * 3 + 10
        y = torch.randint(0, v, (a.T,), generator=g)
        keep = torch.zeros(a.T, v, dtype=torch.bool).scatter_(1, z32.topk(64, dim=-1).indices, True)
        for dt in a.dtypes.split(","):
            z = z32.to(getattr(torch, dt))
            for mode in a.modes.split(","):
                ent, masked = MODES[mode]
                for impl in a.impls.split(","):
                    def call():
                        with torch.no_grad():
                            return logprob_entropy(z, y, keep_mask=keep if masked else None, with_entropy=ent,
                                                   impl=impl)
                    for _ in range(2):
                        call()
                    ts = []
                    for _ in range(a.reps):
                        time.sleep(0.05)
                        t0 = time.perf_counter()
                        call()
                        ts.append((time.perf_counter() - t0) * 1e3)
                    out[f"{v} {dt} {mode} {impl}"] = statistics.median(ts)
    return out


def old_tree(rev: str) -> str:
    """A temporary copy of the current packages with ``dualvp/spec.py`` from ``rev``."""
    d = tempfile.mkdtemp(prefix="dualvp_old_spec_")
    for pkg in ("dualvp", "dualvp_torch"):
        shutil.copytree(os.path.join(ROOT, pkg), os.path.join(d, pkg),
                        ignore=shutil.ignore_patterns("__pycache__"))
    spec = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:dualvp/spec.py"], check=True, capture_output=True,
                          text=True).stdout
    with open(os.path.join(d, "dualvp", "spec.py"), "w") as f:
        f.write(spec)
    return d


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-spec", required=True, metavar="REV")
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--V", default="32000,152064", help="comma list of V_local")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--modes", default="lp.keep", help="comma list of " + ", ".join(MODES))
    ap.add_argument("--impls", default="compiled,eager")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a)))
        return
    old = old_tree(a.old_spec)
    args = [a_ for k, v in vars(a).items() if k not in ("worker", "old_spec", "rounds")
            for a_ in (f"--{k.replace('_', '-')}", str(v))]
    runs: dict = {"old": [], "current": []}
    try:
        for r in range(a.rounds):
            for label, root in (("old", old), ("current", ROOT)):
                p = subprocess.run([sys.executable, __file__, "--old-spec", a.old_spec, "--worker", root] + args,
                                   check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
                runs[label].append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1} {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[label][-1].items()),
                      flush=True)
    finally:
        shutil.rmtree(old, ignore_errors=True)
    print(f"# current tree vs dualvp/spec.py at {a.old_spec}; T={a.T}; median over {a.rounds} rounds of each "
          f"process's median of {a.reps} calls (forward, no_grad), ms")
    for k in runs["old"][0]:
        o = statistics.median(x[k] for x in runs["old"])
        c = statistics.median(x[k] for x in runs["current"])
        print(f"{k}: old {o:.1f}, current {c:.1f}, current/old {c / o:.2f} "
              f"(rounds: old {', '.join(f'{x[k]:.0f}' for x in runs['old'])}; "
              f"current {', '.join(f'{x[k]:.0f}' for x in runs['current'])})")


if __name__ == "__main__":
    main()
