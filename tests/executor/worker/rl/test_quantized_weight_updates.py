"""Weight updates of quantized models (issue 30): GGUF, AWQ, GPTQ and int8 at load. An update takes the tensors
the checkpoint holds and goes through the loader's own decoding and packing, so an engine updated to another
checkpoint answers exactly as a fresh engine on that checkpoint, token for token; batch-1 decode steps run
through the C decode step, which must see the new weights. Bad updates change nothing."""
from __future__ import annotations

import glob

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.executor.model.quant.gguf_blocks import GGUFBlocks, gguf_nbytes
from pagedserve.frontend.offline.llm import LLM
from pagedserve.tests.helpers.kernels.cpu_kernels import c_step_runs
from pagedserve.tests.helpers.models.gguf_models import gguf_update, write_tiny_gguf
from pagedserve.tests.helpers.models.quant_checkpoints import write_quantized_checkpoint
from pagedserve.tests.helpers.rl.weight_push import Trainer
from pagedserve.tests.helpers.rl.weight_update_cases import PROMPTS, greedy


def fresh(path: str, **kwargs) -> list[list[int]]:
    with LLM(path, **kwargs) as llm:
        return greedy(llm) + greedy(llm, PROMPTS[:1])


def checkpoint_tensors(folder: str) -> list[tuple[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(f"{folder}/*.safetensors")):
        tensors.update(load_file(path))
    return sorted(tensors.items())


def runner(llm: LLM):
    return llm.engine.executor.worker.runner


def test_gguf_reload_and_push_equal_a_fresh_engine(update_checkpoints, tmp_path) -> None:
    a, b = update_checkpoints
    # b stores its down projections in Q8_0 where a has Q4_0 (int4 -> int8 kernel form) and its v in Q4_1
    # (asymmetric int4: scales and zeros): those layers get new tensors, the others are overwritten in place.
    file_a = write_tiny_gguf(a, str(tmp_path / "a.gguf"), {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"})
    file_b = write_tiny_gguf(b, str(tmp_path / "b.gguf"), {"token_embd.weight": "Q8_0", "output.weight": "Q8_0",
                                                           "ffn_down.weight": "Q8_0", "attn_v.weight": "Q4_1"})
    want_b = fresh(file_b, tokenizer=b)
    with LLM(file_a, tokenizer=a) as llm:
        assert (runner(llm).decode_step is not None) == c_step_runs()   # decode steps take the C step, where it runs
        before = greedy(llm) + greedy(llm, PROMPTS[:1])
        o_proj = runner(llm).model.model.layers[0].self_attn.o_proj.packed
        llm.reload_weights(weights_path=file_b)
        assert greedy(llm) + greedy(llm, PROMPTS[:1]) == want_b != before
        assert runner(llm).model.model.layers[0].self_attn.o_proj.packed is o_proj      # same form: in place
        with Trainer(llm) as trainer:
            assert trainer.push(gguf_update(file_a)) == [21]     # GGUF names, blocks with their ggml type
            assert greedy(llm) + greedy(llm, PROMPTS[:1]) == before
            size = gguf_nbytes("Q8_0", (64, 160))                  # a consistent tensor, 32 columns too wide
            wide = [(n, GGUFBlocks("Q8_0", (64, 160), torch.cat((t.data, t.data))[:size])
                     if n == "blk.1.ffn_down.weight" else t) for n, t in gguf_update(file_b)]
            with pytest.raises(ValueError, match=r"\(64, 160\) does not match the model's \(64, 128\).*blk\.1\.ffn_down"):
                trainer.push(wide)
            assert greedy(llm) + greedy(llm, PROMPTS[:1]) == before
            unknown = [("model.layers.0.mlp.down_proj.weight", t) for n, t in gguf_update(file_b)
                       if n == "blk.0.ffn_down.weight"]
            with pytest.raises(ValueError, match="not a GGUF tensor name"):
                trainer.push(unknown)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_gptq_update_from_another_checkpoints_tensors(update_checkpoints, tmp_path, method) -> None:
    folders = []
    for float_dir, name in zip(update_checkpoints, "ab"):
        folders.append(str(tmp_path / name))
        write_quantized_checkpoint(float_dir, folders[-1], str(tmp_path / f"{name}_dequant"), method, group_size=32)
    want_b = fresh(folders[1])
    with LLM(folders[0]) as llm:
        assert (runner(llm).decode_step is not None) == c_step_runs()
        before = greedy(llm) + greedy(llm, PROMPTS[:1])
        with Trainer(llm) as trainer:
            tensors_b = checkpoint_tensors(folders[1])                  # qweight, qzeros, scales (g_idx), ...
            assert trainer.push(tensors_b) == [len(tensors_b)]
            after = greedy(llm) + greedy(llm, PROMPTS[:1])
            assert after == want_b != before
            bad = [(n, torch.cat((t, t[:1]), 0) if n == "model.layers.1.mlp.down_proj.qweight" else t)
                   for n, t in checkpoint_tensors(folders[0])]
            with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj"):
                trainer.push(bad)
            q_only = [(n, t) for n, t in checkpoint_tensors(folders[0]) if ".layers.0.self_attn.q_proj." in n]
            with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.qkv_proj.*carry them together"):
                trainer.push(q_only)
            assert greedy(llm) + greedy(llm, PROMPTS[:1]) == after           # all or nothing
        llm.reload_weights()
        assert greedy(llm) + greedy(llm, PROMPTS[:1]) == before


def test_int8_at_load_sleeps_and_is_updated_with_float_tensors(update_checkpoints) -> None:
    a, b = update_checkpoints
    want_b = fresh(b, quantization="int8")
    with LLM(a, quantization="int8", enable_sleep_mode=True) as llm:
        assert (runner(llm).decode_step is not None) == c_step_runs()
        before = greedy(llm) + greedy(llm, PROMPTS[:1])
        # Level 2 releases the packed weights too; they come back at new addresses, which the C step reads.
        qkv = runner(llm).model.model.layers[0].self_attn.qkv_proj.packed.q
        llm.sleep(level=2)
        assert qkv.untyped_storage().nbytes() == 0
        llm.wake_up()
        llm.reload_weights()
        assert greedy(llm) + greedy(llm, PROMPTS[:1]) == before
        with Trainer(llm) as trainer:
            tensors_b = checkpoint_tensors(b)                             # float32, quantized on arrival
            assert trainer.push(tensors_b) == [len(tensors_b)]
            assert greedy(llm) + greedy(llm, PROMPTS[:1]) == want_b != before
            wide = [(n, torch.cat((t, t[:, :8]), 1)) for n, t in tensors_b if n == "model.layers.1.mlp.down_proj.weight"]
            with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*\(64, 136\)"):
                trainer.push(wide)
            assert greedy(llm) + greedy(llm, PROMPTS[:1]) == want_b


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with fp8 (compute capability 8.9+)")
def test_cuda_fp8_and_gguf_updates_under_cuda_graphs(update_checkpoints, tmp_path) -> None:
    """On the GPU the decode steps replay CUDA graphs: an update copied in place (fp8 at load, float pushes)
    and one that changes a GGUF layer's form (graphs captured again) both answer as a fresh engine."""
    a, b = update_checkpoints
    want_b = fresh(b, quantization="fp8", device="cuda")
    with LLM(a, quantization="fp8", device="cuda") as llm:
        assert runner(llm).graphs is not None
        with Trainer(llm) as trainer:
            trainer.push(checkpoint_tensors(b))
            assert greedy(llm) + greedy(llm, PROMPTS[:1]) == want_b
    file_a = write_tiny_gguf(a, str(tmp_path / "a.gguf"), {})
    file_b = write_tiny_gguf(b, str(tmp_path / "b.gguf"), {"ffn_down.weight": "F32"})    # dense, not int8
    want_b = fresh(file_b, tokenizer=b, device="cuda")
    with LLM(file_a, tokenizer=a, device="cuda") as llm:
        assert runner(llm).graphs is not None
        llm.reload_weights(weights_path=file_b)
        assert greedy(llm) + greedy(llm, PROMPTS[:1]) == want_b
