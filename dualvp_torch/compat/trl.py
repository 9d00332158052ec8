"""Drop-ins for Hugging Face TRL's ``trl.trainer.utils.selective_log_softmax`` and ``entropy_from_logits``.

One line makes every TRL trainer (GRPO, RLOO, DPO, KTO, SFT and the experimental ones) call dualvp::

    from dualvp_torch.compat import trl as dualvp_trl
    dualvp_trl.install()                 # reversible: dualvp_trl.uninstall(), or `with dualvp_trl.install():`

TRL's trainer modules import the names themselves (``from .utils import selective_log_softmax``), so
:func:`install` rebinds them in ``trl.trainer.utils`` AND in every TRL module already loaded that holds
TRL's own function; modules loaded later import the rebound names from ``trl.trainer.utils``.

Semantics (TRL's, at huggingface/trl f2cd57710):

* ``selective_log_softmax(logits, index)``: ``logits [..., V]``; ``index [...]`` gives ``[...]``
  log-probs, ``index [..., K]`` gives ``[..., K]`` (``K`` log-probs per position).
* TRL >= 1.11 added ``temperature`` and ``row_mask`` to ``selective_log_softmax`` and a one-pass
  ``selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True, temperature=1.0,
  row_mask=None)``; both are here too. (Its GRPO trainer no longer calls these functions: it computes the
  log-probs in its own fused LM head, ``add_fused_lm_head``; :func:`install` still patches every trainer
  that calls them.)
* ``entropy_from_logits(logits, chunk_size=128)``: ``[...]`` entropy of ``softmax(logits)``;
  ``chunk_size`` is accepted (an int >= 1) and not used: the op needs no ``[T, V]`` scratch, so the
  results are identical for every value.

Output dtype: the logits' dtype, TRL's. The values are computed in float32 (float64 for float64 logits)
and rounded ONCE to the logits' dtype: with bfloat16 logits TRL's own log-probs are 0.036-0.070 nats off
the float64 values at V = 1k-32k, these are within the bfloat16 rounding of the exact value. Keyword
``float32_output=True`` (or ``install(float32_output=True)``) returns the float32 values unrounded: the
recommended setting for the importance ratios of GRPO-style losses.

Deliberate differences from TRL:

* An index outside ``[0, V)`` raises ``ValueError`` (TRL's ``gather`` raises too, with another message).
* 16-bit results are not bit-equal to TRL's (which rounds at every step of a 16-bit ``log_softmax``):
  TRL's own 16-bit tests assert that bit-equality, which a more accurate result cannot pass; against
  float64 these are closer on every one of those tests' inputs (``scripts/peer_tests.py``).
* The entropy of a row with ``-inf`` logits is finite (TRL's is NaN from ``0 * -inf``).

``K`` ids per position run the core op's K-target pass (``multi_target=True``: one pass over the
logits, see ``dualvp_torch.function.logprobs_k``).

:data:`calls` counts the calls of the two functions (``"selective_log_softmax"``,
``"entropy_from_logits"``), so that a run can check that the patch is active.
"""

from __future__ import annotations

import collections
import functools
import sys

import torch

from ..function import entropy_only, logprob_entropy, logprobs_k
from ._core import NO_IGNORE, argument_names, check_chunk_size, check_flag, kind, stack_dtype

__all__ = ["selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy", "install",
           "uninstall", "calls"]

#: Calls of the drop-ins since import (``Counter``; reset it at will).
calls: collections.Counter = collections.Counter()

_NAMES = {"logits": "logits", "target": "index"}


def selective_log_softmax(
    logits, index, temperature: float = 1.0, row_mask=None, *, float32_output: bool = False
) -> torch.Tensor:
    """TRL's ``selective_log_softmax``: ``log_softmax(logits / temperature)`` gathered at ``index``.

    Args:
      logits: ``[..., V]`` float tensor.
      index: ``[...]`` (one id per position) or ``[..., K]`` (``K`` ids per position) integer tensor.
      temperature: ``> 0`` (TRL >= 1.11's argument; the op divides without a copy of the logits).
      row_mask: ``None`` or a tensor shaped like ``index``: positions where it is 0 give 0 and no
        gradient, whatever their ids (TRL >= 1.11's argument).
      float32_output: ``True`` returns float32 (float64 for float64 logits) instead of the logits' dtype.

    Returns:
      The shape of ``index``, in the logits' dtype (rounded once from float32).

    Raises:
      TypeError / ValueError naming ``logits`` or ``index``; ``ValueError`` for an id outside ``[0, V)``.
    """
    calls["selective_log_softmax"] += 1
    check_flag(float32_output, "float32_output")
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise TypeError(f"logits: expected a torch.Tensor [..., V] of a floating dtype, got {kind(logits)}")
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index: expected an integer torch.Tensor [...] or [..., K], got {kind(index)}")
    index, keep = _apply_row_mask(index, row_mask)
    if index.dim() == logits.dim() - 1:
        with argument_names(**_NAMES):
            out, _ = logprob_entropy(
                logits, index, temperature=temperature, with_entropy=False, ignore_index=NO_IGNORE
            )
    elif index.dim() == logits.dim() and tuple(index.shape[:-1]) == tuple(logits.shape[:-1]):
        # the core op's K-target pass (one pass, one statistics gather whatever K)
        out = logprobs_k(logits, index, group=None, ignore_index=NO_IGNORE, temperature=temperature,
                               names=_NAMES)
    else:
        raise ValueError(
            f"index: expected shape {tuple(logits.shape[:-1])} or {tuple(logits.shape[:-1]) + ('K',)} for logits "
            f"of shape {tuple(logits.shape)}, got {tuple(index.shape)}"
        )
    if keep is not None:
        out = out.masked_fill(~keep, 0.0)
    return stack_dtype(out, logits.dtype, float32_output)


def _apply_row_mask(index, row_mask):
    """``(index with id 0 where row_mask == 0, keep)``; ``keep`` is ``None`` without a mask."""
    if row_mask is None:
        return index, None
    if not isinstance(row_mask, torch.Tensor) or tuple(row_mask.shape) != tuple(index.shape):
        raise ValueError(f"row_mask: expected None or a tensor of the index's shape {tuple(index.shape)}, "
                         f"got {kind(row_mask)}")
    keep = row_mask != 0
    return torch.where(keep, index, torch.zeros((), dtype=index.dtype, device=index.device)), keep


def selective_log_softmax_and_entropy(
    logits, index, entropy_requires_grad: bool = True, temperature: float = 1.0, row_mask=None, *,
    float32_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL >= 1.11's ``selective_log_softmax_and_entropy``: ``(log-probs [...], entropy [...])`` of
    ``softmax(logits / temperature)`` from ONE call of the op (one pass over the logits).

    ``index [...]`` (one id per position); ``row_mask`` as in :func:`selective_log_softmax` (0 rows give
    0 for both); ``entropy_requires_grad=False``: the entropy without gradient. Output dtype: the logits'
    (rounded once), or float32 with ``float32_output=True``.
    """
    calls["selective_log_softmax_and_entropy"] += 1
    check_flag(entropy_requires_grad, "entropy_requires_grad")
    check_flag(float32_output, "float32_output")
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index: expected an integer torch.Tensor [...], got {kind(index)}")
    index, keep = _apply_row_mask(index, row_mask)
    with argument_names(**_NAMES):
        lp, ent = logprob_entropy(
            logits, index, temperature=temperature, with_entropy=True, entropy_grad=entropy_requires_grad,
            ignore_index=NO_IGNORE,
        )
    if keep is not None:
        lp, ent = lp.masked_fill(~keep, 0.0), ent.masked_fill(~keep, 0.0)
    return stack_dtype(lp, logits.dtype, float32_output), stack_dtype(ent, logits.dtype, float32_output)


def entropy_from_logits(logits, chunk_size: int = 128, *, float32_output: bool = False) -> torch.Tensor:
    """TRL's ``entropy_from_logits``: ``[...]`` entropy (nats) of ``softmax(logits [..., V])``.

    ``chunk_size`` (an int >= 1) is accepted and not used (identical results for every value). Returns
    the logits' dtype (rounded once from float32), or float32 with ``float32_output=True``.
    """
    calls["entropy_from_logits"] += 1
    check_chunk_size(chunk_size)
    check_flag(float32_output, "float32_output")
    entropy = entropy_only(logits, group=None)
    return stack_dtype(entropy, logits.dtype, float32_output)


# --------------------------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------------------------

#: Rebound by :func:`install`; ``selective_log_softmax_and_entropy`` only where TRL has it (>= 1.11).
_REPLACED = ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy")
#: name -> TRL's original function, while installed.
_originals: dict = {}
#: name -> the function installed in its place.
_installed: dict = {}


class Installation:
    """What :func:`install` returns: ``.modules`` (names of the modules patched at install time); a
    context manager that uninstalls on exit."""

    def __init__(self, modules: list):
        self.modules = modules

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        uninstall()
        return False

    def __repr__(self):
        return f"Installation(modules={self.modules!r})"


def _trl_modules():
    return [(n, m) for n, m in list(sys.modules.items()) if m is not None and (n == "trl" or n.startswith("trl."))]


def install(*, float32_output: bool = False) -> Installation:
    """Make TRL call dualvp: rebind ``selective_log_softmax`` and ``entropy_from_logits`` in
    ``trl.trainer.utils`` and in every loaded TRL module that holds TRL's own function.

    Imports ``trl.trainer.utils`` (TRL must be installed). Calling it again re-installs (e.g. with
    another ``float32_output``). Reversed by :func:`uninstall` or by leaving ``with install(): ...``.

    Args:
      float32_output: the installed functions return float32 instead of the logits' dtype.
    """
    check_flag(float32_output, "float32_output")
    import trl.trainer.utils as trl_utils

    if _installed:
        uninstall()
    ours = {"selective_log_softmax": selective_log_softmax, "entropy_from_logits": entropy_from_logits,
            "selective_log_softmax_and_entropy": selective_log_softmax_and_entropy}
    if float32_output:
        ours = {name: functools.wraps(fn)(functools.partial(fn, float32_output=True)) for name, fn in ours.items()}
    for name in _REPLACED:
        if hasattr(trl_utils, name):
            _originals[name] = getattr(trl_utils, name)
            _installed[name] = ours[name]
    patched = []
    for mod_name, mod in _trl_modules():
        hit = False
        for name in _installed:
            if getattr(mod, name, None) is _originals[name]:
                setattr(mod, name, _installed[name])
                hit = True
        if hit:
            patched.append(mod_name)
    return Installation(sorted(patched))


def uninstall() -> list:
    """Restore TRL's functions wherever :func:`install` (or a module imported since) bound dualvp's.

    Returns the names of the modules restored; a no-op when not installed.
    """
    restored = []
    for mod_name, mod in _trl_modules():
        hit = False
        for name, fn in _installed.items():
            if getattr(mod, name, None) is fn:
                setattr(mod, name, _originals[name])
                hit = True
        if hit:
            restored.append(mod_name)
    _installed.clear()
    _originals.clear()
    return sorted(restored)
