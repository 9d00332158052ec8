"""Multi-controller JAX (``jax.distributed``): the processes a call spans, and their agreement.

With several JAX processes every process runs the same Python program on its
own part of each global array. A host-side check whose outcome depends on one
process's data (a target id out of range in its rows, a temperature it alone
passes) must therefore end the same way on every process: a process that
raises alone leaves the others waiting in the op's collective, for ever once
the communicator is warm. This module gives the global-array functions of
:mod:`dualvp_jax` (with ``validate=True``) that guarantee:

- :func:`processes_of`: the JAX processes whose devices a mesh or arrays
  touch; one process (the single-controller case) means no agreement at all.
- :func:`count_bad_targets`: out-of-range target ids counted over this
  process's *addressable* shards only (a global array spanning other
  processes cannot be read back to one host).
- :func:`agree`: every process of a set publishes a small JSON record (the
  options, global shapes and dtypes of the call; its own validation error or
  out-of-range count, if any) and reads the others'; then every process
  raises the same error or none does.

The exchange uses the key-value store of JAX's distributed runtime (the
coordinator started by ``jax.distributed.initialize``): host-only RPCs, no
XLA program, no device work, usable while ``jax.jit`` traces, and bounded by
a timeout. Per agreement each process makes about six small RPCs to the
coordinator (set its record, its digest and any failure, one increment, one
blocking get, one directory read; 5 ms per agreement over localhost on a
loaded 2-core VM);
records that agree are stored once (keyed by their digest), so the
coordinator's work grows with the number of processes, not its square. A
process that never reaches the agreement (it raised earlier, or took another
branch) makes the others raise ``RuntimeError`` after
:func:`timeout_s` seconds instead of hanging. Where the runtime has no such
client (``jax.process_count() > 1`` without ``jax.distributed.initialize``)
the records go through one small all-gather over every device instead (as
``jax.experimental.multihost_utils.process_allgather`` does; no timeout).

Eager calls agree on every call; under ``jax.jit`` the wrappers run (and
agree) once per trace, as every other argument check does. That relies on the
processes tracing in step, as multi-controller JAX requires anyway: a process
whose jit cache already holds a program that another process must trace
anew skips the agreement, and the other raises after the timeout.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from typing import Optional

import numpy as np

import jax

__all__ = ["processes_of", "count_bad_targets", "agree", "checked", "check_flag", "describe_arrays", "timeout_s",
           "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S"]

#: Environment variable: seconds a process waits for the others at an agreement.
TIMEOUT_ENV = "DUALVP_JAX_AGREEMENT_TIMEOUT"
#: Default of :data:`TIMEOUT_ENV`. Generous: processes trace a large train step
#: at different speeds, and a false timeout would stop a correct job.
DEFAULT_TIMEOUT_S = 120.0

_PREFIX = "dualvp/agree"
_SEQ: dict = {}  # process set -> number of agreements this process has entered for it


def timeout_s() -> float:
    """Seconds to wait for the other processes at an agreement (:data:`TIMEOUT_ENV`)."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}: expected a number of seconds > 0, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}: expected a number of seconds > 0, got {raw!r}")
    return value


def _is_concrete_array(x) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def processes_of(*arrays, mesh=None) -> tuple:
    """Sorted indices of the JAX processes owning devices of ``mesh`` or of the concrete arrays.

    ``(jax.process_index(),)`` when nothing spans another process (always so
    with one process). Traced values carry no devices and count for nothing.
    """
    me = jax.process_index()
    if jax.process_count() == 1:
        return (me,)
    procs = set()
    if mesh is not None:
        procs.update(int(d.process_index) for d in np.asarray(mesh.devices).flat)
    for a in arrays:
        if _is_concrete_array(a):
            procs.update(int(d.process_index) for d in a.sharding.device_set)
    return tuple(sorted(procs)) if procs else (me,)


def _local_parts(target):
    """NumPy copies of this process's part of ``target``, each distinct shard once."""
    if not _is_concrete_array(target) or target.is_fully_addressable or target.is_fully_replicated:
        # the whole array is readable here (NumPy input, a process-local array, or a full replica)
        return [np.asarray(target)]
    parts, seen = [], set()
    for shard in target.addressable_shards:
        key = tuple((s.start, s.stop, s.step) for s in shard.index)
        if key not in seen:
            seen.add(key)
            parts.append(np.asarray(shard.data))
    return parts


def count_bad_targets(target, vocab_size: int, ignore_index: int) -> tuple:
    """``(count, up to 5 distinct bad ids)`` of ids outside ``[0, vocab_size)`` and not ``ignore_index``.

    Reads only what this process can address (one host synchronisation, O(its
    rows) bytes): a global array sharded over processes is never fetched whole.
    """
    count, shown = 0, set()
    for t in _local_parts(target):
        if t.size == 0:
            continue
        t = t.astype(np.int64, copy=False) if t.dtype != np.uint64 else t
        bad = (t != ignore_index) & ((t < 0) | (t >= vocab_size))
        n = int(np.count_nonzero(bad))
        if n:
            count += n
            shown.update(int(v) for v in np.unique(t[bad])[:5])
    return count, sorted(shown)[:5]


def _client():
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - a JAX without the module
        return None
    return getattr(distributed.global_state, "client", None)


def _exchange_kv(client, procs: tuple, me: int, record: str, digest: str, failure: Optional[str],
                 label: str) -> tuple:
    """The records of every process in ``procs`` through the coordinator's key-value store.

    Returns ``(records by digest, failures by process, digests by process or
    None)``; the last is read only when something differs or failed.
    """
    group = format(zlib.crc32(",".join(map(str, procs)).encode()), "08x")
    n = _SEQ.get(procs, 0)
    _SEQ[procs] = n + 1
    base = f"{_PREFIX}/{group}/{n}"
    client.key_value_set(f"{base}/rec/{digest}", record, allow_overwrite=True)
    client.key_value_set(f"{base}/who/{me}", digest)
    if failure is not None:
        client.key_value_set(f"{base}/bad/{me}", failure)
    if client.key_value_increment(f"{base}/arrived", 1) == len(procs):
        # Last to arrive: every process has published agreement n, so every
        # process has finished reading agreement n - 1; its keys can go.
        client.key_value_set(f"{base}/done", "1")
        if n:
            client.key_value_delete(f"{_PREFIX}/{group}/{n - 1}")
    wait = timeout_s()
    try:
        client.blocking_key_value_get(f"{base}/done", int(wait * 1000))
    except Exception as e:  # noqa: BLE001 - the runtime's DEADLINE_EXCEEDED (JaxRuntimeError)
        raise RuntimeError(
            f"dualvp: {label}: not every process of {list(procs)} reached the argument agreement within "
            f"{wait:g} s ({TIMEOUT_ENV}); a process raised before the call or took another branch, and this "
            f"process raises instead of entering the collective ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    records = dict((k.rsplit("/", 1)[1], v) for k, v in client.key_value_dir_get(f"{base}/rec/"))
    failures = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(f"{base}/bad/")}
    who = None
    if len(records) > 1 or failures:
        who = {int(k.rsplit("/", 1)[1]): v for k, v in client.key_value_dir_get(f"{base}/who/")}
    return records, failures, who


_ALLGATHER_BYTES = 4096


def _identity(x):
    return x


def _exchange_allgather(procs: tuple, record: str, digest: str, failure: Optional[str]) -> tuple:
    """The records of every process through one all-gather over every device (no coordinator client)."""
    if procs != tuple(range(jax.process_count())):
        raise RuntimeError(
            f"dualvp: an argument agreement among processes {list(procs)} (not all {jax.process_count()}) needs "
            "the jax.distributed client; call jax.distributed.initialize(), or pass validate=False"
        )
    blob = json.dumps([record, digest, failure]).encode()
    if len(blob) > _ALLGATHER_BYTES:
        blob = json.dumps([json.dumps({"record": "too long"}), digest, failure]).encode()[:_ALLGATHER_BYTES]
    buf = np.zeros(_ALLGATHER_BYTES + 4, np.uint8)
    buf[:4] = np.frombuffer(np.uint32(len(blob)).tobytes(), np.uint8)
    buf[4:4 + len(blob)] = np.frombuffer(blob, np.uint8)
    # One row per process, replicated over its devices, gathered by a jitted identity onto every
    # device (multihost_utils.process_allgather does the same, but under jax.set_mesh, which an
    # outer jit's trace refuses). ensure_compile_time_eval: it runs now, also while jit traces.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count()), ("p", "d"))
    with jax.ensure_compile_time_eval():
        rows = jax.make_array_from_single_device_arrays(
            (jax.process_count(), buf.size), NamedSharding(mesh, PartitionSpec("p")),
            [jax.device_put(buf[None], d) for d in jax.local_devices()])
        table = np.asarray(jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))(rows)
                           .addressable_data(0))
    records, failures, who = {}, {}, {}
    for p, row in enumerate(table):
        size = int(np.frombuffer(row[:4].tobytes(), np.uint32)[0])
        rec, dig, fail = json.loads(row[4:4 + size].tobytes().decode())
        records[dig] = rec
        who[p] = dig
        if fail is not None:
            failures[p] = fail
    return records, failures, who


def _flatten(record: dict, prefix: str = "") -> dict:
    """Nested dicts as one level of dotted keys, so that a disagreement names the leaf (``options.temperature``)."""
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _render(values: dict) -> str:
    items = [f"process {p}: {v}" for p, v in sorted(values.items())]
    return ", ".join(items[:8]) + (f", ... ({len(items)} processes)" if len(items) > 8 else "")


def agree(procs: tuple, label: str, common: Optional[dict], *, local_error: Optional[BaseException] = None,
          bad_targets: Optional[tuple] = None) -> None:
    """Raise the same error on every process of ``procs`` unless all agree and passed; a collective.

    Every process of ``procs`` must call it, in the same order as its other
    agreements over ``procs``. Args:

      label: the public function (in messages, and part of the record).
      common: what must be equal on every process (JSON-able: options,
        global shapes, dtypes); ``None`` when ``local_error`` is set.
      local_error: this process's own validation error, if any.
      bad_targets: ``(count, examples, vocab_size, ignore_index)`` of this
        process's out-of-range target ids, if any.

    Raises, on every process alike: this process's own error when every
    process failed validation (each then raises its own, equally named
    error); ``RuntimeError`` naming the processes when some failed and others
    did not, or when the records differ (naming the first field that
    differs); ``ValueError`` naming ``target`` and each process's
    out-of-range ids; ``RuntimeError`` after :func:`timeout_s` seconds when a
    process of ``procs`` never arrives (key-value path).
    """
    me = jax.process_index()
    record = json.dumps(_flatten({"function": label, **(common or {})}), sort_keys=True, default=str)
    digest = hashlib.sha1(record.encode()).hexdigest()[:16]
    failure = None
    if local_error is not None:
        failure = json.dumps({"error": f"{type(local_error).__name__}: {local_error}"[:300]})
    elif bad_targets is not None and bad_targets[0]:
        count, examples, vocab, ignore = bad_targets
        failure = json.dumps({"count": count, "examples": examples, "vocab_size": vocab, "ignore_index": ignore})
    client = _client()
    if client is not None:
        records, failures, who = _exchange_kv(client, procs, me, record, digest, failure, label)
    else:
        records, failures, who = _exchange_allgather(procs, record, digest, failure)
    failures = {p: json.loads(v) for p, v in failures.items()}

    errors = {p: f["error"] for p, f in failures.items() if "error" in f}
    if errors:
        if local_error is not None and len(errors) == len(procs):
            raise local_error
        raise RuntimeError(
            f"dualvp: {label}: argument validation failed on {_render(errors)} while the other processes of "
            f"{list(procs)} passed; every process raises instead of entering the collective"
        ) from local_error
    if len(records) > 1:
        parsed = {d: json.loads(r) for d, r in records.items()}
        fields = sorted(set().union(*parsed.values()))
        for field in fields:
            by_process = {p: json.dumps(parsed[d].get(field)) for p, d in who.items() if d in parsed}
            if len(set(by_process.values())) > 1:
                raise RuntimeError(
                    f"dualvp: {label}: processes disagree on {field} ({_render(by_process)}); every process raises"
                )
        raise RuntimeError(f"dualvp: {label}: the processes' argument records differ; every process raises")
    bad = {p: f for p, f in failures.items() if "count" in f}
    if bad:
        f0 = next(iter(bad.values()))
        shown = {p: f"{f['count']} id(s), e.g. {f['examples']}" for p, f in bad.items()}
        raise ValueError(
            f"target: expected ids in [0, {f0['vocab_size']}) or ignore_index={f0['ignore_index']}, got "
            f"out-of-range ids ({_render(shown)}); every process raises"
        )


def check_flag(validate) -> None:
    """``validate`` must be a bool (``TypeError`` naming it)."""
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__} {validate!r}")


def describe_arrays(**arrays) -> dict:
    """``{name: [shape, dtype name] or None}``: the global shapes and dtypes of a call, for a record."""
    out = {}
    for name, a in arrays.items():
        if a is None:
            out[name] = None
        else:
            shape = a.shape if isinstance(a, jax.core.Tracer) else np.shape(a)
            dtype = getattr(a, "dtype", None)
            out[name] = [[int(d) for d in shape], np.dtype(dtype).name if dtype is not None else type(a).__name__]
    return out


def checked(procs: tuple, label: str, checks, target, ignore_index, record):
    """Run the local ``checks()``, then :func:`agree` over ``procs``; returns what the checks returned.

    ``checks()`` returns ``(result, vocab_size)`` or raises ``TypeError`` /
    ``ValueError``; ``record(result)`` is the JSON-able dict that must agree.
    A concrete ``target`` is range-checked over this process's addressable
    shards and the counts go into the agreement; a traced one is not (its bad
    rows come out NaN on every process).
    """
    try:
        result, vocab = checks()
    except (TypeError, ValueError) as e:
        agree(procs, label, None, local_error=e)
        raise  # agree raised on every process already; kept for the type checker
    bad = None
    if target is not None and not isinstance(target, jax.core.Tracer):
        count, shown = count_bad_targets(target, vocab, ignore_index)
        bad = (count, shown, vocab, ignore_index)
    agree(procs, label, record(result), bad_targets=bad)
    return result
