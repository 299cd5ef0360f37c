"""GPTQ act-order (desc_act) weights in our linear layers: decoded from real GPTQ tensors (the packer in
tests/helpers/models/quant_packers.py, a random column order per input), packed for the int4 kernel behind an
input gather, against dequantize-then-matmul in float32; and tensor parallelism, simulated rank by rank
(each rank's partial product, summed as the all-reduce would).

Tolerance (as test_quantized_linear.py argues): the int4 kernel keeps the codes exactly and rounds the
activations and per-group scale/zero to bfloat16, so |y - ref| <= 1e-2 * (|x| @ |W|^T). The int8 fallback
adds half an int8 step per weight: (max|w_row| / 254) * sum|x|.
"""
from __future__ import annotations

import pytest
import torch

from pagedserve.executor.model.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                     RowParallelLinear)
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.executor.model.quant.awq_gptq import gptq_to_group_quant
from pagedserve.executor.model.quant.group_quant import GroupQuantWeight
from pagedserve.executor.model.layers.linear_method import apply_linear
from pagedserve.executor.model.quant.packing import PermutedInput
from pagedserve.kernels.weights.weight_only import Int4Weight, Int8Weight
from pagedserve.tests.helpers.models.quant_packers import pack_gptq
from pagedserve.tests.helpers.processes.tp_ranks import gloo_rank, run_ranks

CPU = torch.device("cpu")
IN, G = 256, 32


def _act_order(out: int, seed: int, order_seed: int | None = 11, bits: int = 4, cols: int = IN,
               g: int = G) -> GroupQuantWeight:
    w = torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    t, _ = pack_gptq(w, bits, g, checkpoint_format="gptq_v2", act_order_seed=order_seed)
    return gptq_to_group_quant(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, g, "gptq_v2")


def _load(layer, pieces: list[tuple[GroupQuantWeight, int | str | None]]):
    layer.begin_packed_load()
    for weight, shard_id in pieces:
        layer.weight_loader(layer.weight, weight, shard_id)
    layer.finish_packed_load("gptq", CPU, torch.float32)
    return layer


def _bound(x: torch.Tensor, ref_w: torch.Tensor, int8: bool = False) -> torch.Tensor:
    bound = 1e-2 * (x.abs() @ ref_w.abs().T)
    if int8:
        bound = bound + (ref_w.abs().amax(1) / 254)[None, :] * x.abs().sum(1, keepdim=True)
    return bound + 1e-6


@pytest.mark.parametrize("batch", [1, 7])
def test_merged_act_order_layer_matches_dequantized_matmul(batch):
    gate, up = _act_order(48, seed=1), _act_order(48, seed=2)        # one input: one column order
    layer = _load(MergedColumnParallelLinear(IN, [48, 48], False, TPGroup()), [(up, 1), (gate, 0)])
    assert isinstance(layer.packed, PermutedInput) and isinstance(layer.packed.inner, Int4Weight)
    ref_w = torch.cat((gate.dequantize(), up.dequantize()))
    x = torch.randn(batch, IN)
    ref = x @ ref_w.T
    assert ((layer(x) - ref).abs() <= _bound(x, ref_w)).all()
    # The gather is what makes it right: the kernel on unpermuted x is far off.
    assert ((apply_linear(x, layer.packed.inner) - ref).abs() > _bound(x, ref_w)).any()


def test_act_order_pieces_in_different_orders_fall_back_to_int8():
    gate, up = _act_order(48, seed=1, order_seed=11), _act_order(48, seed=2, order_seed=12)
    layer = _load(MergedColumnParallelLinear(IN, [48, 48], False, TPGroup()), [(gate, 0), (up, 1)])
    assert isinstance(layer.packed, Int8Weight)
    ref_w = torch.cat((gate.dequantize(), up.dequantize()))
    x = torch.randn(3, IN)
    assert ((layer(x) - x @ ref_w.T).abs() <= _bound(x, ref_w, int8=True)).all()


def test_act_order_8_bit_takes_int8_in_checkpoint_order():
    w = _act_order(40, seed=3, bits=8)
    layer = _load(RowParallelLinear(IN, 40, False, TPGroup()), [(w, None)])
    assert isinstance(layer.packed, Int8Weight)
    x = torch.randn(2, IN)
    ref_w = w.dequantize()
    assert ((layer(x) - x @ ref_w.T).abs() <= _bound(x, ref_w, int8=True)).all()


def test_column_parallel_act_order_splits_rows():
    w = _act_order(64, seed=4)
    layer = _load(ColumnParallelLinear(IN, 64, False, TPGroup(rank=1, size=2)), [(w, None)])
    assert isinstance(layer.packed, PermutedInput)
    ref_w = w.dequantize()[32:]
    x = torch.randn(4, IN)
    assert ((layer(x) - x @ ref_w.T).abs() <= _bound(x, ref_w)).all()


@pytest.mark.parametrize("tp,cols,g", [(2, 256, 32), (4, 256, 32), (2, 512, 128), (4, 512, 128)])
def test_row_parallel_act_order_splits_exactly(tp, cols, g):
    """Each rank takes its own slice of checkpoint columns (a few of every group), regrouped into padded
    kernel groups; the ranks' partial products sum to the whole layer's."""
    w = _act_order(32, seed=5, cols=cols, g=g)
    ref_w = w.dequantize()
    x = torch.randn(3, cols)
    total = torch.zeros(3, 32)
    for rank in range(tp):
        layer = _load(RowParallelLinear(cols, 32, False, TPGroup(rank=rank, size=tp)), [(w, None)])
        assert isinstance(layer.packed, PermutedInput) and isinstance(layer.packed.inner, Int4Weight)
        assert layer.packed.inner.in_features % 128 == 0          # the CUDA kernel's K multiple
        part = slice(rank * cols // tp, (rank + 1) * cols // tp)
        local = layer.method.apply(layer, x[:, part], None)
        assert ((local - x[:, part] @ ref_w[:, part].T).abs() <= _bound(x[:, part], ref_w[:, part])).all()
        total += local
    assert ((total - x @ ref_w.T).abs() <= _bound(x, ref_w)).all()


def test_row_parallel_act_order_slice_dequantizes_to_its_columns():
    w = _act_order(16, seed=6)
    part = w.narrow(1, 64, 64)
    assert part.perm is not None and part.inputs == 64
    assert torch.equal(part.dequantize(), w.dequantize()[:, 64:128])
    with pytest.raises(ValueError, match="split once"):
        part.narrow(1, 0, 32)


def test_row_parallel_plain_g_idx_splits_by_group():
    # A desc_act checkpoint whose g_idx is the plain i // group_size has no order to keep.
    plain = _act_order(32, seed=5, order_seed=None)
    assert plain.perm is None
    layer = _load(RowParallelLinear(IN, 32, False, TPGroup(rank=1, size=2)), [(plain, None)])
    assert isinstance(layer.packed, Int4Weight)
    x = torch.randn(2, IN // 2)
    ref_w = plain.dequantize()[:, IN // 2:]
    assert ((layer.method.apply(layer, x, None) - x @ ref_w.T).abs() <= _bound(x, ref_w)).all()


# ------------------------------------------------------------------- two real ranks over gloo



def _act_order_config(path: str):
    from pagedserve.common.config.engine_args import ModelConfig
    from pagedserve.common.model.model_files import load_hf_config, resolve_model
    from pagedserve.common.quantization import checkpoint_quant_spec, resolve_quantization
    source = resolve_model(path)
    hf_config = load_hf_config(source)
    spec = resolve_quantization(None, checkpoint_quant_spec(hf_config), is_gguf=False)
    return ModelConfig(source=source, hf_config=hf_config, dtype="float32", device="cpu",
                       max_model_len=hf_config.max_position_embeddings, seed=0, served_model_name=source.name,
                       enforce_eager=False, batch_invariant=False, tokenizer=None, default_sampling={},
                       generation_eos_token_ids=(),
                       quantization=spec, mm_config=None)


def _tp_worker(rank: int, world: int, init_method: str, path: str, prompt: list[int], out: str) -> None:
    from pagedserve.executor.model.model_loader import load_model
    from pagedserve.executor.model.quant.packing import PermutedInput
    from pagedserve.tests.helpers.models.tiny_models import prefill_logits
    torch.set_num_threads(1)          # two ranks on two cores
    with gloo_rank(rank, world, init_method):
        model = load_model(_act_order_config(path), TPGroup(rank, world))
        down = model.model.layers[0].mlp.down_proj.packed
        if not (isinstance(down, PermutedInput) and down.zero_input):
            raise RuntimeError(f"down_proj packed as {type(down).__name__}, not a regrouped act-order slice")
        logits = prefill_logits(model, prompt)
        if rank == 0:
            torch.save(logits, out)


def test_act_order_checkpoint_runs_on_two_ranks(tmp_path):
    """A GPTQ act-order Llama folder loaded by two gloo ranks (row-parallel o_proj and down_proj regrouped
    per rank) against HF transformers on its dequantized twin (float32), held to what one rank is held to
    in test_awq_gptq.py: no further off than HF's own bfloat16 run of the same weights. (Two ranks
    against one differ by about as much without act-order: each rank's int4 output is rounded to bfloat16
    before the all-reduce.)"""
    from transformers import AutoModelForCausalLM

    from pagedserve.tests.helpers.models.quant_checkpoints import write_quantized_checkpoint
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    float_dir = make_tiny_model(str(tmp_path / "float"), tokenizer="synthetic", hidden_size=128,
                                intermediate_size=256)
    quant_dir, dequant_dir = str(tmp_path / "gptq"), str(tmp_path / "dequant")
    write_quantized_checkpoint(float_dir, quant_dir, dequant_dir, "gptq", group_size=32, desc_act=True)
    prompt = list(range(10, 50))
    out = str(tmp_path / "tp2_logits.pt")
    run_ranks(_tp_worker, (quant_dir, prompt, out))
    ours = torch.load(out)
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(dequant_dir, dtype=torch.float32).eval()(torch.tensor([prompt]))
        bf16 = AutoModelForCausalLM.from_pretrained(dequant_dir, dtype=torch.bfloat16).eval()(torch.tensor([prompt]))
    bf16_err = (bf16.logits[0].float() - ref.logits[0]).abs().max().item()
    err = (ours - ref.logits[0]).abs().max().item()
    print(f"tp2 act-order vs fp32 twin: {err:.4f}; hf bf16 vs fp32: {bf16_err:.4f}")
    assert err <= bf16_err
    assert torch.equal(ours.argmax(-1), ref.logits[0].argmax(-1))
