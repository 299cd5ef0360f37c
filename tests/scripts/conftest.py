"""What the bench-script tests share: scripts/ (not a package) put first on sys.path for one test."""
from __future__ import annotations

import pathlib

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture()
def scripts_on_path(monkeypatch) -> pathlib.Path:
    """scripts/ on sys.path for this test, so its modules import by name."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return SCRIPTS
