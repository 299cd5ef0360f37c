"""Random PEFT LoRA adapters for the tiny test models, made and applied by PEFT itself (the parity oracle)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEAR = ATTENTION + ("gate_proj", "up_proj", "down_proj")


def make_lora(path: str, base_dir: str, r: int = 8, alpha: int = 16, targets: Sequence[str] = ATTENTION,
              seed: int = 0, use_rslora: bool = False) -> str:
    """An adapter with random A and random non-zero B (init_lora_weights=False), saved as PEFT saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora)
    get_peft_model(base, config).save_pretrained(path, safe_serialization=True)
    return path


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """HF transformers greedy tokens with the adapter applied by PEFT (None: the base model)."""
    from transformers import AutoModelForCausalLM

    from pagedserve.tests.helpers.models.tiny_models import hf_greedy
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    return hf_greedy(model.eval(), prompts, max_new)
