"""`pagedserve bench mm`: image requests on a vision-language model (issue 47), three measurements:

  throughput   one image (--image-size, random RGB) and a short prompt per request, --output-len tokens each
               (greedy, ignore_eos), at each --batch-size: pagedserve's offline LLM against HF transformers'
               generate on the same weights, each row a fresh engine in a process of its own, the two
               alternated within every repeat. Batch B is ceil(--num-prompts / B) calls of B requests: one
               llm.generate of B prompts, or one left-padded HF batch of B. Output tok/s, requests/s, and
               pagedserve / HF of the same repeat and batch.
  ttft-cache   over HTTP against a fresh `pagedserve serve`: TTFT of a chat request with an image never sent
               before, then of the same request again (prefix, encoder and processor caches all hit).
  ttft-beside  TTFT of a text-only chat request on an idle server (median of --idle-samples), then right
               after --num-large-images requests with --large-image-size PNGs were sent, per round.

    pagedserve bench mm --repeats 2 --result-file benchmarks/results/mm_cpu.jsonl
    pagedserve bench mm --measure throughput --model ./llava --batch-size 1 2 --output-len 4 --image-size 32

--model is any vision-language folder pagedserve serves; missing, --make-model's random-weight shape is
written there first (frontend/bench/models.py). The offline prompt is --prompt, a template holding the
model's image placeholder (default: the model's chat template around one image and --text).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import time
from collections.abc import Iterator
from typing import Any

from pagedserve.common.config.dtype import DTYPE_CHOICES
from pagedserve.frontend.bench.models import VLM_MODELS, default_vlm, make_vlm, random_image
from pagedserve.frontend.bench.peer.child import report, run_child
from pagedserve.frontend.bench.peer.engines import engine_args_overrides
from pagedserve.frontend.bench.results import append_result, run_metadata

MEASURES = ("throughput", "ttft-cache", "ttft-beside")
ENGINES = ("pagedserve", "hf")
_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "mm")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--measure", nargs="+", choices=MEASURES, default=list(MEASURES))
    p.add_argument("--model", default=None, help=f"a vision-language model folder (default: {_CACHE}/NAME)")
    p.add_argument("--make-model", choices=VLM_MODELS, default=None,
                   help="the random-weight shape written to --model when it is missing (default: SmolVLM's "
                        "once pagedserve serves Idefics3, else the Llava)")
    p.add_argument("--prompt", default=None, help="offline prompt template with the model's image placeholder")
    p.add_argument("--text", default="Describe the image.", help="the text beside the image")
    p.add_argument("--image-size", type=int, default=448, help="request images are this many pixels square")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-prompts", type=int, default=16, help="throughput: requests per row")
    p.add_argument("--output-len", type=int, default=64, help="throughput: output tokens per request")
    p.add_argument("--num-iters-warmup", type=int, default=1,
                   help="throughput: untimed calls of the batch size first (fresh images)")
    p.add_argument("--repeats", type=int, default=2, help="rows of every engine and batch, alternated")
    p.add_argument("--threads", type=int, default=2, help="OpenMP threads of every engine")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="both engines' dtype (auto: pagedserve's rule for this machine)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an EngineArgs field for pagedserve offline and served (engine-serve's name with _)")
    p.add_argument("--ttft-output-len", type=int, default=8, help="ttft-*: output tokens per request")
    p.add_argument("--ttft-rounds", type=int, default=3, help="ttft-*: measured rounds per server")
    p.add_argument("--idle-samples", type=int, default=5, help="ttft-beside: idle text requests")
    p.add_argument("--large-image-size", type=int, default=2048)
    p.add_argument("--num-large-images", type=int, default=8)
    p.add_argument("--beside-delay-s", type=float, default=0.1,
                   help="ttft-beside: wait after sending the large requests (their bodies reach the server)")
    p.add_argument("--label", default=None, help="prefixes every row's label")
    p.add_argument("--result-file", default=None, help="append one JSON line per row to this file")


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag out of range (reported as a usage error); types the engine options."""
    for name in ("image_size", "num_prompts", "output_len", "repeats", "threads", "ttft_output_len",
                 "ttft_rounds", "idle_samples", "large_image_size", "num_large_images"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in args.batch_size):
        raise ValueError("--batch-size must be >= 1")
    if args.beside_delay_s < 0 or args.num_iters_warmup < 0:
        raise ValueError("--beside-delay-s and --num-iters-warmup must be >= 0")
    options = {}
    for item in args.engine_option:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--engine-option must be KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    args.options = engine_args_overrides("pagedserve", options)
    if "dtype" in args.options:
        raise ValueError("--engine-option dtype: use --dtype, which both engines take")


def main(args: argparse.Namespace) -> None:
    import torch  # noqa: F401 - imported here so that every results line records its version
    try:
        cfg = prepare(args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagedserve bench mm: {exc}") from None
    if "throughput" in args.measure:
        rows = [emit(args, "mm_throughput", f"{r['engine']} b{r['batch_size']}", cfg, r)
                for r in run_throughput(args, cfg)]
        print(throughput_table(rows))
    http = [m for m in args.measure if m != "throughput"]
    if http:
        from pagedserve.frontend.bench.mm_http import run_http
        for rep in range(args.repeats):
            for measure, result in run_http(args, cfg, http):
                emit(args, f"mm_{measure.replace('-', '_')}", measure, cfg, {"run": rep + 1, **result})


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The model (written first if missing), its prompt and the dtype both engines run in."""
    model = args.model or os.path.join(_CACHE, args.make_model or default_vlm())
    if not os.path.isdir(model):
        name = args.make_model or default_vlm()
        print(f"writing a random-weight {name} model to {model}", flush=True)
        make_vlm(name, model)
    return {"model": os.path.abspath(model), "prompt": args.prompt or default_prompt(model, args.text),
            "dtype": resolved_dtype(model, args.dtype), "image_size": args.image_size,
            "threads": args.threads, "engine_options": args.options}


def default_prompt(model: str, text: str) -> str:
    """The model's chat template around one image and `text`, as the HTTP requests render."""
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(model)
    if not getattr(processor, "chat_template", None):
        raise ValueError(f"{model} has no chat template: give --prompt with its image placeholder")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def resolved_dtype(model: str, requested: str) -> str:
    """`requested` as pagedserve resolves it on this machine, so HF runs in the same dtype."""
    import torch
    from transformers import AutoConfig
    from pagedserve.common.config.dtype import checkpoint_dtype, resolve_dtype
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_dtype(requested, device, checkpoint_dtype(AutoConfig.from_pretrained(model)))


def emit(args: argparse.Namespace, bench: str, label: str, cfg: dict[str, Any],
         result: dict[str, Any]) -> dict[str, Any]:
    record = {**run_metadata(bench, f"{args.label} {label}" if args.label else label, args.command_line),
              **cfg, **result}
    print(json.dumps(record), flush=True)
    if args.result_file:
        append_result(args.result_file, record)
    return record


def run_throughput(args: argparse.Namespace, cfg: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Rows as they are made (a run stopped part way keeps its rows): per repeat, per batch size, pagedserve
    then HF; pagedserve's row carries its ratio to the HF row beside it (the same repeat and batch, so the
    machine's drift is shared)."""
    for rep in range(args.repeats):
        for batch in args.batch_size:
            job = {**cfg, "batch": batch, "calls": math.ceil(args.num_prompts / batch),
                   "output_len": args.output_len, "warmup_calls": args.num_iters_warmup}
            pair = {e: run_child(__name__, json.dumps({**job, "engine": e}), args.threads, f"{e} batch {batch}")
                    for e in ENGINES}
            for engine, run in pair.items():
                run.update(engine=engine, run=rep + 1, batch_size=batch, output_len=args.output_len,
                           num_iters_warmup=args.num_iters_warmup)
            ps, hf = pair["pagedserve"], pair["hf"]
            ps["vs_hf_output_tokens_per_second"] = ps["output_tokens_per_second"] / hf["output_tokens_per_second"]
            yield from (ps, hf)


def child_main(payload: str) -> None:
    """In the child process (peer/child.py): one engine's row, reported to the parent."""
    report(run_row(json.loads(payload)))


def run_row(job: dict[str, Any]) -> dict[str, Any]:
    """One engine's throughput at one batch size, in this process."""
    # The same images for both engines; the warm-up's are others, so no cache serves a measured call.
    calls = [[random_image(10 ** 6 + 1000 * c + i, job["image_size"]) for i in range(job["batch"])]
             for c in range(-job["warmup_calls"], job["calls"])]
    run = _pagedserve_calls if job["engine"] == "pagedserve" else _hf_calls
    seconds, tokens = run(job, calls)
    n = job["batch"] * job["calls"]
    return {"elapsed_time": seconds, "num_requests": n, "output_tokens": tokens,
            "output_tokens_per_second": tokens / seconds, "requests_per_second": n / seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _pagedserve_calls(job: dict[str, Any], calls: list[list[Any]]) -> tuple[float, int]:
    """Seconds and output tokens of every call after the warm-up ones, each one llm.generate."""
    from pagedserve.common.params.sampling_params import SamplingParams
    from pagedserve.frontend.offline.llm import LLM
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    # Prefix caching off, as in the other offline benches: a warm-up or repeat must not be measured as a hit.
    options = {"enable_prefix_caching": False, **job["engine_options"]}
    with LLM(job["model"], dtype=job["dtype"], **options) as llm:
        seconds, tokens = 0.0, 0
        for i, images in enumerate(calls):
            prompts = [{"prompt": job["prompt"], "multi_modal_data": {"image": image}} for image in images]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            made = [len(o.outputs[0].token_ids) for o in outs]
            if i >= job["warmup_calls"]:
                seconds, tokens = seconds + time.perf_counter() - start, tokens + sum(made)
            check_lengths(made, job["output_len"], "pagedserve")
    return seconds, tokens


def _hf_calls(job: dict[str, Any], calls: list[list[Any]]) -> tuple[float, int]:
    """As _pagedserve_calls, each call one left-padded batch through HF's processor and generate."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    device = "cuda" if torch.cuda.is_available() else "cpu"
    processor = AutoProcessor.from_pretrained(job["model"])
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(job["model"], dtype=getattr(torch, job["dtype"]))
    model = model.to(device)
    model.eval()
    model.generation_config.eos_token_id = None          # every request runs its full length, as ignore_eos
    pad = processor.tokenizer.pad_token_id
    pad = processor.tokenizer.eos_token_id if pad is None else pad
    seconds, tokens = 0.0, 0
    with torch.inference_mode():
        for i, images in enumerate(calls):
            start = time.perf_counter()
            inputs = processor(text=[job["prompt"]] * len(images), images=[[im] for im in images], padding=True,
                               return_tensors="pt").to(device)
            out = model.generate(**inputs, max_new_tokens=job["output_len"], min_new_tokens=job["output_len"],
                                 do_sample=False, pad_token_id=pad)
            if device == "cuda":
                torch.cuda.synchronize()
            made = [out.shape[1] - inputs["input_ids"].shape[1]] * len(images)
            if i >= job["warmup_calls"]:
                seconds, tokens = seconds + time.perf_counter() - start, tokens + sum(made)
            check_lengths(made, job["output_len"], "hf")
    return seconds, tokens


def check_lengths(made: list[int], want: int, engine: str) -> None:
    """ignore_eos makes every request exactly its max_tokens: anything else is a bug worth stopping for."""
    wrong = [m for m in made if m != want]
    if wrong:
        raise RuntimeError(f"{engine} made {wrong[0]} tokens, asked for {want}")


def throughput_table(rows: list[dict[str, Any]]) -> str:
    """Per engine and batch: median output tok/s and requests/s over the repeats; pagedserve's ratios."""
    lines = ["| engine | batch | output tok/s | requests/s | x HF (per repeat) |", "|---|---|---|---|---|"]
    for batch in dict.fromkeys(r["batch_size"] for r in rows):
        for engine in ENGINES:
            mine = [r for r in rows if r["engine"] == engine and r["batch_size"] == batch]
            ratios = ", ".join(f"{r['vs_hf_output_tokens_per_second']:.2f}x" for r in mine if engine != "hf")
            lines.append(f"| {engine} | {batch} | "
                         f"{statistics.median(r['output_tokens_per_second'] for r in mine):.1f} | "
                         f"{statistics.median(r['requests_per_second'] for r in mine):.2f} | {ratios or '-'} |")
    return "\n".join(lines)
