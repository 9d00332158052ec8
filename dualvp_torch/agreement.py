"""Fingerprints of the row-level inputs in the ``validate=True`` agreement record.

The agreement step (``validate=True`` with a group) all-gathers one int64
record per rank: the options and shapes (:mod:`dualvp.validation`). Shapes
alone cannot tell a right call from two realistic wrong ones, which give
log-probs off by 10-17 nats with no error:

* the target differs across the ranks of the group (same shape): a data
  loader out of step on one tensor-parallel rank;
* the wrong group: the data-parallel group passed as ``group`` instead of the
  tensor-parallel one (same size), so the "vocab shards" are shards of
  different replicas' rows.

What must agree across the group besides the options: the **target** (global
token ids of the same rows on every vocab shard, for both ops) and, in the
fused op without ``sequence_parallel``, the **hidden states** (replicated over
the group). The keep mask is vocab-sharded and legitimately differs, and so do
the logits and the weight. This module turns the first two into a few int64
numbers that travel in the same all-gather as the record (:func:`gather_checked`:
no extra collective, and still the one host sync of ``validate=True``), and
raises the same ``ValueError`` on every rank when they differ
(:func:`check_fingerprints`).

The fingerprints are exact integer arithmetic on the ids and on the bit
patterns of the hidden states (no float sums): identical inputs give identical
numbers on any device and in any reduction order, so agreeing ranks never
raise. All terms are reduced modulo the prime ``P = 2**31 - 1`` before they
are summed, so a sum of up to ``2**32`` terms fits in int64 without overflow.

* ``target`` sum: ``sum_i (y_i mod P)``: any change of one id changes it
  (unless the change is a multiple of ``P``).
* ``target`` position-weighted: ``sum_i ((y_i mod P) * w_i mod P)`` with
  weights ``w_i = 48271 * (i + 1) mod P`` distinct and nonzero for ``i <
  P - 1``: catches a rolled or permuted target, which keeps the plain sum.
  Exchanging the ids of rows ``a`` and ``b`` changes the weighted sum by
  ``(y_a - y_b)(w_b - w_a) mod P``, nonzero because ``P`` is prime.
* ``hidden`` (fused op without ``sequence_parallel``): the position-weighted
  sum of the bit patterns (``float32 -> int32`` etc.) of up to
  :data:`HIDDEN_SAMPLE_ROWS` (+ 1) rows spread evenly over the rows (first and last
  included): O(rows sampled * H) work instead of O(T * H), enough to catch
  hidden states that differ everywhere (a row-parallel layer's partial sums
  passed before their all-reduce, another replica's activations); a
  difference confined to unsampled rows is not seen.

Costs: O(T) int64 elementwise work (a few small kernels) and ``[T]`` int64
temporaries per call, no synchronisation of its own where the collective runs
on the inputs' device (NCCL, or gloo on CPU tensors). ``validate=False``
computes none of this.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dualvp import validation

from . import collectives

__all__ = [
    "TARGET_FIELDS",
    "HIDDEN_FIELDS",
    "HIDDEN_SAMPLE_ROWS",
    "fields_of",
    "fingerprint",
    "check_fingerprints",
    "gather_checked",
    "raise_on_every_rank",
]

#: The modulus of every fingerprint term: the Mersenne prime ``2**31 - 1``.
P = 2**31 - 1
#: The multiplier of the position weights (the MINSTD generator's, a primitive root mod ``P``).
_W = 48271

#: Fingerprint fields of the target, in record order.
TARGET_FIELDS = ("target", "target (position-weighted)")
#: Fingerprint field of the fused op's replicated hidden states.
HIDDEN_FIELDS = ("hidden",)
#: Rows of ``hidden`` that enter its fingerprint (spread evenly, first and last included).
HIDDEN_SAMPLE_ROWS = 16

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fields_of(fused: bool) -> tuple:
    """The fingerprint fields of one op: the target's, and for the fused op (``fused=True``) hidden's."""
    return TARGET_FIELDS + (HIDDEN_FIELDS if fused else ())


def _weighted_sum(u: torch.Tensor) -> torch.Tensor:
    """``sum_i (u_i * w_i mod P)`` for ``u [n]`` int64 in ``[0, P)``; 0-d int64."""
    w = torch.remainder(torch.arange(1, u.numel() + 1, device=u.device, dtype=torch.int64) * _W, P)
    return torch.remainder(u * w, P).sum()


def _target_prints(target: torch.Tensor) -> list:
    u = torch.remainder(target.detach().reshape(-1).to(torch.int64), P)
    return [u.sum(), _weighted_sum(u)]


def _hidden_print(hidden: torch.Tensor) -> torch.Tensor:
    h = hidden.detach()
    rows = h.reshape(-1, h.shape[-1]) if h.dim() else h.reshape(1, 1)
    n = rows.shape[0]
    if n > HIDDEN_SAMPLE_ROWS:
        # evenly spread rows through a strided view (no index tensor to copy to the device), plus the last
        step = -(-(n - 1) // (HIDDEN_SAMPLE_ROWS - 1))
        rows = torch.cat([rows[::step], rows[-1:]])
    bits = rows.contiguous().view(_INT_OF_WIDTH[rows.element_size()]).reshape(-1).to(torch.int64)
    return _weighted_sum(torch.remainder(bits, P))


def fingerprint(target: Optional[torch.Tensor], hidden: Optional[torch.Tensor] = None, *, fused: bool = False,
                device: Optional[torch.device] = None) -> torch.Tensor:
    """``[len(fields_of(fused))]`` int64 fingerprints of the call's inputs that must agree across the group.

    ``target``: the call's target (any integer dtype and shape), or ``None``
    on a rank that failed its local checks (its fields are then 0: the record's
    error field decides). ``hidden``: the fused op's hidden states when they
    are replicated over the group, ``None`` otherwise (with
    ``sequence_parallel`` each rank holds its own rows; the field is then 0 on
    every rank, which agree on ``sequence_parallel`` through the record).
    Computed on the target's device without synchronisation; ``device``: where
    the result goes (the agreement collective's device).
    """
    n = len(fields_of(fused))
    if target is None or not isinstance(target, torch.Tensor):
        return torch.zeros(n, dtype=torch.int64, device=device)
    prints = _target_prints(target)
    if fused:
        prints.append(_hidden_print(hidden) if isinstance(hidden, torch.Tensor)
                      else torch.zeros((), dtype=torch.int64, device=target.device))
    out = torch.stack(prints)
    # blocking: a non_blocking device-to-host copy could be read (torch.cat) before it lands; on NCCL the
    # prints stay on the device (no copy), and gloo with CUDA tensors already syncs for the record
    return out if device is None else out.to(device)


def _groups(values: Sequence[tuple]) -> str:
    """``ranks 0, 1 hold one value; ranks 2, 3 another`` (rank lists in order of first appearance)."""
    seen: dict = {}
    for r, v in enumerate(values):
        seen.setdefault(v, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}" for rs in seen.values()]
    return "; ".join(parts)


def check_fingerprints(prints: Sequence[Sequence[int]], *, fused: bool = False) -> None:
    """Raise the same ``ValueError`` on every rank when the ranks' fingerprints differ.

    ``prints``: the all-gathered fingerprints, one row per rank in rank order
    (identical on every rank, so the message is too). Call it after
    :func:`dualvp.validation.check_agreement` has passed: ranks that disagree
    on shapes or options are reported by that first.
    """
    rows = [tuple(int(v) for v in r) for r in prints]
    n_target = len(TARGET_FIELDS)
    by_target = [r[:n_target] for r in rows]
    if len(set(by_target)) > 1:
        raise ValueError(
            "target: differs across the process group's ranks (same shape, different ids: "
            f"{_groups(by_target)} hold different targets); the target holds the global ids of the same rows on "
            "every rank of the group. Is `group` the tensor-parallel group (the ranks that hold the vocab shards "
            "of the same rows), not the data-parallel one? Every rank of the group raises this error."
        )
    if fused:
        by_hidden = [r[n_target:] for r in rows]
        if len(set(by_hidden)) > 1:
            raise ValueError(
                "hidden: differs across the process group's ranks (same shape, different values: "
                f"{_groups(by_hidden)} hold different hidden states); without sequence_parallel the hidden "
                "states are replicated over the group. Is `group` the tensor-parallel group, and are the hidden "
                "states complete (all-reduced, not a row-parallel layer's partial sums)? Every rank of the group "
                "raises this error."
            )


def gather_checked(
    record: Sequence[int],
    bad_targets: Optional[torch.Tensor],
    group,
    device: torch.device,
    *,
    target: Optional[torch.Tensor],
    hidden: Optional[torch.Tensor] = None,
    fused: bool = False,
    rank: int,
    local_error: Optional[BaseException] = None,
    vocab_size: Optional[int] = None,
    fields: Sequence[str] = validation.RECORD_FIELDS,
) -> None:
    """The agreement step: one all-gather of record + fingerprints, one host sync, then the checks.

    The record (with ``bad_targets``, the 0-d device count of out-of-range
    targets, written into its last field on the device) is extended
    by :func:`fingerprint` of ``target`` (and, ``fused=True``, ``hidden``) in
    the same int64 tensor, so the collective count and the single ``.tolist()``
    are unchanged. Raises on every rank alike: the record's errors first
    (:func:`dualvp.validation.check_agreement`), then differing fingerprints
    (:func:`check_fingerprints`). ``target`` is ``None`` on a rank whose local
    checks failed.
    """
    rec = torch.tensor(list(record), dtype=torch.int64).to(device, non_blocking=True)
    if bad_targets is not None:
        rec[-1:].copy_(bad_targets.reshape(1).to(device=device, dtype=torch.int64))
    prints = fingerprint(target if local_error is None else None, hidden, fused=fused, device=device)
    table = collectives.all_gather_rows(torch.cat([rec, prints]), group).tolist()  # the one host sync
    n = len(record)
    validation.check_agreement([r[:n] for r in table], rank=rank, local_error=local_error, vocab_size=vocab_size,
                               fields=fields)
    check_fingerprints([r[n:] for r in table], fused=fused)


def raise_on_every_rank(error: BaseException, group, hint: Optional[torch.Tensor], *, fused: bool, rank: int) -> None:
    """Raise ``error`` (a local check's) here and, with a ``group``, on every rank of it alike.

    The error's record goes through the agreement all-gather that the other
    ranks' checks enter (:func:`gather_checked`), so none waits in a
    collective. ``hint``: a tensor on the op's device (the collective's
    device), or ``None``; ``rank``: this rank's index in ``group``.
    """
    if group is not None:
        record = validation.agreement_record(error=error, fused=fused)
        device = collectives.comm_device(group, hint if isinstance(hint, torch.Tensor) else None)
        fields = validation.LINEAR_RECORD_FIELDS if fused else validation.RECORD_FIELDS
        gather_checked(record, None, group, device, target=None, fused=fused, rank=rank, local_error=error,
                       fields=fields)
    raise error
