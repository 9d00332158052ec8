"""``dualvp verify --input``: a user's saved problem, read and checked (:func:`load_input`).

Shared by :mod:`dualvp.tools.verify` and :mod:`dualvp.tools.verify_ext` (K targets, a temperature per row).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from dualvp import validation

__all__ = ["load_input"]


_INPUT_KEYS = ("logits", "target", "keep_mask", "keep_ids", "temperature")
_TORCH_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16",
                 "torch.float64": "float64"}


def _read(path: str) -> dict:
    """The saved dict: ``.npz`` through NumPy, anything else through ``torch.load(weights_only=True)``."""
    if not os.path.isfile(path):
        raise ValueError(f"input: no such file {path!r}")
    if path.endswith(".npz"):
        try:
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        except Exception as exc:  # noqa: BLE001 - any reader failure is the file's fault
            raise ValueError(f"input: could not read {path!r} as a .npz file: {type(exc).__name__}: {exc}") from None
    try:
        import torch
    except ImportError:
        raise ValueError(f"input: {path!r} is not a .npz file and torch (needed to read torch.save files) "
                         "is not installed") from None
    try:
        # weights_only: tensors and plain containers only, no code from the file runs.
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        if "WeightsUnpickler error:" in msg:
            # keep torch's reason, not its advice to retry without weights_only
            msg = msg.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
        msg = " ".join(msg.split())[:300]
        raise ValueError(f"input: could not read {path!r} as a torch.save file of tensors "
                         f"(torch.load with weights_only=True): {type(exc).__name__}: {msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"input: expected a dict with keys {_INPUT_KEYS[:2]} (and optionally 'keep_mask'), "
                         f"got a {type(data).__name__}")
    return data


def _as_numpy(name: str, x):
    """``(array, dtype name)``; torch tensors are converted exactly (bfloat16 via float64)."""
    if type(x).__module__.startswith("torch"):
        import torch

        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(x).__name__}")
        dt = str(x.dtype)
        x = x.detach().cpu()
        if x.is_floating_point():
            return x.double().numpy(), _TORCH_DTYPES.get(dt, dt.replace("torch.", ""))
        return x.numpy(), dt.replace("torch.", "")
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name}: expected an array or tensor, got {type(x).__name__}")
    return x, x.dtype.name


def load_input(path: str, *, ignore_index: int = -100, max_rows: Optional[int] = None) -> dict:
    """Read and check a user's saved problem.

    The file is a ``torch.save`` of a dict (read with ``weights_only=True``)
    or an ``.npz``, with ``logits [..., V]`` (full vocabulary, float16 /
    bfloat16 / float32 / float64), ``target [...]`` (integer ids in ``[0, V)``
    or ``ignore_index``) or ``target [..., K]`` (K targets per row, TRL's
    ``selective_log_softmax`` index), and optionally ``keep_mask [..., V]``
    (bool) or ``keep_ids [..., K]`` (integer global ids in ``[0, V)``,
    padding -1: the kept set as the sampler returns it; not both), and
    ``temperature [...]`` (a float per row, finite and > 0; verl's per-token
    temperature). Leading dims are flattened into rows; ``max_rows`` keeps
    the first rows only.

    Returns:
      ``{"logits": [T, V] float64 (the saved values exactly), "target": [T]
      or [T, K] int64, "keep_mask": [T, V] bool or None, "keep_ids": [T, K]
      int64 or None, "temperature": [T] float64 or None, "dtype": the logits'
      dtype}``.

    Raises:
      ValueError whose message starts with ``input:`` (unreadable file, not a
      dict, missing key) or with the key at fault (shape, dtype, range).
    """
    data = _read(path)
    missing = [k for k in _INPUT_KEYS[:2] if k not in data]
    if missing:
        raise ValueError(f"input: {path!r} lacks the key(s) {missing}; expected 'logits' [T, V], 'target' [T] "
                         f"and optionally 'keep_mask' [T, V], got keys {sorted(map(str, data))}")
    z, zd = _as_numpy("logits", data["logits"])
    y, yd = _as_numpy("target", data["target"])
    if zd not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(f"logits: expected float16, bfloat16, float32 or float64, got {zd}")
    if z.ndim < 2:
        raise ValueError(f"logits: expected shape [T, V] (or [..., V]) with the full vocabulary last, "
                         f"got shape {z.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"target: expected an integer dtype, got {yd}")
    multi = y.ndim == z.ndim and y.shape[:-1] == z.shape[:-1] and y.shape[-1] >= 1
    if y.shape != z.shape[:-1] and not multi:
        raise ValueError(f"target: expected shape {z.shape[:-1]} (the leading dims of logits {z.shape}) or "
                         f"{z.shape[:-1] + ('K',)} (K >= 1 targets per row), got shape {y.shape}")
    keep = None
    if data.get("keep_mask") is not None:
        keep, kd = _as_numpy("keep_mask", data["keep_mask"])
        if kd != "bool":
            raise ValueError(f"keep_mask: expected dtype bool, got {kd}")
        if keep.shape != z.shape:
            raise ValueError(f"keep_mask: expected shape {z.shape} (the shape of logits), got shape {keep.shape}")
    ids = None
    if data.get("keep_ids") is not None:
        if keep is not None:
            raise ValueError("keep_ids: expected no keep_ids beside a keep_mask (two forms of one kept set), "
                             "got both")
        ids, idd = _as_numpy("keep_ids", data["keep_ids"])
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"keep_ids: expected an integer dtype, got {idd}")
        if ids.ndim != z.ndim or ids.shape[:-1] != z.shape[:-1]:
            raise ValueError(f"keep_ids: expected shape {z.shape[:-1] + ('K',)} (the leading dims of logits "
                             f"{z.shape} + (K,)), got shape {ids.shape}")
    tau = None
    if data.get("temperature") is not None:
        tau, td = _as_numpy("temperature", data["temperature"])
        if not np.issubdtype(tau.dtype, np.floating):
            raise ValueError(f"temperature: expected a float dtype, got {td}")
        if tau.shape != z.shape[:-1]:
            raise ValueError(f"temperature: expected shape {z.shape[:-1]} (one per row: the leading dims of "
                             f"logits {z.shape}), got shape {tau.shape}")
        tau = np.asarray(tau, np.float64).reshape(-1)
        bad_tau = ~(np.isfinite(tau) & (tau > 0))
        if bad_tau.any():
            raise ValueError(f"temperature: expected finite values > 0, got {int(bad_tau.sum())} bad value(s), "
                             f"e.g. {float(tau[bad_tau][0])!r}")
    v = z.shape[-1]
    z = np.asarray(z, np.float64).reshape(-1, v)
    y = np.asarray(y).astype(np.int64)
    y = y.reshape(-1, y.shape[-1]) if multi else y.reshape(-1)
    keep = None if keep is None else np.asarray(keep).reshape(-1, v)
    ids = None if ids is None else np.asarray(ids).astype(np.int64).reshape(y.shape[0], ids.shape[-1])
    if max_rows is not None:
        z, y = z[:max_rows], y[:max_rows]
        keep = None if keep is None else keep[:max_rows]
        ids = None if ids is None else ids[:max_rows]
        tau = None if tau is None else tau[:max_rows]
    if z.shape[0] == 0:
        raise ValueError(f"logits: expected at least one row, got shape {z.shape}")
    bad = (y != ignore_index) & ((y < 0) | (y >= v))
    if bad.any():
        raise ValueError(f"target: expected ids in [0, {v}) or ignore_index={ignore_index}, got "
                         f"{int(bad.sum())} out-of-range id(s), e.g. {np.unique(y[bad])[:5].tolist()}")
    if ids is not None:
        n, shown = validation.count_bad_ids(ids, v)
        if n:
            raise validation.bad_ids_error(n, shown, v)
    return dict(logits=z, target=y, keep_mask=keep, keep_ids=ids, temperature=tau, dtype=zd)
