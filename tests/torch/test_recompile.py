"""The compiled stages and recompiles: new shapes, views and coincident sizes, static widths, thread counts.

Training calls the op with a new row count at (almost) every step, on views of differently shaped bases.
Every such call must reuse the stage's one compiled graph: past dynamo's recompile limit the op would
fall back to the eager path (row chunks of scratch) for the rest of the process. Counted through
dynamo's unique-graph counter on fresh compile caches (``dualvp_torch.compiled._state``).
"""

import pytest

torch = pytest.importorskip("torch")

from dualvp_torch import compiled, engine_names, engines, logprob_entropy, tuning  # noqa: E402

from .test_logits_memory import _measure  # noqa: E402

pytestmark = pytest.mark.slow  # each test compiles its stages afresh


def test_new_shapes_do_not_recompile_into_the_eager_fallback():
    # Training calls the op with a new T at (almost) every step. The compiled
    # stages must take any (T, V_local) without a recompile per shape: past
    # dynamo's recompile limit (8) the op would switch to the eager path (row
    # chunks of scratch in the forward) for the rest of the process.
    g = torch.Generator().manual_seed(1)
    for t in range(3, 15):  # 12 shapes, more than the recompile limit
        x = torch.randn(t, 96 + t, generator=g).requires_grad_(True)
        lp, h = logprob_entropy(x, torch.randint(0, 96, (t,), generator=g), impl="compiled")
        (lp.sum() + h.sum()).backward()
    assert engines.select("compiled") == "compiled"  # no fallback
    B, fwd_sizes, sizes = _measure(torch.float32, "lp+ent+grad", impl="compiled")
    assert max(fwd_sizes, default=0) < 0.05 * B, [s for s in fwd_sizes if s > 0.01 * B]
    assert [s for s in sizes if s >= 0.5 * B] == [B]


def test_views_and_coincident_sizes_do_not_recompile(monkeypatch):
    # What a training loop passes: logits as views of differently shaped
    # bases (row slices, [B, S, V] batches reshaped), contiguous tensors, and
    # a first batch whose row count equals the statistics' column count (6).
    # Dynamo guarded views on their bases' layout, and duck sizing tied T to
    # the stride of a statistics column, or V_local to a slice's storage
    # offset: a recompile each (after 8, the eager fallback for good).
    # Allowed: one specialisation per stage when views at a storage offset
    # >= 2 follow offset-0 inputs (dynamo's 0/1 rule). (The merge is compiled
    # off the CPU only.) Masked: the stages' every argument of the unmasked
    # call (the logits views, the statistics' columns) and the mask's uint8
    # view besides; each fresh stage compile is ~1.4 s of tracing.
    monkeypatch.setattr(compiled, "_state", {})
    monkeypatch.setattr(engine_names, "_state", {"compile_failed": False})
    g = torch.Generator().manual_seed(3)
    V = 40

    def step(x):
        t = x.shape[0]
        keep = torch.rand(t, V, generator=g) < 0.7
        lp, h = logprob_entropy(x.requires_grad_(True), torch.randint(0, V, (t,), generator=g), keep_mask=keep,
                                impl="compiled")
        (lp.sum() + h.sum()).backward()

    offset0 = [torch.randn(6, V, generator=g), torch.randn(9, V, generator=g)[:5],
               torch.randn(2, 4, V, generator=g)[:, :-1].reshape(-1, V), torch.randn(3, 3, V, generator=g).view(-1, V)]
    offset_rows = [torch.randn(8, V, generator=g)[1:-1], torch.randn(2, 6, V, generator=g).view(-1, V)[3:],
                   torch.randn(20, V, generator=g)[2:15]]
    count = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    before = count()
    for x in offset0:
        step(x)
    assert count() - before == 2, f"{count() - before} graphs for the 2 stages (statistics, gradient)"
    # One row runs the stages' dynamic-T graphs as two rows (the row twice: compiled._run_one_row, for batch
    # invariance): at most one graph more, once (a two-row input may meet dynamo's 0/1 rule on a stride),
    # never one per one-row call.
    step(torch.randn(1, V, generator=g))
    one_row = count() - before - 2
    assert one_row <= 1, f"{one_row} graphs for a one-row call"
    step(torch.randn(1, V, generator=g))
    assert count() - before - 2 == one_row, "a second one-row call compiled again"
    for x in offset_rows + offset0 + offset_rows:
        step(x)
    assert count() - before <= 4 + one_row, f"{count() - before} graphs for the 2 stages"


def test_static_vocab_compiles_once_per_width_with_dynamic_rows(monkeypatch):
    # Tuning.static_vocab_devices (the GPU's default, off on the CPU), checked on the CPU: one graph
    # per stage for every row count (views and contiguous inputs alike), a new one per vocabulary
    # width, and the same numbers as the dynamic-shape kernels. The process's compile cache is kept: the
    # static variants have keys of their own (compiled afresh here, counted below), and the dynamic ones
    # compared against may already be compiled (test_logits_conformance.py's table).
    monkeypatch.setattr(engine_names, "_state", {"compile_failed": False})
    count = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731

    def step(t, v, static):
        gen = torch.Generator().manual_seed(t * 1000 + v)
        x = torch.randn(t + 3, v, generator=gen)[2:-1]  # a view one row into its base
        keep = torch.rand(t, v, generator=gen) < 0.7  # the mask's uint8 view is marked too
        z = x.clone().requires_grad_(True)
        with tuning.using(tuning.Tuning(static_vocab_devices={"cpu"} if static else ())):
            lp, h = logprob_entropy(z, torch.randint(0, v, (t,), generator=gen), keep_mask=keep, impl="compiled")
            (lp.sum() + h.sum()).backward()
        return lp, h, z.grad

    for t in (7, 9, 33):  # the dynamic-shape kernels first, for the comparison
        step(t, 40, False)
    before = count()
    for t in (7, 9, 33, 12):
        for a, b in zip(step(t, 40, True), step(t, 40, False)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert count() - before == 2, f"{count() - before} graphs for 2 stages at one width, rows 7-33"
    step(10, 56, True)
    assert count() - before == 4, f"{count() - before - 2} graphs for a second width (expected 2)"


def test_a_small_first_call_does_not_compile_serial_kernels(monkeypatch):
    # Inductor's C++ kernels decide at compile time, from the example sizes,
    # whether a loop is parallel; the dynamic-shape kernel then serves every
    # later shape. A first call at a tiny shape must not leave the stages
    # serial for the rest of the process (or, through the FX graph cache, for
    # later processes). A fresh compile (own cache, new code objects) of the
    # statistics at T=4, V_local=64; every stage takes the same options.
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

    monkeypatch.setattr(compiled, "_state", {})
    monkeypatch.setattr(engine_names, "_state", {"compile_failed": False})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g)
    y = torch.randint(0, 64, (4,), generator=g)
    with fresh_inductor_cache():
        _, codes = run_and_get_code(logprob_entropy, x, y, impl="compiled")
    kernels_src = [k for c in codes for k in c.split('extern "C"')[1:]]
    assert kernels_src, codes
    for k in kernels_src:
        assert "#pragma omp parallel" in k and "num_threads(1)" not in k, k[:2000]
