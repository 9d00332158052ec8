"""``dualvp verify --op kl``: the report and its exit status."""

import pytest

from dualvp.tools.cli import main


def test_verify_kl_spec_only(capsys):
    # the spec over 4 simulated shards vs the oracle, in process (no backend processes)
    assert main(["verify", "--op", "kl", "--backends", "", "--tp", "4", "--tokens", "16", "--vocab", "64",
                 "--direction", "reverse", "--temperature", "0.7"]) == 0
    out = capsys.readouterr().out
    assert "spec vs oracle     d_ref" in out and out.strip().endswith("PASS")


def test_verify_kl_bad_vocab(capsys):
    assert main(["verify", "--op", "kl", "--backends", "", "--tp", "3", "--vocab", "64"]) == 2


@pytest.mark.slow
def test_verify_kl_torch_and_jax(capsys):
    assert main(["verify", "--op", "kl", "--tp", "2", "--tokens", "32", "--vocab", "256", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "torch vs jax       d_logits" in out and out.strip().endswith("PASS")
