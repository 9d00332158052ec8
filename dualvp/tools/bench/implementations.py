"""The implementations ``dualvp bench`` compares, one declaration each.

An :class:`Impl` names what must be importable, which worker loop runs it
(``"torch"`` or ``"jax"``, see :mod:`dualvp.tools.bench.worker`) and a
``build`` function. The worker calls ``build(ctx)`` once per process (inside
the worker, so torch, jax, megatron and slime are imported only there) and
gets a forward function

    forward(z, y, keep, mode, validate=True) -> (logprob [T], entropy [T] or None)

on this rank's logits shard ``z [T, V_local]``, the global targets ``y [T]``
and, for masked modes, the keep mask ``keep [T, V_local]`` (else ``None``).
The backward is the framework's own: the worker loop differentiates
``sum(gl * logprob) + sum(gh * entropy)`` (the entropy term only when the
mode asks for its gradient), identically for every implementation of a
framework. ``validate=False`` is what the host-time loop passes (dualvp's
ops then skip their synchronising checks; the baselines have none).
``build`` raises :class:`Unavailable` when the implementation cannot run
here (an ``impl=`` this dualvp does not have); the run lists it as skipped.

Adding an implementation is adding one entry to :data:`IMPLS`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from dualvp.testing.modes import MODES, Mode  # the one table of option modes (tests use it too)

__all__ = ["Mode", "MODES", "Context", "Impl", "IMPLS", "Unavailable", "locate", "load_slime_ops"]


@dataclass(frozen=True)
class Context:
    """What ``build`` gets in the worker: the framework module and this rank's place."""

    fw: Any  # the torch or jax module
    group: Any = None  # torch.distributed process group, or None
    rank: int = 0
    world: int = 1
    vocab_start: int = 0  # first global column of this rank's shard
    device: str = "cpu"  # where the worker runs: "cpu" or "cuda"
    options: Mapping[str, Any] = field(default_factory=dict)  # from `locate`, e.g. the slime file


Forward = Callable[..., tuple]


class Unavailable(Exception):
    """Raised by ``build`` when the implementation cannot run here; the message says why."""


@dataclass(frozen=True)
class Impl:
    """One implementation under test.

    Attributes:
      name: the ``--impls`` name.
      framework: ``"torch"`` or ``"jax"``: the worker loop that runs it.
      needs: modules that must be importable for it to run.
      build: ``build(ctx) -> forward`` (see the module docstring).
      about: one line, listed by ``dualvp bench --help``.
      process_group: needs a ``torch.distributed`` group even at W=1.
      gloo: also runs on W ranks (``--worlds``) over a gloo group.
      nonleaf_logits: the logits must be the output of an autograd node (the
        gradient overwrites them); see :func:`dualvp.tools.bench.worker.run_torch`.
      modes: the modes it computes (default all of :data:`MODES`).
      devices: where it runs at all; default_devices: where it runs when
        ``--impls`` is not given (the Triton ones run on a CPU only when named
        and under ``TRITON_INTERPRET=1``: the GPU check's rehearsal).
      inductor: runs dualvp's compiled path (inductor compiles on first use);
        a run without ``--impls`` times these after the others, so that a
        run cut short has the baselines' rows.
      locate: ``locate(args) -> options dict`` or a string saying why it
        cannot run; the default checks ``needs``.
    """

    name: str
    framework: str
    needs: tuple
    build: Callable[[Context], Forward]
    about: str
    process_group: bool = False
    gloo: bool = False
    nonleaf_logits: bool = False
    modes: tuple = tuple(MODES)
    devices: tuple = ("cpu", "cuda")
    default_devices: tuple = ("cpu", "cuda")
    inductor: bool = False
    locate: Optional[Callable[[argparse.Namespace], Union[str, dict]]] = None


# --------------------------------------------------------------------------- torch


def _dualvp_torch(ctx: Context, **fixed) -> Forward:
    import torch

    from dualvp_torch import logprob_entropy

    if fixed.get("impl") is not None:  # an impl this dualvp lacks (or cannot run here) is skipped
        try:
            _check_impl(torch, logprob_entropy, fixed["impl"], ctx.device)
        except (ValueError, NotImplementedError, ImportError) as e:
            raise Unavailable(f"impl={fixed['impl']!r}: {type(e).__name__}: {e}") from e

    def forward(z, y, keep, mode: Mode, validate: bool = True):
        return logprob_entropy(z, y, group=ctx.group, keep_mask=keep, with_entropy=mode.with_entropy,
                               entropy_grad=mode.entropy_grad, validate=validate, **fixed)

    return forward


def _check_impl(torch, logprob_entropy, impl: str, device: str) -> None:
    """Raise if dualvp_torch cannot run ``impl``: the op's engine registry's names where it has one
    (no compile), else a call on a 2 x 4 problem."""
    if impl == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("impl='triton' runs on a CPU only under TRITON_INTERPRET=1")
    try:  # the names logprob_entropy takes: the engine registry's
        from dualvp_torch.engines import NAMES as names
    except ImportError:
        names = None
    if names is not None and isinstance(names, (tuple, list, frozenset, set)):
        if impl not in names:
            raise ValueError(f"impl: expected None or one of {tuple(names)}, got {impl!r}")
        return
    z = torch.zeros(2, 4, device=device, requires_grad=True)
    logprob_entropy(z, torch.zeros(2, dtype=torch.long, device=device), impl=impl)[0].sum().backward()


def _dualvp_impl(impl: Optional[str] = None, **fixed) -> Callable[[Context], Forward]:
    return lambda ctx: _dualvp_torch(ctx, impl=impl, **fixed)


def _kept_with_target(torch, keep, y, vocab_start: int):
    """``keep`` plus the target column where this shard owns it (the target is always kept)."""
    loc = y - vocab_start
    owns = (loc >= 0) & (loc < keep.shape[-1])
    cols = torch.arange(keep.shape[-1], device=keep.device)
    return keep | ((cols[None, :] == loc[:, None]) & owns[:, None])


def _torch_eager(ctx: Context) -> Forward:
    """``log_softmax`` + ``gather``, entropy ``-(p * log p).sum``, autograd, in the input dtype."""
    torch = ctx.fw

    def forward(z, y, keep, mode: Mode, validate: bool = True):
        logp = torch.log_softmax(z, dim=-1)
        lq = logp
        if keep is not None:
            lq = torch.log_softmax(z.masked_fill(~_kept_with_target(torch, keep, y, 0), float("-inf")), dim=-1)
        lp = lq.gather(-1, y[:, None])[:, 0]
        h = None
        if mode.with_entropy:
            src = logp if mode.entropy_grad else logp.detach()
            h = -(src.exp() * src).sum(-1)
        return lp, h

    return forward


def _tp_entropy(torch, dist):
    """The unfused vocab-parallel entropy RL frameworks used next to Megatron's
    fused cross-entropy: all-reduce MAX, SUM of exp, SUM of p*z; saves softmax."""

    class TPEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z, group):
            zf = z.float()
            m = zf.max(dim=-1, keepdim=True)[0]
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = (zf - m).exp()
            s = e.sum(dim=-1, keepdim=True)
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
            p = e.div_(s)
            pz = (p * zf).sum(dim=-1, keepdim=True)
            dist.all_reduce(pz, op=dist.ReduceOp.SUM, group=group)
            h = m + s.log() - pz
            ctx.save_for_backward(p, zf, pz)
            ctx.in_dtype = z.dtype
            return h[:, 0]

        @staticmethod
        def backward(ctx, gh):
            p, zf, pz = ctx.saved_tensors
            g = p * (pz - zf) * gh[:, None]
            return g.to(ctx.in_dtype), None

    return TPEntropy


def _megatron(ctx: Context) -> Forward:
    """Megatron-core's fused vocab-parallel cross-entropy plus :func:`_tp_entropy`."""
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    torch = ctx.fw
    entropy = _tp_entropy(torch, dist)

    def forward(z, y, keep, mode: Mode, validate: bool = True):
        zz = z
        if keep is not None:
            zz = z.masked_fill(~_kept_with_target(torch, keep, y, ctx.vocab_start), float("-inf"))
        # Megatron's fused CE subtracts the max from its input in place when the
        # input is already float32: give it a copy (the caller still needs z).
        if zz is z and z.dtype == torch.float32:
            zz = z.clone()
        lp = -fused_vocab_parallel_cross_entropy(zz[:, None, :], y[:, None], ctx.group)[:, 0]
        h = None
        if mode.with_entropy:
            h = entropy.apply(z if mode.entropy_grad else z.detach(), ctx.group)
        return lp, h

    return forward


# --------------------------------------------------------------------------- slime

_SLIME_FILE = os.path.join("slime", "utils", "ppo_utils.py")


def _locate_slime(args: argparse.Namespace) -> Union[str, dict]:
    """The user's ``slime/utils/ppo_utils.py``: under ``--slime-path``, else of an importable ``slime``."""
    if importlib.util.find_spec("torch") is None:
        return "torch not importable"
    root = getattr(args, "slime_path", None)
    if root:
        path = os.path.join(os.path.abspath(root), _SLIME_FILE)
        return {"slime_file": path} if os.path.isfile(path) else f"--slime-path: no {_SLIME_FILE} under {root}"
    try:
        found = importlib.util.find_spec("slime")
    except (ImportError, ValueError):
        found = None
    for d in (found.submodule_search_locations or []) if found else []:
        path = os.path.join(d, "utils", "ppo_utils.py")
        if os.path.isfile(path):
            return {"slime_file": path}
    return "no slime checkout (pass --slime-path DIR or make slime importable)"


class _StandIn(types.ModuleType):
    """A module that is not installed: any attribute is another stand-in.

    Only top-level imports of the slime file ever touch it; the op under test
    needs nothing but torch.
    """

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")

    def __call__(self, *a, **k):  # used as a decorator or called at import time
        return a[0] if len(a) == 1 and callable(a[0]) and not k else self


def load_slime_ops(path: str, max_stand_ins: int = 20) -> types.ModuleType:
    """Execute the slime file at ``path`` alone (not its package) and return it as a module.

    The file is loaded from its path, so ``slime/__init__.py`` and the rest of
    slime are never imported. When a top-level import names a module that is
    not installed (slime imports Megatron, Ray, ... in some versions), a
    stand-in is registered under that name and the file is executed again;
    the stand-ins' names are in the module's ``_dualvp_stand_ins``. torch
    itself is never stood in for.
    """
    stand_ins: list = []
    try:
        for _ in range(max_stand_ins + 1):
            loader_spec = importlib.util.spec_from_file_location("_dualvp_bench_slime_ppo_utils", path)
            mod = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(mod)
            except ModuleNotFoundError as e:
                if not e.name or e.name.split(".")[0] == "torch" or e.name in sys.modules:
                    raise
                sys.modules[e.name] = _StandIn(e.name)
                stand_ins.append(e.name)
                continue
            mod._dualvp_stand_ins = list(stand_ins)
            return mod
        raise ImportError(f"{path}: more than {max_stand_ins} missing imports ({stand_ins})")
    finally:
        for name in stand_ins:
            if isinstance(sys.modules.get(name), _StandIn):
                del sys.modules[name]


def _slime(ctx: Context) -> Forward:
    """slime's fused ``calculate_log_probs_and_entropy`` (``_VocabParallelLogProbEntropy``)."""
    ops = load_slime_ops(ctx.options["slime_file"])
    fn = ops.calculate_log_probs_and_entropy

    def forward(z, y, keep, mode: Mode, validate: bool = True):
        lp, h = fn(z, y, ctx.group, with_entropy=mode.with_entropy, log_prob_keep_mask=keep,
                   with_entropy_grad=mode.entropy_grad)
        return lp.reshape(-1), h  # slime returns the log-prob as [T, 1]

    return forward


# --------------------------------------------------------------------------- liger


def _locate_interpreted(args: argparse.Namespace) -> Union[str, dict]:
    """A Triton implementation on a CPU: only under Triton's interpreter."""
    if getattr(args, "device", "cpu") == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "runs on a CPU only under TRITON_INTERPRET=1 (Triton's interpreter)"
    return {}


def _liger(ctx: Context) -> Forward:
    """Liger-Kernel's Triton cross-entropy, ``reduction="none"``: the log-prob only.

    It writes the gradient into its input during the forward, so its logits
    are non-leaf copies (``nonleaf_logits``), as an LM head's output is.
    """
    from liger_kernel.transformers.functional import liger_cross_entropy

    def forward(z, y, keep, mode: Mode, validate: bool = True):
        return -liger_cross_entropy(z, y, reduction="none"), None

    return forward


# --------------------------------------------------------------------------- jax


def _dualvp_jax(ctx: Context) -> Forward:
    import dualvp_jax

    def forward(z, y, keep, mode: Mode, validate: bool = True):
        return dualvp_jax.logprob_entropy(z, y, keep_mask=keep, with_entropy=mode.with_entropy,
                                          entropy_grad=mode.entropy_grad)

    return forward


def _jax_naive(ctx: Context) -> Forward:
    """``torch-eager`` in JAX: ``log_softmax`` + ``take_along_axis``, entropy ``-(p * log p).sum``."""
    jax = ctx.fw
    jnp = jax.numpy

    def forward(z, y, keep, mode: Mode, validate: bool = True):
        logp = jax.nn.log_softmax(z, axis=-1)
        lq = logp
        if keep is not None:
            kept = keep | (jnp.arange(z.shape[-1]) == y[:, None])
            lq = jax.nn.log_softmax(jnp.where(kept, z, -jnp.inf), axis=-1)
        lp = jnp.take_along_axis(lq, y[:, None], axis=-1)[:, 0]
        h = None
        if mode.with_entropy:
            h = -(jnp.exp(logp) * logp).sum(-1)
            if not mode.entropy_grad:
                h = jax.lax.stop_gradient(h)
        return lp, h

    return forward


# --------------------------------------------------------------------------- the registry

_DUALVP_TORCH = ("torch", "dualvp_torch.function")
_LP_ONLY = ("lp",)

IMPLS: dict[str, Impl] = {i.name: i for i in (
    Impl("dualvp-torch", "torch", _DUALVP_TORCH, _dualvp_impl(),
         "dualvp_torch.logprob_entropy, the default implementation selection", gloo=True, inductor=True),
    Impl("dualvp-torch-compiled", "torch", _DUALVP_TORCH, _dualvp_impl("compiled"),
         "the same with impl='compiled' (the compiled spec stages)", default_devices=("cuda",), inductor=True),
    Impl("dualvp-torch-triton", "torch", _DUALVP_TORCH, _dualvp_impl("triton"),
         "the same with impl='triton' (hand-written Triton kernels; CUDA, or a CPU under TRITON_INTERPRET=1)",
         gloo=True, default_devices=("cuda",), locate=_locate_interpreted),
    Impl("dualvp-torch-eager", "torch", _DUALVP_TORCH, _dualvp_impl("eager"),
         "the same with impl='eager' (row-chunked eager kernels)", gloo=True),
    Impl("dualvp-torch-inplace", "torch", _DUALVP_TORCH, _dualvp_impl(inplace_grad=True),
         "dualvp-torch with inplace_grad=True (the gradient overwrites the logits)", nonleaf_logits=True,
         inductor=True),
    Impl("dualvp-jax", "jax", ("jax", "dualvp_jax"), _dualvp_jax, "dualvp_jax.logprob_entropy under jax.jit"),
    Impl("torch-eager", "torch", ("torch",), _torch_eager,
         "log_softmax + gather, entropy -(p*log p).sum, autograd, in the input dtype"),
    Impl("jax-naive", "jax", ("jax",), _jax_naive, "the same in JAX under jit (jax.vjp)"),
    Impl("slime", "torch", ("torch",), _slime,
         "slime's fused calculate_log_probs_and_entropy from the user's checkout (--slime-path)",
         gloo=True, locate=_locate_slime),
    Impl("liger", "torch", ("torch", "triton", "liger_kernel"), _liger,
         "Liger-Kernel's cross-entropy (reduction='none'): log-prob only, W=1, CUDA (a CPU: named, interpreted)",
         nonleaf_logits=True, modes=_LP_ONLY, default_devices=("cuda",), locate=_locate_interpreted),
    Impl("megatron", "torch", ("torch", "megatron.core"), _megatron,
         "Megatron-core fused_vocab_parallel_cross_entropy + an unfused vocab-parallel entropy (saves the softmax)",
         process_group=True, gloo=True),
)}


def locate(impl: Impl, args: argparse.Namespace) -> Union[str, dict]:
    """Options for ``impl``'s workers (a dict), or the reason it cannot run here (a string)."""
    for mod in impl.needs:
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} not importable"
        except (ImportError, ValueError) as e:
            return f"{mod} not importable ({e})"
    return impl.locate(args) if impl.locate else {}
