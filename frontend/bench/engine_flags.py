"""The engine flags of the offline benches: every EngineArgs field, as engine-serve takes it."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedserve.common.config.arg_utils import add_dataclass_args
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.frontend.bench.models import MODELS, make_model


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser.add_argument_group("engine"), EngineArgs)
    parser.add_argument("--multiprocess-core", action="store_true",
                        help="run the engine core in its own process, as the server does")
    parser.add_argument("--make-model", default=None, choices=sorted(MODELS),
                        help="first write a random-weight model of this shape to --model, if that folder is missing")
    # Warm-up and repeated iterations send the same prompts again: with prefix caching they would measure
    # cache hits, not the work (vLLM's latency bench turns it off for the same reason).
    parser.set_defaults(enable_prefix_caching=False)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM(...) keyword arguments the flags describe."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}


def prepare_model(args: argparse.Namespace) -> None:
    """--make-model: writes the model --model names if it is missing (ValueError without --model)."""
    if args.make_model is None:
        return
    if not args.model:
        raise ValueError("--make-model needs --model PATH (the folder to write)")
    if make_model(args.make_model, args.model):
        print(f"wrote a random-weight {args.make_model} model to {args.model}", flush=True)


def make_llm(args: argparse.Namespace) -> Any:
    """pagedserve's offline LLM for the flags (ValueError from EngineArgs' checks passes through)."""
    from pagedserve.frontend.offline.llm import LLM
    kwargs = engine_kwargs(args)
    return LLM(kwargs.pop("model"), multiprocess_core=args.multiprocess_core, **kwargs)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings that differ from EngineArgs' own defaults (so the benches' prefix caching off
    shows), for a results line."""
    changed = {}
    for f in dataclasses.fields(EngineArgs):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name != "model" and getattr(args, f.name) != default:
            changed[f.name] = getattr(args, f.name)
    return {"model": args.model, "engine_args": changed, "multiprocess_core": args.multiprocess_core,
            "make_model": args.make_model}
