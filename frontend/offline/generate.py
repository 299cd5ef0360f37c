"""Offline generation from the command line: `python -m pagedserve.frontend.offline.generate --prompt "..."`.

Its engine flags are engine-serve's (generated from EngineArgs: --model, --dtype, --seed, ...); its own are
GenerateArgs."""
from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass

from pagedserve.common.config.arg_utils import dataclass_from, dataclass_parser, setting
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.server_args import LOG_LEVELS


@dataclass(frozen=True)
class GenerateArgs:
    prompt: tuple[str, ...] = setting((), append=True, help="a prompt (at least one)")
    chat: bool = setting(False, store_true=True, help="wrap each prompt as a user message (chat template)")
    max_tokens: int = setting(64, help="tokens to generate for each prompt")
    temperature: float = setting(0.0, help="sampling temperature (0: greedy)")
    top_p: float = setting(1.0, help="nucleus sampling: the smallest set of tokens holding this probability")
    log_level: str = setting("warning", choices=LOG_LEVELS, help="log messages of this level and above")


def make_parser() -> argparse.ArgumentParser:
    return dataclass_parser({"engine": EngineArgs, "generate": GenerateArgs},
                            description="Generate text offline with pagedserve.")


def parse_args(argv: list[str] | None = None) -> tuple[EngineArgs, GenerateArgs]:
    p = make_parser()
    ns = p.parse_args(argv)
    if not ns.prompt:
        p.error("the following arguments are required: --prompt")
    return dataclass_from(ns, EngineArgs), dataclass_from(ns, GenerateArgs)


def main(argv: list[str] | None = None) -> None:
    engine_args, args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())

    from pagedserve.frontend.offline.llm import LLM
    llm = LLM(**dataclasses.asdict(engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": q}] for q in args.prompt], params)
    else:
        outs = llm.generate(list(args.prompt), params)
    for prompt, out in zip(args.prompt, outs):
        print(f"--- {prompt!r}\n{out.outputs[0].text}")


if __name__ == "__main__":
    main()
