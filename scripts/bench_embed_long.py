"""Long inputs to a decoder embedder (issue 29): a Qwen3-shaped causal model served with --convert embed
(last-token pooling, normalized) embeds prompts longer than the token budget, so each is chunk-prefilled over
several steps, against the same prompts in one step (a budget that holds them whole) and against
sentence-transformers on the same folder; alternated and repeated, one process, 2 threads.

Usage: python scripts/bench_embed_long.py [--length 2048] [--prompts 4] [--repeats 3] [--dtype float32]
[--result-file benchmarks/results/embeddings_long.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_child import emit  # noqa: E402


def make_model(folder: str) -> str:
    from pagedserve.tests.helpers.pooling_models import write_sentence_transformers
    from pagedserve.tests.helpers.tiny_models import make_tiny_model
    if not os.path.exists(os.path.join(folder, "modules.json")):
        make_tiny_model(folder, arch="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192,
                        vocab_size=49152, initializer_range=0.02)
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            tok = json.load(f)
        tok.setdefault("pad_token", tok.get("eos_token"))
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(tok, f)
        write_sentence_transformers(folder, "LAST", True, 1024)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048, help="tokens per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512, help="the token budget that chunks each prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "pagedserve-bench-qwen3-embed"))
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM
    path = make_model(args.model_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.length)] for _ in range(args.prompts)]
    common = dict(runner="pooling", convert="embed", dtype=args.dtype, device="cpu",
                  max_model_len=args.length + 16, enable_prefix_caching=False)
    engines = {"chunked": LLM(path, max_num_batched_tokens=args.chunk, **common),
               "whole": LLM(path, max_num_batched_tokens=args.length * args.prompts, **common)}
    st = SentenceTransformer(path, device="cpu")
    st.max_seq_length = args.length + 16
    if args.dtype == "bfloat16":
        st = st.to(torch.bfloat16)
    texts = [st.tokenizer.decode(p) for p in prompts]
    sides = {name: (lambda e=e: e.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False))
             for name, e in engines.items()}
    sides["sentence_transformers"] = lambda: st.encode(texts, batch_size=len(texts), convert_to_numpy=True)
    for fn in sides.values():
        fn()                                                          # warm-up
    for repeat in range(args.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        secs = {}
        for name in order:
            start = time.perf_counter()
            sides[name]()
            secs[name] = time.perf_counter() - start
        tokens = args.length * args.prompts
        result = {"bench": "embeddings_long", "repeat": repeat, "length": args.length, "prompts": args.prompts,
                  "chunk": args.chunk, "dtype": args.dtype, "threads": torch.get_num_threads(),
                  **{f"{n}_tokens_per_s": tokens / s for n, s in secs.items()},
                  "chunked_vs_whole": secs["whole"] / secs["chunked"],
                  "chunked_vs_sentence_transformers": secs["sentence_transformers"] / secs["chunked"],
                  "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
        emit(result, args.result_file)
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
