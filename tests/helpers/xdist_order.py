"""How the suite splits over pytest-xdist workers (`--dist loadfile`, pyproject.toml): a test module is the
unit a worker takes whole, so its module-scoped engines and models are built once per run. (A shared server
of the pool, tests/helpers/processes/server_pool.py, boots once per worker that runs one of its modules.)

Heavy modules go first, so that no long module starts last while the other worker idles."""
from __future__ import annotations

import pytest

from pagedserve.tests.helpers.processes.server_pool import _module_of

# The modules of 40 s or more: started first. Seconds, summed per module from one two-worker run's junit report
# (`pytest --junitxml=...`, 2026-12-02, on a VM running W1 at 164 tok/s where the last session's ran 283); those off
# by more than 15 s refreshed from the fresh-clone run of 0da51b2 (2026-12-04, an AVX2 VM).
HEAVY: dict[str, float] = {
    "tests/executor/procs/test_multiproc.py": 184, "tests/executor/procs/test_ray_executor.py": 182,
    "tests/executor/model/test_parity.py": 132, "tests/e2e/openai_api/test_tool_calling.py": 127,
    "tests/e2e/reliability/test_faults.py": 122, "tests/executor/procs/test_pipeline_parallel.py": 161,
    "tests/executor/procs/test_tp_scripts.py": 161, "tests/e2e/fleet/test_data_parallel.py": 144,
    "tests/executor/worker/spec_decode/test_spec_decode.py": 165, "tests/e2e/docs_and_tools/test_docs.py": 96,
    "tests/e2e/fleet/test_data_parallel_ray.py": 114, "tests/e2e/openai_api/test_structured_outputs_http.py": 83,
    "tests/e2e/docs_and_tools/test_bench_cli.py": 96, "tests/common/test_hub_models.py": 45,
    "tests/kernels/cpu/test_cpu_decode_step.py": 78, "tests/e2e/docs_and_tools/test_lm_eval.py": 60,
    "tests/e2e/reliability/test_load.py": 52, "tests/e2e/reliability/test_http_fuzz.py": 45,
    "tests/executor/worker/rl/test_weight_updates.py": 44, "tests/e2e/docs_and_tools/test_client_examples.py": 66,
    "tests/e2e/openai_api/test_server.py": 40,
    # added with images (issue 47), estimated from their runs beside the suite
    "tests/frontend/multimodal/test_multimodal_offline.py": 92, "tests/e2e/multimodal/test_multimodal_http.py": 45,
    # added with KV tiers, the fleet and traces (issues 48, 49, 51), from their runs beside other work
    "tests/executor/kv_connector/test_disk_tier_faults.py": 55, "tests/e2e/fleet/test_disagg_prefill.py": 45,
    "tests/e2e/fleet/test_router.py": 78, "tests/e2e/fleet/test_router_lora.py": 36, "tests/e2e/fleet/test_router_discovery.py": 80,
    "tests/frontend/tracing/test_tracing_http.py": 48,
    # issue 51's remainder, measured beside three other helpers' work (a server start is 43 s of it)
    "tests/e2e/anthropic_api/test_anthropic_tool_choice.py": 80,
    # added with issue 50's determinism tests, from their runs on the loaded VM (load average 10-14)
    "tests/determinism/test_invariance_property.py": 74, "tests/determinism/test_http_concurrency.py": 58,
    "tests/determinism/test_seeded_sampling.py": 140, "tests/determinism/test_tp_invariance.py": 38,
    "tests/determinism/test_batch_invariant_flag.py": 60,
    # issue 49's elastic scaling and prefix-vs-round-robin modules: 300 s and 250 s beside three other sessions'
    # tests (load 10 on the 2 cores, most of it their servers starting); estimated for a quiet run
    "tests/e2e/fleet/test_elastic_dp.py": 90, "tests/e2e/fleet/test_fleet_under_load.py": 101,
    "tests/e2e/openai_api/test_llama_index_client.py": 149, "tests/e2e/fleet/test_router_prefix_vs_roundrobin.py": 36,
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
