"""The requests a benchmark sends: prompts as token ids with the number of tokens each must produce.

`random` is vLLM's random dataset (lengths uniform in [len * (1 - ratio), len * (1 + ratio)], random ids,
an optional prefix shared by every prompt). `w1` and `g1` are this project's fixed workloads, the same
requests for a given seed whatever else changes, so runs months apart compare:

- W1 (CPU): 64 requests; prompt length uniform in 32-512, max_tokens uniform in 32-256.
- G1 (GPU): 256 requests; prompt length and max_tokens each uniform in 100-1024.

Ids of W1/G1 are drawn from [100, 49000) (every vocabulary we bench has more), so they need no tokenizer.
Prompts travel as token ids, so every engine sees exactly `prompt_len` tokens whatever its tokenizer would
make of the text; the chat endpoint, which takes text only, gets them decoded.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
from typing import Any

DATASETS = ("random", "w1", "g1")
DEFAULT_NUM_PROMPTS = {"random": 1000, "w1": 64, "g1": 256}
_FIXED = {"w1": ((32, 512), (32, 256)), "g1": ((100, 1024), (100, 1024))}
_LOW_ID, _HIGH_ID = 100, 49000                  # W1/G1's id range; random keeps ids above 100 too


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt: list[int]
    prompt_len: int
    expected_output_len: int


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="random: vLLM's random dataset; w1 / g1: this project's CPU / GPU workloads "
                        "(fixed lengths per seed; the --random-* flags do not apply)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default: 64 for w1, 256 for g1, 1000 for random)")
    g.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    g.add_argument("--random-output-len", type=int, default=128, help="random: output tokens")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="random: tokens of one random prefix every prompt starts with (prefix caching)")


def check_dataset_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag that is out of range."""
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    for flag in ("random_input_len", "random_output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {args.random_prefix_len}")


def sample_requests(args: argparse.Namespace, vocab_size: int, seed: int) -> list[SampleRequest]:
    """The requests `args` describe (flags from add_dataset_args), drawn from `seed`."""
    n = args.num_prompts or DEFAULT_NUM_PROMPTS[args.dataset_name]
    if args.dataset_name in _FIXED:
        prompt_lens, output_lens = _FIXED[args.dataset_name]
        return fixed_workload(n, prompt_lens, output_lens, seed)
    return random_dataset(n, args.random_input_len, args.random_output_len, args.random_range_ratio,
                          args.random_prefix_len, vocab_size, seed)


def dataset_settings(args: argparse.Namespace, num_prompts: int) -> dict[str, Any]:
    """The dataset flags that shaped the requests, for a results line."""
    settings: dict[str, Any] = {"dataset_name": args.dataset_name, "num_prompts": num_prompts, "seed": args.seed}
    if args.dataset_name == "random":
        settings.update({k: getattr(args, k) for k in ("random_input_len", "random_output_len",
                                                       "random_range_ratio", "random_prefix_len")})
    return settings


def fixed_workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                   seed: int = 0) -> list[SampleRequest]:
    """W1/G1's draw, unchanged since the first benchmarks (random.Random(seed), one request at a time)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_lens)
        prompt = [rng.randrange(_LOW_ID, _HIGH_ID) for _ in range(length)]
        reqs.append(SampleRequest(prompt, length, rng.randint(*output_lens)))
    return reqs


def w1(num_requests: int = 64, seed: int = 0) -> list[SampleRequest]:
    return fixed_workload(num_requests, *_FIXED["w1"], seed)


def g1(num_requests: int = 256, seed: int = 0) -> list[SampleRequest]:
    return fixed_workload(num_requests, *_FIXED["g1"], seed)


def random_dataset(num_requests: int, input_len: int, output_len: int, range_ratio: float, prefix_len: int,
                   vocab_size: int, seed: int = 0) -> list[SampleRequest]:
    rng = random.Random(seed)
    high = max(_LOW_ID + 1, vocab_size)
    prefix = [rng.randrange(_LOW_ID, high) for _ in range(prefix_len)]
    reqs = []
    for _ in range(num_requests):
        length = rng.randint(*_bounds(input_len, range_ratio))
        prompt = prefix + [rng.randrange(_LOW_ID, high) for _ in range(length)]
        reqs.append(SampleRequest(prompt, len(prompt), rng.randint(*_bounds(output_len, range_ratio))))
    return reqs


def _bounds(length: int, ratio: float) -> tuple[int, int]:
    return max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
