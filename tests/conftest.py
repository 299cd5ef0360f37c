"""Shared fixtures: the embedded SmolLM2, tiny random models, and HF transformers as the oracle."""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve.common.model.model_files import embedded_model_path

# Two cores shared by the xdist workers (and the engine processes their tests start): each worker's own torch
# work (HF oracles, in-process engines) takes its share of the cores, so workers never oversubscribe them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, os.cpu_count() or 1) // _WORKERS)
torch.set_num_threads(_THREADS)
# The engine processes the tests start (servers, cores, workers, torchrun ranks) take the same share. With more
# threads than the cores left to them, every parallel region of a small model's step waits for a descheduled
# thread: a regex-constrained chat of 86 tokens on the tiny model took 12 s with two threads beside another busy
# process, 0.6 s with one. Multi-threaded kernels are tested with explicit thread counts (tests/kernels).
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    return embedded_model_path()


@pytest.fixture(scope="session")
def hf_smollm2_dir(smollm2_path, tmp_path_factory) -> str:
    """The embedded model as transformers dequantizes its GGUF (~20 s), saved once per run as a float32
    safetensors folder that every xdist worker then loads in a fraction of a second."""
    from filelock import FileLock
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base     # the run's, shared by its workers
    folder = root / "hf_smollm2"
    with FileLock(str(root / "hf_smollm2.lock")):
        if not (folder / "config.json").is_file():
            from safetensors.torch import save_model
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_path),
                                                         gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
            model.config.quantization_config = None       # float32 weights now: not a GGUF checkpoint
            partial = root / "hf_smollm2.partial"
            partial.mkdir(exist_ok=True)
            save_model(model, str(partial / "model.safetensors"))       # the tied embedding stored once
            model.config.save_pretrained(str(partial))
            partial.rename(folder)
    return str(folder)


@pytest.fixture(scope="session")
def hf_smollm2(hf_smollm2_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(hf_smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_llama")), arch="llama")


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_serving_model(tmp_path_factory) -> str:
    """Random Llama weights with the embedded tokenizer's full vocabulary, so text prompts and chat work."""
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_serving_model
    return make_tiny_serving_model(str(tmp_path_factory.mktemp("tiny_serving")))


# Module-scoped fixtures of engine-serve processes shared across modules (tests/helpers/processes/server_pool.py): the
# modules using one run together, and the last of them stops it.
SHARED_SERVERS = ("api_server", "chunked_prefill_server", "tool_server")
_LAST_USERS = pytest.StashKey[dict[str, str]]()


def pytest_configure(config):
    from pagedserve.tests.helpers.xdist_order import HeavyFirst
    config.pluginmanager.register(HeavyFirst(), "pagedserve-heavy-first")


@pytest.hookimpl(trylast=True)      # after -k / -m / --deselect chose the tests
def pytest_collection_modifyitems(config, items):
    from pagedserve.tests.helpers.processes.server_pool import group_modules, last_users
    group_modules(items, SHARED_SERVERS)
    config.stash[_LAST_USERS] = last_users(items, SHARED_SERVERS)


@pytest.fixture(scope="session")
def server_pool():
    """engine-serve processes shared by configuration across modules; two at most stay up."""
    from pagedserve.tests.helpers.processes.server_pool import ServerPool
    pool = ServerPool(max_alive=2)
    yield pool
    pool.close()


def _shared_server(request, pool, *extra: str, **options):
    server = pool.get(*extra, **options)
    yield server
    if request.config.stash.get(_LAST_USERS, {}).get(request.fixturename) == request.node.nodeid:
        pool.stop(*extra, **options)


@pytest.fixture(scope="module")
def api_server(request, server_pool, tiny_serving_model):
    """engine-serve with --api-key on the tiny serving model, one process for every module of HTTP-surface
    tests (auth, fuzzing, OpenAI fields, sampling constraints)."""
    from pagedserve.tests.helpers.processes.server import SMALL_KV
    yield from _shared_server(request, server_pool, *SMALL_KV, "--max-model-len", "256", "--max-num-seqs", "16",
                              model=tiny_serving_model)


@pytest.fixture(scope="module")
def tool_server(request, server_pool, tiny_serving_model):
    """engine-serve on the tiny serving model with the Hermes tool template, auto tool choice and its parser:
    one process for the APIs over chat that call tools (the Responses API, the Anthropic Messages API)."""
    from pagedserve.tests.helpers.processes.server import SMALL_KV, TOOL_FLAGS
    yield from _shared_server(request, server_pool, *SMALL_KV, *TOOL_FLAGS, model=tiny_serving_model,
                              max_model_len=512)


@pytest.fixture(scope="module")
def chunked_prefill_server(request, server_pool, tiny_serving_model):
    """engine-serve on the tiny serving model prefilling 8 tokens a step (prompts, and their prompt logprobs,
    in chunks), one process for the prompt-logprobs and lm-eval modules."""
    from pagedserve.tests.helpers.processes.server import SMALL_KV
    yield from _shared_server(request, server_pool, *SMALL_KV, "--max-num-batched-tokens", "8", "--max-num-seqs", "8",
                              model=tiny_serving_model, max_model_len=128)
