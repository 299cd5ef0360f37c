"""Offline generation from the command line: `python -m pagedserve.frontend.generate --prompt "..."`."""
from __future__ import annotations

import argparse
import logging

from pagedserve.common.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Generate text offline with pagedserve.")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())

    from pagedserve.frontend.llm import LLM
    llm = LLM(args.model, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": q}] for q in args.prompt], params)
    else:
        outs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outs):
        print(f"--- {prompt!r}\n{out.outputs[0].text}")


if __name__ == "__main__":
    main()
