"""Where the cross-compile table travels from test_xcompile.py to the terminal summary (conftest.py)."""
import pytest

XCOMPILE_TABLE = pytest.StashKey[str]()
