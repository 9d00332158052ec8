"""``dualvp verify --op kl``: the report and its exit status."""

import pytest

from dualvp.tools.cli import main

from ..cross._cli import jax_in_process


def test_verify_kl_spec_only(capsys):
    # the spec over 4 simulated shards vs the oracle, in process (no backend processes)
    assert main(["verify", "--op", "kl", "--backends", "", "--tp", "4", "--tokens", "16", "--vocab", "64",
                 "--direction", "reverse", "--temperature", "0.7"]) == 0
    out = capsys.readouterr().out
    assert "spec vs oracle     d_ref" in out and out.strip().endswith("PASS")


def test_verify_kl_bad_vocab(capsys):
    assert main(["verify", "--op", "kl", "--backends", "", "--tp", "3", "--vocab", "64"]) == 2


@pytest.mark.slow
def test_verify_kl_torch_and_jax(capsys, monkeypatch):
    # The report of both backends. The eager engine on the ranks (the compiled one at W = 2:
    # tests/torch/test_kl.py::test_compiled_matches_oracle_w2; in bfloat16, at W = 1, its
    # test_compiled_matches_oracle_w1_all_cases) and JAX in this process (a JAX child as a process:
    # tests/cross/test_verify_input.py, tests/cross/test_checks_can_fail.py).
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    jax_in_process(monkeypatch)
    assert main(["verify", "--op", "kl", "--tp", "2", "--tokens", "32", "--vocab", "256", "--dtype", "bfloat16",
                 "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "torch vs jax       d_logits" in out and out.strip().endswith("PASS")
