"""``dualvp_torch.tuning``: one frozen setting, checked fields, ``using`` blocks that nest and restore."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from dualvp_torch import engines, tuning  # noqa: E402


def test_frozen_with_the_documented_defaults():
    t = tuning.Tuning()
    assert t == tuning.DEFAULT and tuning.current() is tuning.DEFAULT
    assert t.float64_sums_devices == {"cpu", "cuda"} and t.static_vocab_devices == {"cuda"}
    assert t.full_stats_cpu_dtypes == {torch.bfloat16, torch.float16}
    assert t.glibc_heap is False  # the default path makes no allocator call of its own
    # G rounded once + the rank-1 residual terms at the target and p > 1/3 columns; the hi + lo split an option
    # (docs/decisions.md, "Fused G rounding: "fixed" at every column with p > 1/3, the default")
    assert t.gradient_rounding == "fixed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.glibc_heap = True
    assert tuning.Tuning(static_vocab_devices=["cpu"]).static_vocab_devices == frozenset({"cpu"})


@pytest.mark.parametrize("field,value,error", [
    ("float64_sums_devices", "cpu", TypeError),  # a string, not a set of device types
    ("static_vocab_devices", {1}, TypeError),
    ("full_stats_cpu_dtypes", {"bfloat16"}, TypeError),
    ("max_eager_workers", 0, ValueError),
    ("cpu_chunk_scratch_bytes", 1.5, ValueError),
    ("glibc_heap", 1, TypeError),
    ("gradient_rounding", True, ValueError),  # the former split_gradient bool: now one of three names
    ("gradient_rounding", "hi+lo", ValueError),
])
def test_bad_fields_name_the_field(field, value, error):
    with pytest.raises(error, match=f"^{field}: expected"):
        tuning.Tuning(**{field: value})


def test_using_nests_and_restores():
    outer, inner = tuning.Tuning(float64_sums_devices=()), tuning.Tuning(max_eager_workers=1)
    z = torch.zeros(2, 3)
    assert engines.accumulation_dtype(z) == torch.float64
    with tuning.using(outer):
        assert tuning.current() is outer and engines.accumulation_dtype(z) is None
        with pytest.raises(RuntimeError), tuning.using(inner):
            assert tuning.current() is inner
            raise RuntimeError
        assert tuning.current() is outer
    assert tuning.current() is tuning.DEFAULT and engines.accumulation_dtype(z) == torch.float64
    with pytest.raises(TypeError, match="^setting: expected"):
        with tuning.using({"glibc_heap": True}):
            pass
