"""Embedding throughput (issue 29): LLM.embed against sentence-transformers on the same BERT-base-shaped random
model (hidden 768, 12 layers, 12 heads; a small WordPiece vocabulary, so every word is one token), in the same
process, the two alternated on each configuration and repeated:

- batch 1: one prompt per call, prompts of each length in --lengths;
- batch 64: 64 prompts per call (sentence-transformers' batch_size=64), lengths drawn uniformly from
  [min(--lengths), max(--lengths)].

Each result line: inputs/s and prompt tokens/s of each side, the ratio, the configuration and the command.
Usage: python scripts/bench_embed.py [--repeats 3] [--lengths 32,128,512] [--dtype float32]
[--result-file benchmarks/results/embeddings.jsonl]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_child import emit  # noqa: E402



def make_model(folder: str) -> str:
    from pagedserve.tests.helpers.pooling_models import make_encoder_embedder
    if not os.path.exists(os.path.join(folder, "modules.json")):
        make_encoder_embedder(folder, "bert", "MEAN", True, hidden_size=768, num_hidden_layers=12,
                              num_attention_heads=12, intermediate_size=3072, initializer_range=0.02)
    return folder


def texts_of(lengths: list[int], seed: int) -> list[str]:
    """Texts of exactly length - 2 words each ([CLS] and [SEP] make `length` tokens)."""
    from pagedserve.tests.helpers.pooling_models import _WORDS
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(n - 2)) for n in lengths]


def timed(fn, texts: list[str], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        fn(texts[i:i + batch])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default="32,128,512")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--calls", type=int, default=4, help="calls of each configuration per repeat")
    parser.add_argument("--batches", default="1,64", help="which of the batch-1 and batch-64 runs to make")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "pagedserve-bench-bert-base"))
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM
    path = make_model(args.model_dir)
    lengths = [int(x) for x in args.lengths.split(",")]
    st = SentenceTransformer(path, device="cpu")
    if args.dtype == "bfloat16":
        st = st.to(torch.bfloat16)
    llm = LLM(path, dtype=args.dtype, device="cpu", max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=64)
    ours = lambda batch: llm.embed(batch, use_tqdm=False)                       # noqa: E731
    theirs = lambda batch: st.encode(batch, batch_size=64, convert_to_numpy=True)  # noqa: E731
    rng = random.Random(0)
    batches = {int(b) for b in args.batches.split(",")}
    configs = [(1, [n] * args.calls, f"len{n}") for n in lengths] if 1 in batches else []
    if 64 in batches:
        configs.append((64, [rng.randint(min(lengths), max(lengths)) for _ in range(64 * args.calls)],
                        f"len{min(lengths)}-{max(lengths)}"))
    for batch, lens, name in configs:
        texts = texts_of(lens, seed=batch)
        timed(ours, texts[:batch], batch), timed(theirs, texts[:batch], batch)        # warm-up
        for repeat in range(args.repeats):
            sides = [("pagedserve", ours), ("sentence_transformers", theirs)]
            if repeat % 2:
                sides.reverse()
            secs = {side: timed(fn, texts, batch) for side, fn in sides}
            tokens = sum(lens)
            result = {"bench": "embeddings", "batch": batch, "lengths": name, "repeat": repeat,
                      "dtype": args.dtype, "threads": torch.get_num_threads(),
                      **{f"{s}_inputs_per_s": len(texts) / t for s, t in secs.items()},
                      **{f"{s}_tokens_per_s": tokens / t for s, t in secs.items()},
                      "speedup": secs["sentence_transformers"] / secs["pagedserve"],
                      "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
            emit(result, args.result_file)
    llm.shutdown()


if __name__ == "__main__":
    main()
