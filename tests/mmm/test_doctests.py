"""The Examples sections of the mmm core and hash map docstrings run as tests."""
import doctest
import importlib

import pytest

MODULES = ["mmm.manager", "mmm.structures.hashmap", "mmm.structures.keydict", "mmm.structures.combine",
           "mmm.schema",
           "mmm.pool", "mmm.snapshot"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    """Every doctest in the module passes."""
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
