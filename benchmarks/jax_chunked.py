"""Side by side, in one process: dualvp_jax's row-chunked forward vs a previous revision.

The previous revision's ``dualvp_jax/function.py`` (default ``8479dda``, the
last one with the whole-shard forward) is taken with ``git show`` into a
temporary directory and imported under its own module name; it shares
``dualvp.spec`` and ``dualvp.validation`` with the current tree (unchanged
between the two).

For every (V_local, dtype, mode, world) both implementations are compiled as
``jax.jit(jax.value_and_grad(loss))`` with
``loss = sum(gl * logprob) + sum(gh * entropy)`` (the entropy term only in the
modes that have it), unsharded (``axis_name=None``) or inside a
``jax.shard_map`` over ``world`` host devices with ``check_vma`` on. Reported,
with ``B`` = bytes of one logits shard:

- ``temp_B``: ``memory_analysis().temp_size_in_bytes / B`` of the compiled
  value-and-gradient (per device), i.e. the scratch beyond the arguments and
  the gradient output; ``fwd_temp_B``: the same for the forward alone.
- ``peak_B``: peak extra resident memory of one call (``VmHWM`` after, reset
  through ``/proc/self/clear_refs``, minus ``VmRSS`` before) over
  ``world * B``: the gradient (1 B) is included.
- ``time_s``: median wall time of ``--reps`` calls; the two implementations
  alternate call by call so that they see the same machine load. ``cpu_s``:
  the median process CPU time of the same calls (all threads), less
  sensitive than wall time to other work on a shared machine.
- ``fwd_time_s``: median wall time of the forward alone (``jit`` of the
  outputs, O(T): no gradient and so none of its page faults), timed in the
  same alternating rounds; what the row chunks changed is the forward, the
  backward is the same fused pass in both revisions, so the new revision's
  ``bwd_s = time_s - fwd_time_s`` over the old ``time_s`` is the ratio a
  forward of no cost would reach. The old revision's ``bwd_s`` can come out
  near zero or below: its forward alone allocates full-size temporaries
  (and pays their page faults), which under ``value_and_grad`` XLA places
  in the gradient's buffer.
- ``all_gathers``: all-gather ops in the compiled HLO (forward + backward).
- ``max_diff``: largest absolute difference between the two implementations'
  log-prob, entropy and gradient (float32).

Modes: ``lp`` (log-prob only), ``ent`` (log-prob and entropy, both
differentiated), ``keep`` (``ent`` under a 50 % keep mask), ``lpkeep``
(``lp`` under that mask; not in the default list).

``--old-flag NAME=VALUE``: the "old" implementation is the current tree
traced with the module variable ``dualvp_jax.function.NAME`` set to
``VALUE`` (a Python literal), e.g. ``--old-flag _MASKED_BLOCKS=False``: the
two then differ only in that choice (``--old-rev`` is not used).
``--old-spec REV``: likewise, the current ``dualvp_jax.function`` traced
over revision ``REV``'s ``dualvp/spec.py``.

``--donate``: both are compiled with ``donate_argnums=0`` and every call gets
a fresh copy of the logits (made outside the timed and measured call), so
that XLA writes each gradient into the logits' buffer: the comparison then
leaves out the fresh gradient's page faults, which both pay alike otherwise.

Usage::

    python benchmarks/jax_chunked.py --T 2048 --V 32000 --out benchmarks/jax_chunked_T2048_V32000.json
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import gc
import importlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (with entropy, masked)
MODES = {"lp": (False, False), "ent": (True, False), "keep": (True, True), "lpkeep": (False, True)}


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _trim():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _peak_extra(call):
    """Peak extra RSS of ``call()`` in bytes (the result is dropped afterwards)."""
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    out = call()
    peak = _status_kb("VmHWM")
    del out
    return max(0, peak - before)


def _load_rev(rev, path_in_repo, name):
    src = subprocess.run(["git", "-C", HERE, "show", f"{rev}:{path_in_repo}"], check=True,
                         capture_output=True, text=True).stdout
    d = tempfile.mkdtemp(prefix="dualvp_old_")
    path = os.path.join(d, name + ".py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_old_function(rev):
    """``dualvp_jax.function`` at ``rev``, imported from the whole package at that revision.

    The package is written out as ``dualvp_jax_old_<rev>`` (its modules
    import each other relatively: ``function`` needs its own ``chunks``); its
    absolute imports (``dualvp.spec``, ``dualvp.validation``) are the current
    tree's.
    """
    files = subprocess.run(["git", "-C", HERE, "ls-tree", "-r", "--name-only", rev, "dualvp_jax/"], check=True,
                           capture_output=True, text=True).stdout.split()
    name = "dualvp_jax_old_" + re.sub(r"\W", "_", rev)
    d = tempfile.mkdtemp(prefix="dualvp_old_")
    for f in files:
        if f.endswith(".py"):
            path = os.path.join(d, name, os.path.relpath(f, "dualvp_jax"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as out:
                out.write(subprocess.run(["git", "-C", HERE, "show", f"{rev}:{f}"], check=True, capture_output=True,
                                         text=True).stdout)
    sys.path.insert(0, d)
    try:
        return importlib.import_module(name + ".function")
    finally:
        sys.path.remove(d)


def _load_old(rev, own_spec=True):
    mod = _load_old_function(rev)
    if own_spec:
        # The old function over the old revision's spec (its global ``spec``,
        # looked up at trace time): the spec has changed since, and the old
        # whole-shard forward over today's spec holds a float32 [T, V_local]
        # buffer that it did not hold at that revision.
        mod.spec = _load_rev(rev, "dualvp/spec.py", "dualvp_old_spec")
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--V", type=int, nargs="+", default=[32000], help="V_local values")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="lp,ent,keep")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--old-rev", default="8479dda")
    ap.add_argument("--old-flag", default=None, metavar="NAME=VALUE",
                    help="old = the current tree with dualvp_jax.function.NAME = VALUE (instead of --old-rev)")
    ap.add_argument("--old-spec", default=None, metavar="REV",
                    help="old = the current tree over REV's dualvp/spec.py (instead of --old-rev)")
    ap.add_argument("--donate", action="store_true",
                    help="donate a fresh copy of the logits to every call (the gradient takes its buffer)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--current-spec", action="store_true",
                    help="run the old function over the current dualvp.spec (before 2026-12-04 the only way)")
    a = ap.parse_args(argv)
    worlds = [int(w) for w in a.worlds.split(",")]
    flag = f"--xla_force_host_platform_device_count={max(worlds)}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    sys.path.insert(0, HERE)
    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dualvp_jax import chunks
    import dualvp_jax.function as new

    flags = {"old": {}, "new": {}}
    if a.old_flag:
        fname, _, fvalue = a.old_flag.partition("=")
        if not hasattr(new, fname):
            raise SystemExit(f"--old-flag: dualvp_jax.function has no variable {fname!r}")
        flags["old"][fname] = ast.literal_eval(fvalue)
        flags["new"][fname] = getattr(new, fname)
    if a.old_spec:
        flags["old"]["spec"] = _load_rev(a.old_spec, "dualvp/spec.py", "dualvp_old_spec")
        flags["new"]["spec"] = new.spec
    if flags["old"]:
        impls = {"old": new, "new": new}
    else:
        impls = {"old": _load_old(a.old_rev, own_spec=not a.current_spec), "new": new}
    meshes = {w: jax.make_mesh((w,), ("tp",)) for w in worlds if w > 1}
    rows = []
    uptime0 = open("/proc/loadavg").read().split()[:3]

    for V in a.V:
        for dname in a.dtypes.split(","):
            dt = jnp.dtype(dname)
            for world in worlds:
                rng = np.random.default_rng(0)
                z_np = (rng.standard_normal((a.T, world * V), dtype=np.float32) * 3.0)
                y_np = rng.integers(0, world * V, a.T).astype(np.int32)
                y_np[::17] = -100
                k_np = rng.random((a.T, world * V), dtype=np.float32) < 0.5
                gl_np = rng.standard_normal(a.T).astype(np.float32)
                gh_np = rng.standard_normal(a.T).astype(np.float32)
                mesh = meshes.get(world)
                put = (lambda x, s: jax.device_put(x, NamedSharding(mesh, s))) if mesh else (lambda x, s: jnp.asarray(x))
                z = put(jnp.asarray(z_np, dt) if mesh is None else z_np.astype(dt), P(None, "tp"))
                del z_np
                keep = put(k_np, P(None, "tp"))
                del k_np
                y, gl, gh = (put(x, P(None)) for x in (y_np, gl_np, gh_np))
                B = a.T * V * dt.itemsize

                def logits(z=z):  # the logits a call gets: a fresh copy when it consumes them
                    return jax.block_until_ready(jnp.copy(z)) if a.donate else z

                for mode in a.modes.split(","):
                    with_ent, masked = MODES[mode]
                    k = keep if masked else None
                    fns, fwds, rec = {}, {}, {}
                    for name, mod in impls.items():

                        def body(z, y, gl, gh, *kk, mod=mod):
                            lp, h = mod.logprob_entropy(z, y, axis_name="tp" if mesh else None,
                                                        keep_mask=kk[0] if kk else None, with_entropy=with_ent)
                            return lp, (h if with_ent else jnp.zeros_like(lp))

                        def outs(z, y, gl, gh, k, body=body):
                            extra = () if k is None else (k,)
                            if mesh is None:
                                return body(z, y, gl, gh, *extra)
                            specs = (P(None, "tp"), P(None), P(None), P(None)) + ((P(None, "tp"),) if k is not None else ())
                            return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(None), P(None)))(
                                z, y, gl, gh, *extra)

                        def loss(z, y, gl, gh, k, outs=outs):
                            lp, h = outs(z, y, gl, gh, k)
                            return jnp.sum(gl * lp) + (jnp.sum(gh * h) if with_ent else 0.0), (lp, h)

                        for fname, fvalue in flags[name].items():  # read at trace time
                            setattr(mod, fname, fvalue)
                        jax.clear_caches()
                        vg = jax.jit(jax.value_and_grad(loss, has_aux=True), donate_argnums=(0,) if a.donate else ())
                        fw = jax.jit(outs)
                        comp = vg.lower(z, y, gl, gh, k).compile()
                        fcomp = fw.lower(z, y, gl, gh, k).compile()
                        ma, fma = comp.memory_analysis(), fcomp.memory_analysis()
                        hlo = comp.as_text()
                        fns[name] = comp
                        fwds[name] = fcomp
                        rec[name] = {
                            "temp_B": ma.temp_size_in_bytes / B,
                            "out_B": ma.output_size_in_bytes / B,
                            "fwd_temp_B": fma.temp_size_in_bytes / B,
                            "all_gathers": len(re.findall(r"\ball-gather(?:-start)?\(", hlo)),
                            "times": [],
                            "cpu_times": [],
                            "fwd_times": [],
                        }
                        jax.block_until_ready(comp(logits(), y, gl, gh, k))  # warm-up
                        jax.block_until_ready(fcomp(z, y, gl, gh, k))
                    res = {}
                    for name, comp in fns.items():
                        zc = logits()
                        rec[name]["peak_B"] = _peak_extra(
                            lambda comp=comp: jax.block_until_ready(comp(zc, y, gl, gh, k))) / (world * B)
                        del zc
                        (_, (lp, h)), g = comp(logits(), y, gl, gh, k)
                        res[name] = [np.asarray(jnp.asarray(x, jnp.float32)) for x in (lp, h, g)]
                        del lp, h, g
                    for _ in range(a.reps):
                        for name, comp in fns.items():
                            zc = logits()
                            c0, t0 = time.process_time(), time.perf_counter()
                            jax.block_until_ready(comp(zc, y, gl, gh, k))
                            rec[name]["times"].append(time.perf_counter() - t0)
                            rec[name]["cpu_times"].append(time.process_time() - c0)
                            del zc
                            t0 = time.perf_counter()
                            jax.block_until_ready(fwds[name](z, y, gl, gh, k))
                            rec[name]["fwd_times"].append(time.perf_counter() - t0)
                    diff = [float(np.max(np.abs(np.nan_to_num(u - v)))) if u.size else 0.0
                            for u, v in zip(res["old"], res["new"])]
                    del res
                    row = {"V_local": V, "dtype": dname, "mode": mode, "world": world, "B": B,
                           "chunk_rows": chunks.chunk_rows(a.T, V), "max_diff_lp_h_g": diff}
                    for name in impls:
                        r = rec[name]
                        r["time_s"] = statistics.median(r["times"])
                        r["cpu_s"] = statistics.median(r["cpu_times"])
                        r["fwd_time_s"] = statistics.median(r["fwd_times"])
                        r["bwd_s"] = r["time_s"] - r["fwd_time_s"]
                        row[name] = r
                    row["time_ratio"] = row["new"]["time_s"] / row["old"]["time_s"]
                    row["cpu_ratio"] = row["new"]["cpu_s"] / row["old"]["cpu_s"]
                    row["fwd_ratio"] = row["new"]["fwd_time_s"] / row["old"]["fwd_time_s"]
                    rows.append(row)
                    print(f"V={V} {dname:8s} {mode:4s} W={world}  old {row['old']['time_s']:.3f}s "
                          f"peak {row['old']['peak_B']:.2f}B temp {row['old']['temp_B']:.3f}B | new "
                          f"{row['new']['time_s']:.3f}s peak {row['new']['peak_B']:.2f}B temp "
                          f"{row['new']['temp_B']:.3f}B fwd {row['new']['fwd_temp_B']:.3f}B | ratio "
                          f"{row['time_ratio']:.2f} (cpu {row['cpu_ratio']:.2f}; fwd {row['old']['fwd_time_s']:.3f}s/"
                          f"{row['new']['fwd_time_s']:.3f}s = {row['fwd_ratio']:.2f}, rest {row['old']['bwd_s']:.3f}s/"
                          f"{row['new']['bwd_s']:.3f}s) gathers {row['new']['all_gathers']} diff "
                          f"{max(diff):.2e}", flush=True)
                    del fns
                del z, keep
                _trim()
    ratios = [r["time_ratio"] for r in rows]
    cpu_ratios = [r["cpu_ratio"] for r in rows]
    summary = {"time_ratio_max": max(ratios), "time_ratio_median": statistics.median(ratios),
               "cpu_ratio_max": max(cpu_ratios), "cpu_ratio_median": statistics.median(cpu_ratios),
               "fwd_ratio_max": max(r["fwd_ratio"] for r in rows),
               "fwd_ratio_median": statistics.median(r["fwd_ratio"] for r in rows),
               "peak_B_new_max": max(r["new"]["peak_B"] for r in rows),
               "temp_B_new_max": max(r["new"]["temp_B"] for r in rows),
               "fwd_temp_B_new_max": max(r["new"]["fwd_temp_B"] for r in rows)}
    for fname, fvalue in flags["new"].items():
        setattr(new, fname, fvalue)
    meta = {"T": a.T, "old_rev": a.old_rev, "old_flag": a.old_flag, "old_spec_rev": a.old_spec, "donate": a.donate,
            "old_spec": "current" if a.current_spec else a.old_rev,
            "jax": jax.__version__, "backend": jax.default_backend(),
            "cpus": os.cpu_count(), "chunk_bytes": chunks.CHUNK_BYTES, "reps": a.reps,
            "loadavg_start": uptime0, "loadavg_end": open("/proc/loadavg").read().split()[:3]}
    print(json.dumps(summary))
    print("loadavg start", uptime0, "end", meta["loadavg_end"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
