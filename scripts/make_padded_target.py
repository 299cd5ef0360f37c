"""The padded target of issue 26's draft_model benchmark: a GGUF model that a real draft agrees with.

Only one real model exists here (the embedded SmolLM2-135M-Instruct Q4_1), and random bigger models accept no
draft. So the target is the 135M itself with EXTRA decoder layers appended before the final norm, each a copy
of a real layer (norms and attention stay realistic) whose output projections (o_proj, down_proj) are zero:
such a layer reads its full weight bytes and does its full compute but adds nothing to the residual stream,
so the padded model computes the 135M's function (up to the requantization of the dequantized weights) at
the cost of a bigger model. With 90 extra layers (120 in all, ~4x the layers' bytes) the 135M is a draft of
about 1/3-1/4 the target's cost that agrees with it nearly always: the best case of a draft model, which
measures what the draft path's mechanics cost and give, not a real draft's acceptance.

Steps, each skipped when its output exists (written under a temporary name, renamed when complete):
  1. the source GGUF dequantized by transformers (float32), padded, saved as a bf16 HF Llama folder with the
     GGUF's tokenizer and chat template (pagedserve's own GGUF tokenizer conversion);
  2. llama.cpp's convert_hf_to_gguf.py -> bf16 GGUF;  3. llama-quantize -> FORMAT
(scripts/ladder_models.py's convert_bf16 and quantize, with the converter and llama-quantize built by
scripts/build_llama_server.sh). Files: CACHE/NAME/NAME-{bf16,FORMAT}.gguf, NAME = 135m-pad<EXTRA> for the
embedded model, CACHE = the ladder's (PAGEDSERVE_CACHE_DIR/ladder). The HF folder is deleted once its bf16 GGUF
exists. Prints the output path as the last line.

    .venv/bin/python scripts/make_padded_target.py --extra-layers 90 --format Q4_1
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
from typing import Any

import ladder_models as lm  # scripts/ is on sys.path when a script runs
from bench_cpu_peer import default_gguf, find_llama_server


def pad_layers(model: Any, extra_layers: int) -> Any:
    """Appends `extra_layers` decoder layers to an HF Llama-style model in place: extra layer i copies real
    layer i % n_real with o_proj and down_proj zeroed, so each adds nothing to the residual stream."""
    import torch
    layers = model.model.layers
    real = len(layers)
    for i in range(extra_layers):
        layer = copy.deepcopy(layers[i % real])
        layer.self_attn.layer_idx = real + i      # its own KV cache slot in HF's cache
        with torch.no_grad():
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.zero_()
                if proj.bias is not None:
                    proj.bias.zero_()
        layers.append(layer)
    config = model.config
    config.num_hidden_layers = real + extra_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:                               # per-layer attention kinds, where the config lists them
        config.layer_types = list(layer_types) + [layer_types[i % real] for i in range(extra_layers)]
    return model


def load_gguf_model(gguf: str) -> Any:
    """The GGUF's model as a plain float32 HF model (transformers dequantizes every tensor)."""
    import torch
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(gguf)),
                                                  gguf_file=os.path.basename(gguf), dtype=torch.float32)
    # A model loaded from a GGUF refuses save_pretrained ("quantized with gguf"): the same weights in a
    # model built from a config without the quantization marker save as any float model.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    return model.eval()


def save_padded(model: Any, tokenizer: Any, folder: str, extra_layers: int) -> None:
    """`model` padded with `extra_layers` as a bf16 HF folder (what llama.cpp's converter reads) with
    `tokenizer`; written under a temporary name and renamed when complete."""
    import torch
    pad_layers(model, extra_layers).to(torch.bfloat16)
    part = folder + ".part"
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part)
    tokenizer.save_pretrained(part)
    os.replace(part, folder)


def write_padded_hf(gguf: str, folder: str, extra_layers: int) -> None:
    """Step 1: the padded HF folder of `gguf`, with its tokenizer (same vocabulary and chat template)."""
    from pagedserve.common.model.model_files import resolve_model, tokenizer_folder
    from pagedserve.frontend.client.tokenizer import load_tokenizer
    save_padded(load_gguf_model(gguf), load_tokenizer(tokenizer_folder(resolve_model(gguf))), folder, extra_layers)


def target_name(gguf: str, extra_layers: int) -> str:
    source = "135m" if os.path.abspath(gguf) == os.path.abspath(default_gguf()) else \
        os.path.basename(gguf)[: -len(".gguf")]
    return f"{source}-pad{extra_layers}"


def build(gguf: str, extra_layers: int, fmt: str, out: str, quantize_bin: str, llama_src: str,
          threads: int) -> str:
    """Makes what is missing of the chain HF folder -> bf16 GGUF -> `out` (FORMAT); returns `out`."""
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    stem = os.path.basename(out).removesuffix(".gguf").removesuffix(f"-{fmt}")   # NAME-FORMAT.gguf -> NAME
    bf16 = os.path.join(folder, f"{stem}-bf16.gguf")
    if not os.path.isfile(bf16):
        hf = os.path.join(folder, f"{stem}-hf")
        if not os.path.isdir(hf):
            lm._timed(f"padded HF folder (+{extra_layers} layers)", write_padded_hf, gguf, hf, extra_layers)
        lm._timed("bf16 GGUF", lm.convert_bf16, llama_src, hf, bf16)
        shutil.rmtree(hf, ignore_errors=True)
    lm._timed(fmt, lm.quantize, quantize_bin, bf16, out, fmt, threads)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--extra-layers", type=lm.positive_int, default=90, help="zero-output layers appended (90)")
    p.add_argument("--format", default="Q4_1", choices=lm.FORMATS, help="llama-quantize type (Q4_1, "
                   "the embedded model's own)")
    p.add_argument("--out", default=None, help="the output GGUF (default: CACHE/NAME/NAME-FORMAT.gguf)")
    p.add_argument("--gguf", default=None, help="the model to pad (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--cache", default=None, help="default: PAGEDSERVE_CACHE_DIR/ladder, the ladder's cache")
    p.add_argument("--llama-cache", default=None, help="build_llama_server.sh's cache folder")
    p.add_argument("--threads", type=lm.positive_int, default=2, help="llama-quantize's threads")
    return p.parse_args(argv)


def padded_target(extra_layers: int = 90, fmt: str = "Q4_1", gguf: str | None = None, out: str | None = None,
                  cache: str | None = None, llama_cache: str | None = None, threads: int = 2) -> str:
    """The padded target's path, built where missing (scripts/bench_spec_decode.py --padded-target too)."""
    from pagedserve.common import envs
    gguf = gguf or default_gguf()
    out = out or lm.gguf_path(cache or os.path.join(envs.PAGEDSERVE_CACHE_DIR, "ladder"),
                              target_name(gguf, extra_layers), fmt)
    if os.path.isfile(out):
        return out
    quantize_bin, llama_src = lm.llama_tools(find_llama_server(llama_cache))
    return build(gguf, extra_layers, fmt, out, quantize_bin, llama_src, threads)


def main(args: argparse.Namespace) -> None:
    print(padded_target(args.extra_layers, args.format, args.gguf, args.out, args.cache, args.llama_cache,
                        args.threads), flush=True)


if __name__ == "__main__":
    main(parse_args())
