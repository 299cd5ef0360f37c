"""Multi-LoRA on the embedded model (issue 28), same run, configurations alternated and repeated, each in a child
process on all cores:

- W1 (--num-requests requests) on the base model against the same requests spread round-robin over 8 rank-16
  adapters on every linear layer (q, k, v, o, gate, up, down), and one adapter for all;
- single stream: ms/token of one 128-token answer, base against one adapter;
- the CPU kernel: LoRASlots' shrink/expand for a 64-token decode step of 8 adapters (qkv_proj's shape), as
  served over the embedded model (the C kernel, bfloat16 slots), against a per-request loop of (x A^T) B^T;
- llama.cpp's llama-server on the same GGUF, without and with `--lora` of adapter 0 converted by llama.cpp's own
  convert_lora_to_gguf.py: single stream and W1 (the adapter on every request, as --lora applies it).

The adapters are random PEFT adapters (gaussian A, B of std 0.02) over the embedded model, made once into
--adapters unless they exist. Usage: python scripts/bench_lora.py [--num-requests 32] [--repeats 2]
[--result-file benchmarks/results/lora.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_child import emit, report, run_child  # noqa: E402

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_ADAPTERS = 8


def convert_for_llama(folder: str, adapter: str) -> str:
    """adapter 0 as a GGUF LoRA, by llama.cpp's converter (it reads the base's config: the embedded GGUF's, with
    the architecture named and no quantization entry)."""
    import subprocess

    from pagedserve.common import envs
    out = os.path.join(folder, "a0.gguf")
    if os.path.exists(out):
        return out
    from transformers import AutoConfig

    from pagedserve.common.model.model_files import embedded_model_path
    gguf = embedded_model_path()
    config = AutoConfig.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config.architectures = ["LlamaForCausalLM"]
    base = os.path.join(folder, "base_config")
    config.save_pretrained(base)
    with open(os.path.join(base, "config.json")) as f:
        data = json.load(f)
    data.pop("quantization_config", None)
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump(data, f)
    converter = os.path.join(envs.PAGEDSERVE_LLAMA_CPP_DIR, "src", "convert_lora_to_gguf.py")
    subprocess.run([sys.executable, converter, "--base", base, "--outfile", out, "--outtype", "f32", adapter],
                   check=True, capture_output=True)
    return out


def run_llama(cfg: dict) -> dict:
    from llama_server_peer import LlamaServer

    from pagedserve.common import envs
    from pagedserve.common.model.model_files import embedded_model_path
    from pagedserve.frontend.bench.datasets import w1
    binary = os.path.join(envs.PAGEDSERVE_LLAMA_CPP_DIR, "build", "bin", "llama-server")
    extra = ["--lora", cfg["llama_lora"]] if cfg["name"] == "llama-lora" else []
    server = LlamaServer(binary, embedded_model_path(), os.cpu_count() or 1, 16, 16 * 800, extra_args=extra)
    try:
        ms, _ = server.single_stream(list(range(100, 132)), 128)
        seconds, tokens = server.run_batch([(r.prompt, r.expected_output_len) for r in w1(cfg["num_requests"])])
    finally:
        server.stop()
    return {"config": cfg["name"], "ms_per_token": ms, "output_tokens": tokens, "seconds": seconds,
            "output_tok_per_s": tokens / seconds}


def make_adapters(folder: str) -> list[str]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagedserve.common.model.model_files import embedded_model_path
    paths = [os.path.join(folder, f"a{i}") for i in range(NUM_ADAPTERS)]
    if all(os.path.exists(os.path.join(p, "adapter_config.json")) for p in paths):
        return paths
    gguf = embedded_model_path()
    base = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=ALL_LINEAR, lora_dropout=0.0))
    for i, path in enumerate(paths):
        torch.manual_seed(i)
        for name, param in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(param, std=0.02)
        model.save_pretrained(path, safe_serialization=True)
    return paths


def child(payload: str) -> None:
    cfg = json.loads(payload)
    if cfg["name"] == "kernel":
        report(kernel(cfg["adapters"]))
        return
    if cfg["name"].startswith("llama"):
        report(run_llama(cfg))
        return
    from pagedserve import LLM, LoRARequest, SamplingParams
    from pagedserve.frontend.bench.datasets import w1
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(cfg["adapters"])]
    with LLM(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=16, max_model_len=1024,
             enable_prefix_caching=False) as llm:
        for lora in loras:
            llm.add_lora(lora)
        if cfg["name"].startswith("single"):
            lora = loras[0] if cfg["name"] == "single-lora" else None
            params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
            llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4), use_tqdm=False, lora_request=lora)
            start = time.perf_counter()
            out = llm.generate([list(range(100, 132))], params, use_tqdm=False, lora_request=lora)[0]
            seconds = time.perf_counter() - start
            report({"config": cfg["name"], "ms_per_token": 1000 * seconds / len(out.outputs[0].token_ids)})
            return
        reqs = w1(cfg["num_requests"])
        prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True) for r in reqs]
        per_prompt = {"w1-base": [None] * len(reqs), "w1-one": [loras[0]] * len(reqs),
                      "w1-8": [loras[i % NUM_ADAPTERS] for i in range(len(reqs))]}[cfg["name"]]
        llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False, lora_request=per_prompt[:2])
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    report({"config": cfg["name"], "output_tokens": tokens, "seconds": seconds, "output_tok_per_s": tokens / seconds})


def kernel(adapter_paths: list[str]) -> dict[str, float]:
    """qkv_proj of the embedded model (576 -> 960), 64 decode tokens, 8 per adapter, interleaved."""
    import torch

    from pagedserve.executor.model.layers.lora import LoRAContext, LoRASlots
    torch.manual_seed(0)
    tokens, d_in, d_out, r = 64, 576, 960, 16
    ctx = LoRAContext(cpu_kernel=True)              # as LoRAManager sets it up on CPU, with its pool_dtype there
    slots = LoRASlots([576, 192, 192], d_in, d_out, NUM_ADAPTERS, r, ctx, torch.bfloat16, torch.device("cpu"))
    a = [torch.randn(3 * r, d_in) * 0.02 for _ in range(NUM_ADAPTERS)]
    b = [torch.randn(d_out, 3 * r) * 0.02 for _ in range(NUM_ADAPTERS)]
    for s in range(NUM_ADAPTERS):
        slots.set_slot(s, a[s], b[s])
    owner = [i % NUM_ADAPTERS for i in range(tokens)]
    ctx.set_rows(owner, torch.device("cpu"))
    x, y = torch.randn(tokens, d_in), torch.zeros(tokens, d_out)

    def grouped() -> None:
        slots.apply(x, y)

    def per_request() -> None:
        for i, s in enumerate(owner):
            y[i:i + 1] += (x[i:i + 1] @ a[s].T) @ b[s].T

    def best_us(fn, n: int = 200) -> float:
        for _ in range(20):
            fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - start) / n)
        return 1e6 * min(times)
    w = torch.randn(d_out, d_in)
    base_us = best_us(lambda: torch.nn.functional.linear(x, w))      # the layer's own (dense) matmul
    return {"config": "kernel", "grouped_us": best_us(grouped), "per_request_us": best_us(per_request),
            "base_matmul_us": base_us, "slot_dtype": "bfloat16"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", default=os.path.expanduser("~/.cache/pagedserve/lora_bench"))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--only", nargs="+", default=None, help="run these configurations only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    adapters = make_adapters(args.adapters)
    llama_lora = convert_for_llama(args.adapters, adapters[0])
    cores = os.cpu_count() or 1
    for repeat in range(args.repeats):
        for name in args.only or ("w1-base", "w1-8", "w1-one", "single-base", "single-lora", "kernel",
                                  "llama-base", "llama-lora"):
            payload = json.dumps({"name": name, "num_requests": args.num_requests, "adapters": adapters,
                                  "llama_lora": llama_lora})
            result = run_child(__file__, payload, cores, name)
            result.update(repeat=repeat, threads=cores, num_requests=args.num_requests,
                          date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv))
            emit(result, args.result_file)


if __name__ == "__main__":
    main()
