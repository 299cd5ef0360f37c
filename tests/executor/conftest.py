"""Fixtures shared by modules of tests/executor."""
from __future__ import annotations

import pytest

from pagedserve.tests.helpers.rl.weight_update_cases import checkpoint_pair


@pytest.fixture(scope="session")
def update_checkpoints(tmp_path_factory) -> tuple[str, str]:
    """(a, b) for the weight-update tests: one tiny model, two sets of weights; read-only."""
    return checkpoint_pair(str(tmp_path_factory.mktemp("weight_updates")))
