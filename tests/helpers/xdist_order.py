"""How the suite splits over pytest-xdist workers (`--dist loadfile`, pyproject.toml): a test module is the
unit a worker takes whole, so its module-scoped engines and models are built once per run. (A shared server
of the pool, tests/helpers/server_pool.py, boots once per worker that runs one of its modules.)

Heavy modules go first, so that no long module starts last while the other worker idles."""
from __future__ import annotations

import pytest

from pagedserve.tests.helpers.server_pool import _module_of

# The modules of a minute or more: started first. Seconds, summed per module from one serial run's junit report
# (`pytest -p no:xdist --junitxml=...`, 2026-12-02).
HEAVY: dict[str, float] = {
    "tests/e2e/test_docs.py": 157, "tests/e2e/test_tool_calling.py": 147,
    "tests/core/structured_output/test_structured_outputs.py": 99, "tests/executor/test_beam_search.py": 93,
    "tests/executor/procs/test_multiproc.py": 89, "tests/e2e/test_data_parallel.py": 83,
    "tests/e2e/reliability/test_faults.py": 76, "tests/executor/model/test_parity.py": 72,
    "tests/e2e/test_structured_outputs_http.py": 66, "tests/e2e/test_data_parallel_ray.py": 63,
    "tests/executor/procs/test_tp_scripts.py": 63, "tests/executor/procs/test_pipeline_parallel.py": 61,
    "tests/e2e/test_server.py": 60, "tests/executor/procs/test_ray_executor.py": 57, "tests/e2e/test_bench_cli.py": 54,
}


class HeavyFirst:
    """Orders the modules so the heaviest start first (each keeps its own order of tests), before the server
    pool's grouping (tests/conftest.py) moves the modules sharing a pooled server next to each other."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        first: dict[str, int] = {}
        for i, item in enumerate(items):
            first.setdefault(_module_of(item), i)
        items.sort(key=lambda item: (-HEAVY.get(_module_of(item), 0.0), first[_module_of(item)]))
