"""The fp8 tests' oracle (``_oracle.py``), loaded by path: tests are not a package."""

import importlib.util
import pathlib

import pytest

_spec = importlib.util.spec_from_file_location("fp8_oracle", pathlib.Path(__file__).with_name("_oracle.py"))
ORACLE = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ORACLE)


@pytest.fixture(scope="session")
def oracle():
    return ORACLE
