"""``dualvp verify --op extended``: the extended conformance table, torch and JAX, the report and its status."""

import pytest

from dualvp.testing import extended as ext
from dualvp.tools import verify_ext
from dualvp.tools.cli import main

from ..cross._cli import jax_in_process


def test_cases_for_keeps_the_divisible_vocabularies():
    assert len(verify_ext.cases_for(2)) == len(ext.EXT_CASES)
    assert verify_ext.cases_for(7) == [c for c in ext.EXT_CASES if c.base.vocab % 7 == 0]


def test_verify_extended_missing_input_file(capsys, tmp_path):
    assert main(["verify", "--op", "extended", "--backends", "", "--input", str(tmp_path / "x.npz")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_verify_extended_no_case_for_the_world(capsys):
    assert main(["verify", "--op", "extended", "--backends", "", "--tp", "7"]) == 2


@pytest.mark.slow
def test_verify_extended_torch_and_jax(capsys, monkeypatch):
    # every EXT_CASES entry at W = 2: torch (eager engine) and JAX against the oracle and each other. JAX in
    # this process (its child as a process: tests/cross/test_verify_input.py::
    # test_k_targets_and_row_temperature_file_passes_at_tp2, through the same verify_ext._start_jax).
    pytest.importorskip("jax")
    jax_in_process(monkeypatch)
    assert main(["verify", "--op", "extended", "--tp", "2", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "all_everything         torch vs jax     sum_p2" in out and out.strip().endswith("(21 case(s))")
    assert "FAIL" not in out
