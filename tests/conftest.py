import os
import sys

# Bytecode caches, where the environment turns them off (PYTHONDONTWRITEBYTECODE: this machine sets
# it): otherwise every process of a run (the xdist workers, the CLI and bench subprocesses, the
# torchrun workers) compiles dualvp's sources again (~0.6 s of a process's start) and each worker
# re-runs pytest's assertion rewriting of every test module (~1 s). Set here, in the process that
# starts the workers, before they start.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Without a GPU the Triton kernels run on the CPU under Triton's interpreter. Triton decides at import
# (its language functions) and at decoration (each kernel) whether it interprets, so the variable is set
# here, before any test module imports triton or torch._dynamo (which imports triton). On a machine with
# a GPU it is left unset: the CUDA tests (pytest -m cuda) run the compiled kernels.
if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"

# JAX reads XLA_FLAGS once, at import: give every test process (and the torch
# ranks it spawns, which inherit the environment) 8 host devices before any
# test module imports jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# Compile time, the larger part of a CPU test run. XLA's LLVM backend at
# optimisation level 0 compiles in less time (docs/decisions.md, "Test time:
# compiles and processes") and computes the same
# numbers: XLA:CPU does not enable fast-math, so LLVM may not reorder a
# floating-point operation at any level, and the HLO passes (fusion, buffer
# assignment: what the memory tests read) run before LLVM, unchanged.
# `python -m dualvp verify` and the bench run at the default level. An explicit
# level in XLA_FLAGS is kept.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:CPU's fusion emitters (MLIR) take twice the compile time of its elemental
# IR emitters for our programs (a shard_map forward + backward: 2.1 -> 1.0 s;
# tests/jax 212 -> 137 s). Both emit the same element-wise HLO without
# fast-math; a transcendental may round differently in its last bit, which the
# float64-oracle tolerances do not see. Fusion and buffer assignment are HLO
# passes, unchanged. An explicit choice in XLA_FLAGS is kept.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# Inductor compiles kernels in a pool of subprocesses (compile_threads = the
# core count, 2 here): each process that compiles (both xdist workers, the
# compiled torch ranks) starts its pool, two more Python processes importing
# torch, only to share the same two cores. One thread compiles in-process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# One intra-op thread per test process (torch, OpenMP in inductor's kernels, OpenBLAS): two xdist
# workers already fill both cores, and a test-sized product split over threads waits for a thread
# that is not running (an 8x16 @ 16x130 float32 mm: 13.6 ms with 2 threads on 2 busy cores, 5 us
# with 1). The ranks that tests spawn run one thread each already (dualvp_torch.testing). The
# eager engine's parallel chunks are tested where a test sets the thread count itself
# (tests/torch/test_eager_path.py, tests/cross/test_batch_invariance.py). An explicit value is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A compilation cache shared by this run's processes (both xdist workers, the
# CLI and bench subprocesses, which inherit the environment): several tests
# compile the same program (the same op at the same shapes from different
# entry points). One directory per run, so no run reads another's programs.
_JAX_CACHE = None  # the directory this process made (and removes at the end), if any
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _JAX_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dualvp-tests-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# The 8-rank Megatron job (tests/torch/test_compat_megatron_slime.py) imports megatron-core in every
# rank, ~2 s each: the ranks' forkserver imports it once instead (dualvp_torch.testing). Set
# only where megatron is installed (find_spec of the top-level package imports nothing).
import importlib.util  # noqa: E402

_preload = ["megatron.core.tensor_parallel"] if importlib.util.find_spec("megatron") is not None else []

# Triton's interpreter patches triton.language again at every @triton.jit call inside a kernel
# (tl.sum, tl.max, ...): tests/_triton_interpreter.py patches once per launch, here and, through
# the forkserver's preload, in the ranks the tests fork.
from tests import _triton_interpreter  # noqa: E402,F401

if _triton_interpreter.installed:
    _preload.append("tests._triton_interpreter")
if _preload:
    os.environ.setdefault("DUALVP_FORKSERVER_PRELOAD", ",".join(_preload))

# Hypothesis: a bounded profile for CI; DUALVP_FUZZ_EXAMPLES raises the budget
# for a longer opt-in run.
from hypothesis import HealthCheck, settings

_n = int(os.environ.get("DUALVP_FUZZ_EXAMPLES", "0") or 0)
settings.register_profile(
    "dualvp",
    max_examples=_n or 40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=not _n,
)
settings.load_profile("dualvp")


# pytest-xdist (``-n 2``, the README's test command): whole test files per
# worker, in collection order. A file's tests share what its module caches
# (the one spawn per W of tests/torch/test_logits_ranks.py, the tables of
# tests/cross/test_cross_backends.py, the 8-rank Megatron job, compiled
# programs); xdist's default ``load`` would split a file over both workers,
# which spawn and compile all that twice. Collection order rather than xdist's
# largest-file-first (by test count) ends the run on tests/torch's mid-sized
# files instead of a one-test file that takes 20 s. An explicit ``--dist``
# other than ``load`` is honoured.
import pytest  # noqa: E402


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


# File order. tests/torch/test_logits_conformance.py compiles every torch kernel
# variant at W = 1 and goes first; tests/cross/test_cross_backends.py, whose
# W = 2 ranks compile the same graphs, goes after tests/jax, by when those
# compiles sit in inductor's FX graph cache (the compiled kernels no longer
# depend on the thread count, so the 1-thread ranks read what the 2-thread
# test process wrote) instead of being repeated cold in both ranks at once.
_FIRST = ("tests/torch/test_logits_conformance.py",)
# tests/torch/test_logits_memory.py (15 s) goes before the other tests/torch files, which are
# shorter: the run then ends on short files on both workers (in a model of the run from one
# run's per-file times, the later worker's end 175 -> 171 s, against a floor of 170 s for
# perfect balance). tests/torch/test_triton_logits.py (the largest torch file in both tiers) goes
# there too: last in alphabetical order, it kept one worker busy ~8 s after the other had ended
# in the fast tier.
_MOVED = {  # file -> after the last file under this prefix (in this order)
    "tests/cross/test_cross_backends.py": "tests/jax/",
    "tests/torch/test_logits_memory.py": "tests/tools/",
    "tests/torch/test_triton_logits.py": "tests/torch/test_logits_memory.py",
}


def pytest_collection_modifyitems(config, items):
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    order = [f for f in files if f in _FIRST] + [f for f in files if f not in _FIRST and f not in _MOVED]
    for f, prefix in _MOVED.items():
        if f in files:
            after = [i for i, g in enumerate(order) if g.startswith(prefix)]
            order.insert(after[-1] + 1 if after else len(order), f)
    rank = {f: i for i, f in enumerate(order)}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


def pytest_unconfigure(config):
    # the process that made the run's JAX cache (xdist's controller, or the
    # only process) removes it
    if _JAX_CACHE is not None and not hasattr(config, "workerinput"):
        import shutil

        shutil.rmtree(_JAX_CACHE, ignore_errors=True)
