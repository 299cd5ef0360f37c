"""A tied embedding table from a 4-bit GGUF source stays int4 (executor/model/quant/packing.py): lookups widen
its rows from the pack (kernels/cpu/csrc/dequant.c) and the tied head streams the same pack at the file's 4.5 bits a
weight, half what the int8 table took. Through the real GGUF loader, against the same file dequantized at load:
the same table rows (up to the bfloat16 scales) and the same greedy tokens (the tiny model's peaky logits have
no near-ties)."""
from __future__ import annotations

import torch

from pagedserve import LLM
from pagedserve.kernels.weights import weight_only
from pagedserve.kernels.weights.weight_only import Int4Weight
from pagedserve.tests.helpers.models.gguf_models import write_tiny_gguf
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
from pagedserve.tests.helpers.rl.weight_update_cases import PROMPTS, greedy


def test_a_tied_q4_0_table_serves_lookups_and_the_head_as_int4(tmp_path) -> None:
    hf = make_tiny_model(str(tmp_path / "hf"), arch="llama", tie_word_embeddings=True)
    path = write_tiny_gguf(hf, str(tmp_path / "tied.gguf"), {"token_embd.weight": "Q4_0"})
    with LLM(path, tokenizer=hf, quantization="none", dtype="float32") as llm:
        table = llm.engine.executor.worker.runner.model.model.embed_tokens.weight.detach().clone()
        want = greedy(llm)
    with LLM(path, tokenizer=hf) as llm:
        model = llm.engine.executor.worker.runner.model
        embed = model.model.embed_tokens
        assert isinstance(embed.packed, Int4Weight) and model.lm_head.packed is embed.packed
        ids = torch.tensor(sorted({t for p in PROMPTS for t in p}))
        rows = embed(ids).float()
        assert (rows - table[ids]).abs().le(2.0 ** -8 * table[ids].abs().amax(-1, keepdim=True)).all()
        hidden = torch.randn(6, table.shape[1], generator=torch.Generator().manual_seed(0))
        logits, exact = model.lm_head.compute_logits(hidden), hidden.double() @ table.double().t()
        if weight_only._native().int4_gemv:      # float32 activations (the AVX-512 GEMV): the float model's tokens
            assert greedy(llm) == want
        else:      # torch's int4 kernel rounds activations to bfloat16 (and the scales are bfloat16): that far off
            assert ((logits.double() - exact).abs() <= 2.0 ** -7 * (hidden.double().abs() @ table.double().abs().t())).all()
