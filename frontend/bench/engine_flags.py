"""The engine flags of the offline benches: every EngineArgs field, as engine-serve takes it."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pagedserve.common.arg_utils import add_dataclass_args
from pagedserve.common.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser.add_argument_group("engine"), EngineArgs)
    parser.add_argument("--multiprocess-core", action="store_true",
                        help="run the engine core in its own process, as the server does")
    # Warm-up and repeated iterations send the same prompts again: with prefix caching they would measure
    # cache hits, not the work (vLLM's latency bench turns it off for the same reason).
    parser.set_defaults(enable_prefix_caching=False)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM(...) keyword arguments the flags describe."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}


def make_llm(args: argparse.Namespace) -> Any:
    """pagedserve's offline LLM for the flags (ValueError from EngineArgs' checks passes through)."""
    from pagedserve.frontend.llm import LLM
    kwargs = engine_kwargs(args)
    return LLM(kwargs.pop("model"), multiprocess_core=args.multiprocess_core, **kwargs)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given other values than their defaults, for a results line."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    base = parser.parse_args([])
    changed = {k: v for k, v in engine_kwargs(args).items() if k != "model" and getattr(base, k) != v}
    return {"model": args.model, "engine_args": changed, "multiprocess_core": args.multiprocess_core}
