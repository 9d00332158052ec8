"""Argument parsing for the ``dualvp`` command."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Optional, Sequence

__all__ = ["main", "console_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dualvp",
        description="Log-probabilities and entropies from vocab-sharded logits: cross-framework check "
        "(verify) and benchmark (bench).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check every backend against the float64 oracle and each other")
    v.add_argument("--op", default="logits", choices=["logits", "linear", "kl", "extended"],
                   help="logits: logprob_entropy on vocab-sharded logits (default); linear: the fused LM head "
                   "linear_logprob_entropy on hidden states [T, H] and the vocab-parallel weight [V, H]; "
                   "kl: kl_divergence of two vocab-sharded logits (values and both gradients); extended: the "
                   "conformance table of K targets per row, a per-row temperature and sum_p2")
    v.add_argument("--direction", default="forward", choices=["forward", "reverse"],
                   help="--op kl: KL(p || q) (forward, p from the logits) or KL(q || p)")
    v.add_argument("--hidden", type=int, default=64, help="--op linear: hidden size H")
    v.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size W (vocab shards); default 2, or under a launcher (torchrun: RANK, "
                   "WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) the job's WORLD_SIZE, in groups of consecutive ranks")
    v.add_argument("--input", metavar="FILE", default=None,
                   help="check your own data instead of a random problem: a torch.save'd dict (read with "
                   "weights_only=True) or an .npz with 'logits' [T, V] (full vocabulary), 'target' [T] and "
                   "optionally 'keep_mask' [T, V]; leading dims are flattened; V must be divisible by --tp")
    v.add_argument("--tokens", type=int, default=None,
                   help="rows T (default 256); with --input: use only the first TOKENS rows (default all)")
    v.add_argument("--vocab", type=int, default=4096,
                   help="full vocabulary V (divisible by --tp; ignored with --input)")
    v.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"],
                   help="logits dtype (default float32; with --input: the file's, or round the file's logits to this)")
    v.add_argument("--temperature", type=float, default=1.0)
    v.add_argument("--mask", default="none", choices=["none", "nucleus", "drop_target", "random"],
                   help="keep mask to build (with --input: only when the file has no keep_mask)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--backends", default="torch,jax",
                   help="comma-separated subset of torch,jax (under a launcher: torch only, on the job's ranks)")
    v.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the torch backend runs: cpu (gloo ranks) or cuda (W=1 in this process, W>1 on "
                   "W NCCL ranks, one GPU each; fails at once without enough GPUs); JAX stays on CPU host devices")
    v.add_argument("--no-compile", dest="compile", action="store_false",
                   help="torch: use the eager row-chunked path instead of torch.compile")
    v.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a backend run is killed (under a launcher: the process-group timeout)")
    b = sub.add_parser("bench", help="speed, memory and precision of every implementation against baselines")
    from .bench import add_arguments

    add_arguments(b)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "verify":
        from .verify import run

        return run(args)
    if args.command == "bench":
        from .bench import run as run_bench

        return run_bench(args)
    raise AssertionError(args.command)


def console_main() -> NoReturn:
    """The ``dualvp`` command as a process (``python -m dualvp``, the console script): :func:`main`, then exit.

    A ``verify`` run as one worker of a launcher (torchrun) exits with ``os._exit`` once its verdict is
    printed and flushed and its process group destroyed: the interpreter's teardown is skipped. On a
    loaded CI machine a worker that had printed PASS aborted in that teardown ("terminate called without
    an active exception", SIGABRT, twice in two CI runs; not reproduced in 8 launches on a quiet machine),
    which torchrun reports as the job failing and which left the other agent waiting at its exit barrier.
    Nothing is left to run at that point; :func:`main` itself returns normally for in-process callers.
    """
    argv = sys.argv[1:]
    rc = main(argv)
    if argv[:1] == ["verify"]:
        from .verify import launched

        if launched():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    sys.exit(rc)

