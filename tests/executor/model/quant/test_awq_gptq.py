"""AWQ / GPTQ checkpoint tensors decoded to GroupQuantWeight, checked against an independent packer
(tests/helpers/models/quant_packers.py), and the weight stream that gathers each linear's parts."""
from __future__ import annotations

import random

import pytest
import torch

from pagedserve.common.quantization import QuantSpec
from pagedserve.executor.model.quant.awq_gptq import (awq_to_group_quant, combine_quantized_tensors,
                                                      gptq_to_group_quant)
from pagedserve.executor.model.quant.group_quant import GroupQuantWeight
from pagedserve.tests.helpers.models.quant_packers import pack_awq, pack_gptq


def _weight(out: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, cols, generator=gen) * 0.05


def _assert_same(got: GroupQuantWeight, quant, bits: int) -> None:
    """Same codes, scales and zero points as the packer, and so the same dequantized weight."""
    assert got.bits == bits and got.group_size == quant.group_size
    assert got.q.dtype == torch.uint8 and torch.equal(got.q.long(), quant.codes)
    assert torch.equal(got.scale, quant.scale)
    assert torch.equal(got.offset, -quant.scale * quant.zero.float())
    # s*q + (-s*z) against the packer's s*(q - z): equal up to float32 rounding of one product.
    torch.testing.assert_close(got.dequantize(), quant.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("out,cols,g", [(32, 64, 16), (16, 128, 128), (24, 96, -1)])
def test_awq_unpacks_the_packer(out, cols, g):
    tensors, quant = pack_awq(_weight(out, cols, seed=out + cols), g)
    assert tensors["qweight"].shape == (cols, out // 8) and tensors["qweight"].dtype == torch.int32
    got = awq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], g)
    _assert_same(got, quant, 4)
    assert got.shape == (out, cols)


def test_awq_nibble_order_matters():
    # One code per column position: a decoder reading nibbles in plain order would scramble them.
    tensors, quant = pack_awq(_weight(8, 32, seed=1), 32)
    got = awq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], 32)
    assert torch.equal(got.q.long(), quant.codes)
    plain = ((tensors["qweight"].unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32)) & 15).reshape(32, 8)
    assert not torch.equal(plain.t().long(), quant.codes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("g", [16, -1])
def test_gptq_unpacks_the_packer(bits, fmt, sym, g):
    out, cols = 16, 64
    w = _weight(out, cols, seed=bits)
    tensors, quant = pack_gptq(w, bits, g, sym=sym, checkpoint_format=fmt)
    assert tensors["qweight"].shape == (cols * bits // 32, out)
    got = gptq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"],
                              bits, g, fmt)
    _assert_same(got, quant, bits)
    # And it decodes to the float weight: round-to-nearest is within half a step (a full one only where a
    # rounded zero point or the symmetric grid's one-sided range clips an extreme), a quarter on average.
    err = (got.dequantize() - w).abs() / quant.scale.repeat_interleave(quant.group_size, 1)
    assert err.max() <= 1.0 + 1e-3 and err.mean() <= 0.3


def test_gptq_v1_and_v2_zero_conventions_differ():
    w = _weight(8, 32, seed=3)
    v1, quant = pack_gptq(w, 4, 16, checkpoint_format="gptq")
    v2, _ = pack_gptq(w, 4, 16, checkpoint_format="gptq_v2")
    assert not torch.equal(v1["qzeros"], v2["qzeros"])
    # The v2 file read as v1 would be off by one zero step everywhere.
    wrong = gptq_to_group_quant(v2["qweight"], v2["qzeros"], v2["scales"], None, 4, 16, "gptq")
    torch.testing.assert_close(wrong.offset, -quant.scale * (quant.zero.float() + 1))


@pytest.mark.parametrize("bits,fmt,sym", [(4, "gptq", False), (4, "gptq_v2", True), (8, "gptq_v2", False)])
def test_gptq_act_order_unpacks_the_packer(bits, fmt, sym):
    """Act-order: columns come out sorted by group (groups contiguous), with perm naming their checkpoint
    columns; the codes are the packer's, and the weight in checkpoint order is the packer's weight."""
    out, cols, g = 16, 64, 16
    w = _weight(out, cols, seed=7)
    tensors, quant = pack_gptq(w, bits, g, sym=sym, checkpoint_format=fmt, act_order_seed=3)
    g_idx = tensors["g_idx"].long()
    assert not torch.equal(g_idx, torch.arange(cols) // g)          # really permuted
    got = gptq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"],
                              bits, g, fmt)
    assert got.perm is not None and torch.equal(got.perm.sort().values, torch.arange(cols))
    assert torch.equal(g_idx[got.perm], torch.arange(cols) // g)    # sorted columns: groups are runs
    assert torch.equal(got.q.long(), quant.codes[:, got.perm])
    assert torch.equal(got.scale, quant.scale) and torch.equal(got.offset, -quant.scale * quant.zero.float())
    torch.testing.assert_close(got.dequantize(), quant.dequantize(), rtol=0, atol=1e-6)
    # Decoding with the groups read as i // g (ignoring g_idx) gives another weight: g_idx matters.
    ignored = gptq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, bits, g, fmt)
    assert (ignored.dequantize() - quant.dequantize()).abs().max() > 1e-3
    err = (got.dequantize() - w).abs() / quant.scale[:, g_idx]
    assert err.max() <= 1.0 + 1e-3 and err.mean() <= 0.3


def test_gptq_trivial_g_idx_has_no_perm():
    tensors, _ = pack_gptq(_weight(8, 64, seed=4), 4, 16)
    got = gptq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], 4, 16)
    assert got.perm is None
    # One group per row (-1): any visiting order is the same single group, so no permutation either.
    tensors, _ = pack_gptq(_weight(8, 64, seed=4), 4, -1, act_order_seed=1)
    got = gptq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], 4, -1)
    assert got.perm is None


@pytest.mark.parametrize("g_idx,match", [
    (torch.tensor([0] * 20 + [1] * 12 + [2] * 16 + [3] * 16), "20 columns in group 0"),   # not 16 each
    (torch.arange(64) // 16 + 1, "outside 0..3"),
    (torch.zeros(32, dtype=torch.int64), r"shape \(32,\)"),
])
def test_gptq_bad_g_idx(g_idx, match):
    tensors, _ = pack_gptq(_weight(8, 64, seed=4), 4, 16)
    with pytest.raises(ValueError, match=match):
        gptq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx.int(), 4, 16)


@pytest.mark.parametrize("bad,match", [
    (dict(group_size=24), "group_size 24"),
    (dict(scales=torch.zeros(3, 16, dtype=torch.float16)), "scales"),
    (dict(qzeros=torch.zeros(4, 1, dtype=torch.int32)), "qzeros"),
])
def test_awq_shape_errors(bad, match):
    tensors, _ = pack_awq(_weight(16, 64, seed=5), 16)
    args = {**tensors, "group_size": 16, **bad}
    with pytest.raises(ValueError, match=match):
        awq_to_group_quant(args["qweight"], args["qzeros"], args["scales"], args["group_size"])


def test_gptq_bits_error():
    tensors, _ = pack_gptq(_weight(8, 32, seed=6), 4, 16)
    with pytest.raises(ValueError, match="bits"):
        gptq_to_group_quant(tensors["qweight"], tensors["qzeros"], tensors["scales"], None, 3, 16)


# ------------------------------------------------------------------- the weight stream


def _checkpoint(pack, spec: QuantSpec, seed: int = 0):
    """A two-layer 'checkpoint' as a list of (name, tensor), with float tensors between the packed ones."""
    items, expected = [("model.embed_tokens.weight", torch.randn(10, 32))], {}
    for i, (name, out) in enumerate([("model.layers.0.self_attn.q_proj", 32), ("model.layers.0.mlp.up_proj", 16)]):
        tensors, quant = pack(_weight(out, 32, seed=seed + i))
        items += [(f"{name}.{part}", t) for part, t in tensors.items()]
        items.append((f"{name}.bias", torch.randn(out)))
        expected[name + ".weight"] = quant
    items.append(("model.norm.weight", torch.ones(32)))
    return items, expected


def _split(stream):
    quantized, plain = {}, {}
    for name, value in stream:
        (quantized if isinstance(value, GroupQuantWeight) else plain)[name] = value
    return quantized, plain


@pytest.mark.parametrize("method", ["awq", "gptq"])
@pytest.mark.parametrize("order_seed", [0, 1, 2])
def test_combine_any_order(method, order_seed):
    spec = QuantSpec(method, group_size=16)
    pack = (lambda w: pack_awq(w, 16)) if method == "awq" else (lambda w: pack_gptq(w, 4, 16))
    items, expected = _checkpoint(pack, spec)
    random.Random(order_seed).shuffle(items)          # parts of one linear spread over "shards"
    quantized, plain = _split(combine_quantized_tensors(iter(items), spec))
    assert set(quantized) == set(expected)
    for name, quant in expected.items():
        _assert_same(quantized[name], quant, 4)
    passed = {n for n, _ in items if n.rpartition(".")[2] not in ("qweight", "qzeros", "scales", "g_idx")}
    assert set(plain) == passed


def test_combine_yields_as_soon_as_complete():
    spec = QuantSpec("awq", group_size=16)
    items, _ = _checkpoint(lambda w: pack_awq(w, 16), spec)
    stream = combine_quantized_tensors(iter(items), spec)
    names = [next(stream)[0] for _ in range(3)]
    # embed, then q_proj's weight (its three parts consumed), then its bias: nothing held back.
    assert names == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.0.self_attn.q_proj.bias"]


def test_combine_gptq_without_g_idx_and_late_g_idx_checked():
    spec = QuantSpec("gptq", group_size=16)
    items, expected = _checkpoint(lambda w: pack_gptq(w, 4, 16), spec)
    no_g_idx = [(n, t) for n, t in items if not n.endswith("g_idx")]
    quantized, _ = _split(combine_quantized_tensors(iter(no_g_idx), spec))
    assert set(quantized) == set(expected)
    # A g_idx after its weight was already yielded is still checked for act-order.
    bad = no_g_idx + [("model.layers.0.mlp.up_proj.g_idx", torch.arange(32, dtype=torch.int32).flip(0) // 16)]
    with pytest.raises(ValueError, match="act-order"):
        list(combine_quantized_tensors(iter(bad), spec))


def test_combine_desc_act_waits_for_g_idx():
    spec = QuantSpec("gptq", group_size=16, desc_act=True)
    items, expected = _checkpoint(lambda w: pack_gptq(w, 4, 16, act_order_seed=5), spec)
    no_g_idx = [(n, t) for n, t in items if not n.endswith("g_idx")]
    with pytest.raises(ValueError, match=r"lacks model.layers.0.mlp.up_proj.g_idx, model.layers.0.self_attn"):
        list(combine_quantized_tensors(iter(no_g_idx), spec))
    random.Random(0).shuffle(items)
    quantized, _ = _split(combine_quantized_tensors(iter(items), spec))
    assert set(quantized) == set(expected)
    for name, quant in expected.items():
        assert quantized[name].perm is not None
        torch.testing.assert_close(quantized[name].dequantize(), quant.dequantize(), rtol=0, atol=1e-6)
    trivial, _ = _checkpoint(lambda w: pack_gptq(w, 4, 16), spec)
    quantized, _ = _split(combine_quantized_tensors(iter(trivial), spec))
    assert len(quantized) == 2 and all(q.perm is None for q in quantized.values())


def test_combine_missing_and_duplicate_parts():
    spec = QuantSpec("awq", group_size=16)
    items, _ = _checkpoint(lambda w: pack_awq(w, 16), spec)
    without = [(n, t) for n, t in items if n != "model.layers.0.mlp.up_proj.qzeros"]
    with pytest.raises(ValueError, match=r"awq checkpoint lacks model.layers.0.mlp.up_proj.qzeros$"):
        list(combine_quantized_tensors(iter(without), spec))
    twice = items + [items[1]]
    with pytest.raises(ValueError, match="twice"):
        list(combine_quantized_tensors(iter(twice), spec))


@pytest.mark.parametrize("spec", [None, QuantSpec("int8", bits=8, group_size=-1), QuantSpec("gguf")])
def test_combine_passes_other_methods_through(spec):
    items = [("a.weight", torch.ones(2, 2)), ("b.scales", torch.ones(2))]
    assert list(combine_quantized_tensors(iter(items), spec)) == items


# ------------------------------------------------------------------- whole checkpoints on disk


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_checkpoint_folder_round_trip(tmp_path, method):
    """A tiny Llama written as a real AWQ/GPTQ folder (two shards): its config selects the method, and the
    stream from disk decodes to exactly the weights of its dequantized twin, which HF transformers loads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedserve.common.quantization import checkpoint_quant_spec
    from pagedserve.executor.model.model_loader import hf_weights
    from pagedserve.tests.helpers.models.quant_checkpoints import write_quantized_checkpoint
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    float_dir = make_tiny_model(str(tmp_path / "float"), tokenizer="synthetic")
    quant_dir, dequant_dir = str(tmp_path / method), str(tmp_path / "dequant")
    write_quantized_checkpoint(float_dir, quant_dir, dequant_dir, method, group_size=32)

    spec = checkpoint_quant_spec(AutoConfig.from_pretrained(quant_dir))
    assert (spec.method, spec.bits, spec.group_size) == (method, 4, 32)
    stream, _ = hf_weights(quant_dir)
    got = dict(combine_quantized_tensors(stream, spec))
    reference = dict(hf_weights(dequant_dir)[0])
    assert set(got) == set(reference)
    quantized = [n for n, v in got.items() if isinstance(v, GroupQuantWeight)]
    assert len(quantized) == 2 * 7                          # 2 layers x q, k, v, o, gate, up, down
    for name, value in got.items():
        if isinstance(value, GroupQuantWeight):
            torch.testing.assert_close(value.dequantize(), reference[name], rtol=0, atol=1e-6)
        else:
            assert torch.equal(value, reference[name])
    hf = AutoModelForCausalLM.from_pretrained(dequant_dir, dtype=torch.float32)
    torch.testing.assert_close(hf.model.layers[1].mlp.down_proj.weight.data,
                               reference["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("method,desc_act", [("awq", False), ("gptq", False), ("gptq", True)])
def test_quantized_checkpoint_runs_like_its_dequantized_twin(tmp_path, method, desc_act):
    """The whole path: an AWQ/GPTQ folder, its quantization_config, the stream, our layers packed for the
    int4 kernel, against HF transformers on the dequantized twin (float32).

    Tolerance: the int4 CPU kernel takes bfloat16 activations and bfloat16 scales, so the logits may differ
    as much as running the same weights in bfloat16 does (HF bf16 against HF fp32), measured here, not more.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedserve.common.quantization import checkpoint_quant_spec, resolve_quantization
    from pagedserve.executor.model.model_loader import hf_weights
    from pagedserve.executor.model.models import get_model_class
    from pagedserve.executor.model.parallel_state import TPGroup
    from pagedserve.executor.model.quant.loading import begin_packed, finish_packed
    from pagedserve.executor.model.quant.packing import PermutedInput
    from pagedserve.kernels.weights.weight_only import Int4Weight
    from pagedserve.tests.helpers.models.quant_checkpoints import write_quantized_checkpoint
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model, prefill_logits
    float_dir = make_tiny_model(str(tmp_path / "float"), tokenizer="synthetic", hidden_size=128,
                                intermediate_size=256)
    quant_dir, dequant_dir = str(tmp_path / method), str(tmp_path / "dequant")
    write_quantized_checkpoint(float_dir, quant_dir, dequant_dir, method, group_size=32, desc_act=desc_act)

    config = AutoConfig.from_pretrained(quant_dir)
    spec = resolve_quantization(None, checkpoint_quant_spec(config), is_gguf=False)
    model = get_model_class(config)(config, TPGroup())
    begin_packed(model)
    loaded = model.load_weights(combine_quantized_tensors(hf_weights(quant_dir)[0], spec))
    assert model.expected_weights() <= loaded
    finish_packed(model, spec.method, torch.device("cpu"), torch.float32)
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    assert len(packed) == 2 * 4                                                      # qkv, o, gate_up, down
    if desc_act:        # every layer keeps the int4 kernel behind its own input gather
        assert all(isinstance(p, PermutedInput) and isinstance(p.inner, Int4Weight) for p in packed)
        assert len({tuple(p.perm.tolist()) for p in packed}) == len(packed)
    else:
        assert all(isinstance(p, Int4Weight) for p in packed)

    ids = list(range(10, 60))
    ours = prefill_logits(model, ids)
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(dequant_dir, dtype=torch.float32).eval()(torch.tensor([ids]))
        bf16 = AutoModelForCausalLM.from_pretrained(dequant_dir, dtype=torch.bfloat16).eval()(torch.tensor([ids]))
    bf16_err = (bf16.logits[0].float() - ref.logits[0]).abs().max().item()
    assert (ours - ref.logits[0]).abs().max().item() <= bf16_err
    assert torch.equal(ours.argmax(-1), ref.logits[0].argmax(-1))
