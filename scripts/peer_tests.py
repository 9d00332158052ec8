#!/usr/bin/env python
"""Run the RL stacks' own tests against the drop-ins of ``dualvp_torch.compat`` (nothing vendored).

Each option takes the path of a checkout (or of an extract holding at least the files named) of one
stack; the script reads the stack's test and reference sources from it at run time, on the CPU:

--trl PATH      ``tests/test_utils.py::TestSelectiveLogSoftmax`` and ``::TestEntropyFromLogits`` (AST-
                extracted, verbatim; TRL's ``trl/trainer/utils.py`` functions are the 16-bit baseline).
                float32/float64 cases: verbatim. 16-bit cases: TRL asserts bit-equality with torch's
                16-bit ``log_softmax``, which a more accurate result cannot pass; on the very inputs of
                each such case the drop-in's max error against float64 must be <= TRL's own.
--nemo-rl PATH  ``tests/unit/distributed/test_distributed_logprob.py``: the tests of the replaced classes
                (forward/backward x4, edge cases, chunked entropy x3, chunked gather x3), ``device="cuda"``
                -> ``"cpu"``, its ``distributed_test_runner`` fixture on gloo ranks.
--areal PATH    ``tests/torchrun/run_vocab_parallel.py``, its 7 checks, at W = 2 and 4 on gloo (AReaL's
                ``current_platform`` -> CPU; the process group is initialised before it runs).
--verl PATH     ``tests/special_distributed/test_tensor_dict.py::test_vocab_parallel_entropy`` and
                ``::test_vocab_parallel_sum_pi_squared`` at TP = 2 on gloo with megatron-core's parallel
                state; verl's own ``verl/utils/torch_functional.py`` functions are the references.

--control also runs each stack's own implementation through the same harness (TRL, AReaL and verl: the
functions are loaded from the checkout), to show the harness, not the drop-in, decides.

Needs: torch, dualvp (this checkout first on ``sys.path``), pytest; megatron-core for --verl. No stack
needs to be installed. Example (snapshots extracted with ``git archive``)::

    python scripts/peer_tests.py --trl ~/src/trl --nemo-rl ~/src/RL --areal ~/src/AReaL --verl ~/src/verl

Exit status 0 when every drop-in check passed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _source(root: Path, rel: str) -> str:
    path = Path(root) / rel
    if not path.is_file():
        raise SystemExit(f"{rel}: not found under {root}")
    return path.read_text()


def _extract(src: str, names: list, path: str = "?") -> str:
    """The verbatim source of the top-level classes / functions ``names`` of ``src``, in file order."""
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            found[node.name] = "".join(lines[start : node.end_lineno])
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"{path}: no top-level {missing}")
    return "\n\n".join(found[n] for n in names) + "\n"


def _env(extra_path: str, **kv) -> dict:
    env = dict(os.environ)
    rest = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), extra_path] + rest)
    env.update(kv)
    return env


# ------------------------------------------------------------------------------------------------- TRL

_TRL_SUPPORT = '''
"""Binds the names TRL's test classes call to the implementation under test, recording every call."""
import os

import _trl_original as trl_original

IMPL = os.environ["PEER_IMPL"]
RECORD = []


class TrlTestCase:  # TRL's base class only adds a tmp-dir fixture, which these tests do not use
    pass


if IMPL == "dualvp":
    from dualvp_torch.compat import trl as _dropin

    _sls, _efl = _dropin.selective_log_softmax, _dropin.entropy_from_logits
else:
    _sls, _efl = trl_original.selective_log_softmax, trl_original.entropy_from_logits


def selective_log_softmax(logits, index):
    RECORD.append(("selective_log_softmax", logits, index, None))
    return _sls(logits, index)


def entropy_from_logits(logits, chunk_size=128):
    RECORD.append(("entropy_from_logits", logits, None, chunk_size))
    return _efl(logits, chunk_size=chunk_size)
'''

_TRL_CONFTEST = '''
"""16-bit cases: after TRL's verbatim assertion, the float64 check on the same inputs decides."""
import json
import os

import pytest
import torch

import _peer_trl_support as S

SIXTEEN = (torch.float16, torch.bfloat16)
OUT = os.environ["PEER_OUT"]


def _exact(kind, logits, index, chunk_size):
    z = logits.detach().double()
    if kind == "selective_log_softmax":
        lp = z.log_softmax(-1)
        return lp.gather(-1, index if index.ndim == z.ndim else index.unsqueeze(-1)).reshape(index.shape)
    lp = z.log_softmax(-1)
    return -(lp.exp() * lp).sum(-1)


def _err(x, ref):
    return float((x.detach().double() - ref).abs().max())


def _compare():
    from dualvp_torch.compat import trl as dropin

    rows = []
    for kind, logits, index, chunk in S.RECORD:
        ref = _exact(kind, logits, index, chunk)
        if kind == "selective_log_softmax":
            theirs = S.trl_original.selective_log_softmax(logits, index)
            ours = dropin.selective_log_softmax(logits, index)
            ours32 = dropin.selective_log_softmax(logits, index, float32_output=True)
        else:
            theirs = S.trl_original.entropy_from_logits(logits, chunk_size=chunk)
            ours = dropin.entropy_from_logits(logits, chunk_size=chunk)
            ours32 = dropin.entropy_from_logits(logits, chunk_size=chunk, float32_output=True)
        assert ours.dtype == logits.dtype, (ours.dtype, logits.dtype)
        rows.append((_err(ours, ref), _err(theirs, ref), _err(ours32, ref)))
    return rows


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    dtype = getattr(item, "callspec", None) and item.callspec.params.get("dtype")
    S.RECORD.clear()
    outcome = yield
    rec = {"nodeid": item.nodeid, "dtype": str(dtype).replace("torch.", "")}
    if dtype in SIXTEEN:
        rec["verbatim"] = "passed" if outcome.excinfo is None else "failed"
        if S.IMPL == "dualvp":
            rows = _compare()
            rec["errors"] = rows  # (drop-in, TRL, drop-in float32 output) max |error| vs float64
            ok = bool(rows) and all(d <= t for d, t, _ in rows)
            rec["float64_check"] = "passed" if ok else "failed"
            if ok:
                outcome.force_result(None)
            else:
                outcome.force_exception(AssertionError(f"drop-in error > TRL's against float64: {rows}"))
    with open(OUT, "a") as f:
        f.write(json.dumps(rec) + "\\n")


def pytest_runtest_logreport(report):
    if report.when == "call":
        with open(OUT, "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "outcome": report.outcome}) + "\\n")
'''


def run_trl(root: Path, impl: str) -> dict:
    tests = _source(root, "tests/test_utils.py")
    utils = _source(root, "trl/trainer/utils.py")
    classes = _extract(tests, ["TestSelectiveLogSoftmax", "TestEntropyFromLogits"], "tests/test_utils.py")
    funcs = _extract(utils, ["selective_log_softmax", "entropy_from_logits"], "trl/trainer/utils.py")
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp:
        t = Path(tmp)
        (t / "_trl_original.py").write_text("import torch\nimport torch.nn.functional as F\n\n\n" + funcs)
        (t / "_peer_trl_support.py").write_text(_TRL_SUPPORT)
        (t / "conftest.py").write_text(_TRL_CONFTEST)
        (t / "test_trl_utils_peer.py").write_text(
            "import pytest\nimport torch\nimport torch.nn.functional as F\n\n"
            "from _peer_trl_support import TrlTestCase, entropy_from_logits, selective_log_softmax\n\n\n" + classes
        )
        out = t / "results.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", tmp,
               str(t / "test_trl_utils_peer.py")]
        proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp, PEER_IMPL=impl, PEER_OUT=str(out)),
                              capture_output=True, text=True)
        recs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    outcome = {r["nodeid"]: r["outcome"] for r in recs if "outcome" in r}
    meta = {r["nodeid"]: r for r in recs if "dtype" in r}
    wide = [n for n, m in meta.items() if m["dtype"] in ("float32", "float64")]
    narrow = [n for n, m in meta.items() if m["dtype"] in ("float16", "bfloat16")]
    res = {
        "stack": "trl", "impl": impl, "collected": len(outcome),
        "fp32_fp64_verbatim": [sum(outcome.get(n) == "passed" for n in wide), len(wide)],
        "fp16_bf16_verbatim": [sum(meta[n]["verbatim"] == "passed" for n in narrow), len(narrow)],
    }
    if impl == "dualvp":
        res["fp16_bf16_vs_float64"] = [sum(meta[n].get("float64_check") == "passed" for n in narrow), len(narrow)]
        errs = [e for n in narrow for e in meta[n].get("errors", [])]
        if errs:
            res["worst_16bit_error"] = {"dropin": max(e[0] for e in errs), "trl": max(e[1] for e in errs),
                                        "dropin_float32_output": max(e[2] for e in errs)}
        res["ok"] = res["fp32_fp64_verbatim"][0] == res["fp32_fp64_verbatim"][1] > 0 and \
            res["fp16_bf16_vs_float64"][0] == res["fp16_bf16_vs_float64"][1] > 0
    else:
        res["ok"] = all(v == "passed" for v in outcome.values()) and bool(outcome)
    if not res["ok"]:
        res["pytest_tail"] = proc.stdout[-3000:] + proc.stderr[-2000:]
    return res


# ------------------------------------------------------------------------------------------------- NeMo-RL

_NEMO_MODEL_UTILS = '''
"""Stand-in for nemo_rl.distributed.model_utils: the four classes from dualvp_torch.compat.nemo_rl."""
from dualvp_torch.compat.nemo_rl import (  # noqa: F401
    ChunkedDistributedEntropy,
    ChunkedDistributedGatherLogprob,
    ChunkedDistributedLogprob,
    DistributedLogprob,
)


def _compute_distributed_log_softmax(*args, **kwargs):
    raise NotImplementedError("not replaced by dualvp (a full log-softmax output); its tests are deselected")


def get_next_token_logprobs_from_logits(*args, **kwargs):
    raise NotImplementedError("not replaced by dualvp; its tests are deselected")
'''

_NEMO_RUNNER = '''
"""NeMo-RL's ``distributed_test_runner`` fixture on gloo ranks (dualvp_torch.testing.run_ranks)."""


def call(rank, world_size, fn):
    fn(rank, world_size)
'''

_NEMO_CONFTEST = '''
import pytest

import _peer_nemo_runner


@pytest.fixture
def distributed_test_runner():
    from dualvp_torch.testing import run_ranks

    def run(test_fn, world_size, backend="gloo"):
        run_ranks(_peer_nemo_runner.call, world_size, test_fn, timeout=600)

    return run
'''

#: NeMo-RL's tests of the replaced classes (the others test functions dualvp does not replace).
NEMO_SELECT = ("test_distributed_logprob_forward_and_backward or test_distributed_logprob_edge_cases or "
               "test_chunked_distributed_entropy or test_chunked_distributed_gather_logprob")


def run_nemo(root: Path) -> dict:
    src = _source(root, "tests/unit/distributed/test_distributed_logprob.py")
    n_cuda = src.count('device="cuda"')
    src = src.replace('device="cuda"', 'device="cpu"')
    with tempfile.TemporaryDirectory(prefix="peer-nemo-") as tmp:
        t = Path(tmp)
        pkg = t / "nemo_rl" / "distributed"
        pkg.mkdir(parents=True)
        (t / "nemo_rl" / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        (pkg / "model_utils.py").write_text(_NEMO_MODEL_UTILS)
        (t / "_peer_nemo_runner.py").write_text(_NEMO_RUNNER)
        (t / "conftest.py").write_text(_NEMO_CONFTEST)
        (t / "test_distributed_logprob.py").write_text(src)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", tmp,
               "-k", NEMO_SELECT, "-rA", str(t / "test_distributed_logprob.py")]
        proc = subprocess.run(cmd, cwd=tmp, env=_env(tmp), capture_output=True, text=True)
    passed = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith("PASSED ")]
    failed = [ln.split(" ", 1)[1] for ln in proc.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    res = {"stack": "nemo_rl", "impl": "dualvp", "cuda_to_cpu_replacements": n_cuda,
           "passed": len(passed), "total": len(passed) + len(failed), "failed": failed}
    res["ok"] = proc.returncode == 0 and len(passed) > 0 and not failed
    if not res["ok"]:
        res["pytest_tail"] = proc.stdout[-4000:] + proc.stderr[-2000:]
    return res


# ------------------------------------------------------------------------------------------------- AReaL

def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that submodules resolve from sys.modules
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _exec_module(name: str, src: str, path: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = path
    sys.modules[name] = mod
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def _areal_rank(rank: int, world: int, test_src: str, vp_src: str, impl: str) -> list:
    import torch
    import torch.distributed as dist

    platform = types.SimpleNamespace(current_device=lambda: torch.device("cpu"), set_device=lambda *a: None,
                                     device_type="cpu")
    for name in ("areal", "areal.infra", "areal.utils", "areal.utils.functional"):
        _module(name)
    _module("areal.infra.platforms", current_platform=platform, is_npu_available=False)
    if impl == "dualvp":
        from dualvp_torch.compat import areal as vp

        sys.modules["areal.utils.functional.vocab_parallel"] = vp
    else:
        _exec_module("areal.utils.functional.vocab_parallel", vp_src, "areal/utils/functional/vocab_parallel.py")
    test = _exec_module("run_vocab_parallel", test_src, "tests/torchrun/run_vocab_parallel.py")
    out = []
    for name, fn in list(vars(test).items()):
        if name.startswith("test_") and callable(fn):
            dist.barrier()
            try:
                fn()
                out.append((name, "passed", ""))
            except Exception as exc:  # noqa: BLE001 - recorded, reported by the parent
                out.append((name, "failed", f"{type(exc).__name__}: {exc}"[:500]))
    dist.barrier()
    return out


def run_areal(root: Path, impl: str, worlds=(2, 4)) -> dict:
    from dualvp_torch.testing import run_ranks

    test_src = _source(root, "tests/torchrun/run_vocab_parallel.py")
    vp_src = _source(root, "areal/utils/functional/vocab_parallel.py") if impl != "dualvp" else ""
    res = {"stack": "areal", "impl": impl, "ok": True}
    for w in worlds:
        ranks = run_ranks(_areal_rank, w, test_src, vp_src, impl, timeout=600)
        names = [n for n, _, _ in ranks[0]]
        passed = [n for i, n in enumerate(names) if all(r[i][1] == "passed" for r in ranks)]
        failures = sorted({f"{n}: {m}" for r in ranks for n, s, m in r if s != "passed"})
        res[f"W={w}"] = {"passed": len(passed), "total": len(names), "failures": failures}
        res["ok"] &= len(passed) == len(names) > 0
    return res


# ------------------------------------------------------------------------------------------------- verl

def _verl_rank(rank: int, world: int, test_src: str, tf_src: str, tp_src: str, impl: str) -> list:
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    for name in ("verl", "verl.utils", "verl.utils.megatron"):
        _module(name)
    _module("verl.utils.device", get_device_name=lambda: "cpu")
    _module("verl.utils.profiler", log_gpu_memory_usage=lambda *a, **k: None)
    _module("verl.protocol", DataProto=None, all_gather_data_proto=None)  # test_all_gather_data_proto: not run
    _module("verl.utils.distributed", initialize_global_process_group=None)
    refs = _extract(tf_src, ["entropy_from_logits", "calculate_sum_pi_squared_from_logits"],
                    "verl/utils/torch_functional.py")
    _exec_module("verl.utils.torch_functional", "import torch\n\n\n" + refs, "verl/utils/torch_functional.py")
    if impl == "dualvp":
        from dualvp_torch.compat import verl as tp

        sys.modules["verl.utils.megatron.tensor_parallel"] = tp
    else:
        _exec_module("verl.utils.megatron.tensor_parallel", tp_src, "verl/utils/megatron/tensor_parallel.py")
    test = _exec_module("test_tensor_dict", test_src, "tests/special_distributed/test_tensor_dict.py")
    out = []
    for name in ("test_vocab_parallel_entropy", "test_vocab_parallel_sum_pi_squared"):
        try:
            getattr(test, name)()
            out.append((name, "passed", ""))
        except Exception as exc:  # noqa: BLE001
            out.append((name, "failed", f"{type(exc).__name__}: {exc}"[:500]))
            from megatron.core import parallel_state as mpu

            if mpu.model_parallel_is_initialized():
                mpu.destroy_model_parallel()
    return out


def run_verl(root: Path, impl: str) -> dict:
    from dualvp_torch.testing import run_ranks

    test_src = _source(root, "tests/special_distributed/test_tensor_dict.py")
    tf_src = _source(root, "verl/utils/torch_functional.py")
    tp_src = _source(root, "verl/utils/megatron/tensor_parallel.py") if impl != "dualvp" else ""
    ranks = run_ranks(_verl_rank, 2, test_src, tf_src, tp_src, impl, timeout=600)
    names = [n for n, _, _ in ranks[0]]
    passed = [n for i, n in enumerate(names) if all(r[i][1] == "passed" for r in ranks)]
    failures = sorted({f"{n}: {m}" for r in ranks for n, s, m in r if s != "passed"})
    return {"stack": "verl", "impl": impl, "TP=2": {"passed": len(passed), "total": len(names),
                                                    "passed_names": passed, "failures": failures},
            "ok": len(passed) == len(names) > 0}


# ------------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trl", type=Path, help="checkout of huggingface/trl")
    ap.add_argument("--nemo-rl", type=Path, help="checkout of NVIDIA-NeMo/RL")
    ap.add_argument("--areal", type=Path, help="checkout of inclusionAI/AReaL")
    ap.add_argument("--verl", type=Path, help="checkout of verl-project/verl (volcengine/verl)")
    ap.add_argument("--areal-worlds", default="2,4", help="AReaL's world sizes (default 2,4)")
    ap.add_argument("--control", action="store_true", help="also run the stacks' own implementations")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    if not any([args.trl, args.nemo_rl, args.areal, args.verl]):
        ap.error("give at least one of --trl, --nemo-rl, --areal, --verl")
    import torch

    print(f"torch {torch.__version__}, dualvp from {REPO}", flush=True)
    jobs = []
    impls = ["dualvp"] + (["control"] if args.control else [])
    if args.trl:
        jobs += [(f"trl/{i}", lambda i=i: run_trl(args.trl, i)) for i in impls]
    if args.nemo_rl:
        jobs += [("nemo_rl/dualvp", lambda: run_nemo(args.nemo_rl))]
    if args.areal:
        worlds = tuple(int(w) for w in args.areal_worlds.split(","))
        jobs += [(f"areal/{i}", lambda i=i: run_areal(args.areal, i, worlds)) for i in impls]
    if args.verl:
        jobs += [(f"verl/{i}", lambda i=i: run_verl(args.verl, i)) for i in impls]
    results, ok = [], True
    for name, job in jobs:
        t0 = time.perf_counter()
        res = job()
        res["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        if res["impl"] == "dualvp":
            ok &= res["ok"]
        shown = {k: v for k, v in res.items() if k != "pytest_tail"}
        print(f"{name}: {'PASS' if res['ok'] else 'FAIL'} {json.dumps(shown)}", flush=True)
        if not res["ok"] and "pytest_tail" in res:
            print(textwrap.indent(res["pytest_tail"], "    | "), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
