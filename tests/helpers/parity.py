"""Our models against HF transformers (the oracle): the model config and HF model of a checkpoint folder,
greedy decoding through our model alone and through the engine, and logits on N gloo ranks."""
from __future__ import annotations

import torch

from pagedserve.common.config.engine_args import ModelConfig
from pagedserve.common.model.model_files import load_hf_config, resolve_model
from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, prefill_logits, random_prompts
from pagedserve.tests.helpers.processes.tp_ranks import gloo_rank

ENGINE_NEW_TOKENS = 24
ENGINE_CHUNK = 32           # max_num_batched_tokens of the engine check: prompts prefill in chunks


def model_config(path: str, dtype: str = "float32", max_model_len: int | None = None) -> ModelConfig:
    source = resolve_model(path)
    hf_config = load_hf_config(source)
    return ModelConfig(source=source, hf_config=hf_config, dtype=dtype, device="cpu",
                       max_model_len=max_model_len or hf_config.max_position_embeddings, seed=0,
                       served_model_name=source.name, enforce_eager=False, batch_invariant=False, tokenizer=None,
                       default_sampling={},
                       generation_eos_token_ids=(), quantization=None, mm_config=None)


def hf_model(path: str) -> torch.nn.Module:
    """HF's float32 model with eager attention: Gemma 2's soft-capping exists only there, and one attention
    implementation for every family keeps the oracle the same code."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def our_model(path: str, max_model_len: int = 1024) -> torch.nn.Module:
    """Our model of a checkpoint folder, loaded whole (TP 1) through the real loader."""
    return load_model(model_config(path, max_model_len=max_model_len), TPGroup())


def hf_class_model(path: str, class_name: str) -> torch.nn.Module:
    """HF's float32 model of a folder through the named transformers class (the vision-language ones have no
    AutoModelForCausalLM entry that builds their towers)."""
    import transformers
    return getattr(transformers, class_name).from_pretrained(path, dtype=torch.float32).eval()


def saved_tensors(folder: str) -> dict[str, torch.Tensor]:
    """The tensors of a folder's model.safetensors, by the names the checkpoint stores."""
    import os

    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


@torch.inference_mode()
def our_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: tuple[int, ...]) -> list[int]:
    """Greedy continuation re-running a full prefill per step; stops at EOS like HF generate."""
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        token = int(prefill_logits(model, prompt + tokens)[-1].argmax())
        tokens.append(token)
        if token in eos:
            break
    return tokens


def shared_prefix(vocab: int, base_len: int, tails: list[int]) -> list[list[int]]:
    base = random_prompts(7, [base_len], vocab, low=3)[0]
    return [base + tail for tail in random_prompts(8, tails, vocab, low=3)]


def check_engine(path: str, hf: torch.nn.Module, prompts: list[list[int]], shared: list[list[int]],
                 **engine) -> None:
    """Greedy tokens equal HF generate under chunked prefill (32-token chunks), then with prefix-cache hits."""
    from pagedserve import LLM, SamplingParams
    greedy = SamplingParams(temperature=0.0, max_tokens=ENGINE_NEW_TOKENS)
    want, want_shared = hf_greedy(hf, prompts, ENGINE_NEW_TOKENS), hf_greedy(hf, shared, ENGINE_NEW_TOKENS)
    with LLM(path, dtype="float32", max_num_batched_tokens=ENGINE_CHUNK, **engine) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
        assert llm.generate(shared[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids == want_shared[0]
        hits = llm.engine.kv_cache_manager.prefix_stats.hits
        got = [o.outputs[0].token_ids for o in llm.generate(shared[1:], greedy, use_tqdm=False)]
        assert got == want_shared[1:]
        # >= 2 blocks each
        assert llm.engine.kv_cache_manager.prefix_stats.hits - hits >= (len(shared) - 1) * ENGINE_CHUNK


def tp_prefill_worker(rank: int, world: int, init_method: str, jobs: list[tuple[str, int | None, list[int]]],
                      out: str) -> None:
    """On one gloo rank: prefill logits of each (folder, max_model_len, prompt); rank 0 saves the list."""
    torch.set_num_threads(1)          # two ranks on two cores
    with gloo_rank(rank, world, init_method):
        results = [prefill_logits(load_model(model_config(path, max_model_len=max_len), TPGroup(rank, world)),
                                  prompt) for path, max_len, prompt in jobs]
        if rank == 0:
            torch.save(results, out)
