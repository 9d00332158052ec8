"""The docstring examples of the public torch functions, run as doctests (fast tier)."""

import doctest

import pytest

pytest.importorskip("torch")

from dualvp_torch import function, linear  # noqa: E402


@pytest.mark.parametrize("module", [function, linear], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, raise_on_error=False, verbose=False)
    assert result.attempted > 0, f"{module.__name__} has no docstring example"
    assert result.failed == 0, result
