"""The README's Quick start shows the command CI runs, and CI runs a fixed command (it does not read the README)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _test_command(text):
    lines = [ln.strip() for ln in text.splitlines() if re.match(r"\s*pip install .*python -m pytest", ln)]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    code = [ln for ln in ci.splitlines() if not ln.lstrip().startswith("#")]
    assert not any("README" in ln for ln in code), ".ci/run must not read the README"
    assert _test_command(ci) == _test_command((ROOT / "README.md").read_text())


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
