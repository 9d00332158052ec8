"""Shard-local stages of the op: statistics (forward) and the gradient (backward).

The math is :mod:`dualvp.spec` (``shard_stats`` and ``grad_logits``), rewritten
here in plain torch so that ``torch.compile`` turns each stage into fused
single-pass kernels (C++/OpenMP on CPU, Triton on GPU) with no ``[T, V_local]``
intermediate:

* :func:`stats_impl` reads the shard once per reduction and returns the
  ``[T, 6]`` statistics (``m, s, t, mk, sk, zy``);
* :func:`grad_impl` reads the shard and writes the gradient, in the input
  dtype, computed in float32 (float64 for float64 input).

The tests hold both against the spec functions (``tests/torch/test_kernels.py``).

Compilation
-----------
Both stages are compiled lazily, on first use, once per process, with
``torch.compile(dynamic=True)``: one graph per (input dtype, mask present)
pair, reused for every ``T`` and ``V_local`` (``T == 1`` is a separate
specialisation). The temperature is passed as a 0-d tensor so that changing it
never recompiles. If compilation fails, a warning is issued once and the eager
path is used from then on.

The environment variable ``DUALVP_COMPILE`` is read **at each call**:
``DUALVP_COMPILE=0`` forces the eager path (useful without a C++ compiler, for
debugging, or to compare paths); anything else (or unset) compiles.

Eager path and its chunk bound
------------------------------
The eager path (``_stats_eager``, ``_grad_eager``; same math as the compiled
functions, held against the spec by the same tests) processes rows in chunks
of ``max(1, min(CHUNK_ELEMENTS // V_local, T * itemsize // CHUNK_DIVISOR))``
rows (``CHUNK_ELEMENTS = 2**20``, ``CHUNK_DIVISOR = 512``, ``itemsize`` of the
logits' dtype). Each chunk runs in-place passes over at most two compute-dtype
scratch buffers allocated once per call and reused for every chunk (the
backward writes into the output chunk directly when the dtypes allow); the
target logit is a ``gather`` on the O(T) index, ``0 * -inf`` is avoided by
clamping ``-inf`` shifted logits to ``-sqrt(finfo.max)`` after the
exponential, and the row sums accumulate in float64 on CPU like the compiled
path (``sum(dtype=float64)`` makes one transient float64 copy of a chunk).
Peak scratch is at most ``SCRATCH_BYTES = 16`` bytes per chunk element, i.e.
at most 16 MiB whatever ``T`` and at most ``16 / 512 = 1/32`` of the shard's
bytes in every dtype. The in-place gradient mode always uses these eager
chunks, writing each gradient chunk into ``z`` after its last read.
