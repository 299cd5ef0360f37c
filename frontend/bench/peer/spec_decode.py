"""`pagedserve bench spec-decode`: speculative decoding on CPU (issue 26). Single-stream ms/token on
input-grounded prompts, pagedserve with and without speculation (`ngram` by default, or any --spec) against
llama.cpp's `llama-server` with and without its own (n-gram types; with a GGUF draft model, the same draft); and
W1 with speculation on against off.

Prompts (`PROMPTS`): four chat turns that ask the model to repeat a passage of 150-300 tokens with a light
edit: prose, a code function, a list, a record. Every engine gets the same token ids (the chat template
applied by the model's tokenizer), greedy, stopping at EOS (at most --max-tokens). ms/token = (t(full answer)
- t(1 token)) / (tokens - 1), the second pass of each kept, so the prefill cancels.

Engines, each in its own process on THREADS threads, alternated within each repeat:
  pagedserve          no speculation
  pagedserve-METHOD   --speculative-config SPEC, labelled by its method (default: ngram, k = 5, lookup 2..4)
  llama.cpp           llama-server, no speculation
  llama.cpp-<type>    llama-server --spec-type <type> (each of --llama-spec-types, default the n-gram types
                      for an ngram SPEC; the best is what to beat)
  llama.cpp-draft     llama-server with SPEC's draft model and k (only for a draft_model SPEC with a GGUF draft)
W1 (--w1-requests of `bench peer`'s W1, all at once): pagedserve with and without SPEC.

A draft_model SPEC with a GGUF draft (--spec '{"model": "DRAFT.gguf", "num_speculative_tokens": 3}') and the
target as --gguf runs llama.cpp with the same draft beside it (llama.cpp-draft).

    pagedserve bench spec-decode --repeats 2 --result-file benchmarks/results/spec_decode.jsonl
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from pagedserve.common.speculative import parse_speculative_config
from pagedserve.frontend.bench.peer.child import report, run_child
from pagedserve.frontend.bench.peer.engines import default_gguf, w1_requests
from pagedserve.frontend.bench.peer.llama_server import LlamaServer, find_llama_server
from pagedserve.frontend.bench.peer.llama_server import version as llama_version
from pagedserve.frontend.bench.results import append_result, run_metadata

RECORD = ", ".join(f'"{k}": "{v}"' for k, v in [
    ("id", "T-4471"), ("title", "Printer on floor 3 jams"), ("status", "open"), ("priority", "medium"),
    ("reporter", "Dana Ito"), ("assignee", "Sam Okafor"), ("created", "2026-11-02"), ("updated", "2026-11-20"),
    ("location", "Building B, room 312"), ("device", "LaserJet 4050"), ("serial", "CNB7Q01234"),
    ("category", "hardware"), ("sla", "48h"), ("notes", "Jams on duplex jobs; rollers replaced in March")])
PROMPTS = {
    "prose": "Repeat this paragraph exactly, but write 'beacon' instead of 'lighthouse':\n\nThe old lighthouse "
             "stood at the edge of the cliff, its white paint peeling after decades of storms. Every evening "
             "the keeper climbed the narrow stairs to light the lamp, and every morning he wrote a few lines in "
             "a worn leather book: the weather, the ships he had seen, and sometimes a thought about the sea. "
             "When he retired, the town kept the book in its small library, where children still read it on "
             "rainy afternoons and wonder what the keeper would have written about their own time. The "
             "lighthouse itself was sold to a family from the city, who painted it blue and rent its rooms to "
             "visitors in the summer.",
    "code": "Rewrite this function, renaming `out` to `result`, and change nothing else:\n\n"
            "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
            "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
            "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
            "    return out\n\n\ndef dedupe(items):\n    out = []\n    seen = set()\n    for item in items:\n"
            "        if item not in seen:\n            seen.add(item)\n            out.append(item)\n    return out\n",
    "list": "Repeat this shopping list, one item per line, numbered:\napples, pears, plums, flour, sugar, butter, "
            "eggs, milk, yoghurt, cheddar, bread, rice, lentils, chickpeas, tomatoes, onions, garlic, ginger, "
            "lemons, limes, coffee, tea, honey, oats, walnuts, almonds, spinach, carrots, potatoes, soap.",
    "record": "Return this JSON record unchanged except that status is \"closed\":\n{" + RECORD + "}",
}
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
LLAMA_DRAFT = "llama.cpp-draft"


def spec_engine(spec: dict[str, Any]) -> str:
    """pagedserve's speculative engine, labelled by the method it runs (method may be implied by a model)."""
    return f"pagedserve-{parse_speculative_config(spec).method}"


def llama_draft_args(spec: dict[str, Any]) -> tuple[str, ...] | None:
    """llama-server's flags for SPEC's draft model and k; None unless SPEC is draft_model with a GGUF draft."""
    cfg = parse_speculative_config(spec)
    if cfg.method != "draft_model" or not str(cfg.model).endswith(".gguf"):
        return None
    return ("--spec-type", "draft-simple", "--spec-draft-model", str(cfg.model),
            "--spec-draft-n-max", str(cfg.num_speculative_tokens))


def engine_names(spec: dict[str, Any], llama_spec_types: list[str] | None) -> list[str]:
    """The engines of one repeat; llama_spec_types None: llama.cpp's n-gram types for an ngram SPEC only."""
    if llama_spec_types is None:
        llama_spec_types = list(LLAMA_SPEC_TYPES) if parse_speculative_config(spec).method == "ngram" else []
    return (["pagedserve", spec_engine(spec), "llama.cpp"] + [f"llama.cpp-{t}" for t in llama_spec_types]
            + ([LLAMA_DRAFT] if llama_draft_args(spec) else []))


def prompt_ids(gguf: str) -> dict[str, list[int]]:
    from pagedserve.frontend.offline.llm import LLM
    with LLM(gguf, max_model_len=2048) as llm:
        tok = llm.get_tokenizer()
        return {name: list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
                for name, text in PROMPTS.items()}


def ms_per_token(generate: Callable[[list[int], int], int], ids: list[int], max_tokens: int) -> tuple[float, int]:
    """(ms per output token after the first, tokens of the full answer); the second pass of each kept."""
    times: dict[int, float] = {}
    tokens = 0
    for n in (1, max_tokens, 1, max_tokens):
        start = time.perf_counter()
        made = generate(ids, n)
        times[n] = time.perf_counter() - start
        if n == max_tokens:
            tokens = made
    return (times[max_tokens] - times[1]) / max(1, tokens - 1) * 1e3, tokens


def run_pagedserve(cfg: dict[str, Any], spec: dict[str, Any] | None) -> dict[str, Any]:
    from pagedserve.common.params.sampling_params import SamplingParams
    from pagedserve.frontend.offline.llm import LLM
    llm = LLM(cfg["gguf"], max_model_len=2048, speculative_config=spec)

    def generate(ids: list[int], n: int) -> int:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
        return len(out[0].outputs[0].token_ids)
    result = {name: ms_per_token(generate, ids, cfg["max_tokens"]) for name, ids in cfg["prompts"].items()}
    stats = llm.engine.scheduler.make_stats()
    out = {"single": result, "spec_num_drafts": stats.spec_num_drafts,
           "spec_num_draft_tokens": stats.spec_num_draft_tokens,
           "spec_num_accepted_tokens": stats.spec_num_accepted_tokens,
           "spec_accepted_per_pos": stats.spec_accepted_per_pos}
    if cfg["w1_requests"]:
        reqs = w1_requests({"num_requests": cfg["w1_requests"], "max_tokens": 0})
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
        out["w1_tok_s"] = sum(m for _, m in reqs) / (time.perf_counter() - start)
    llm.shutdown()
    return out


def run_llama(cfg: dict[str, Any], name: str, spec: dict[str, Any]) -> dict[str, Any]:
    if name == LLAMA_DRAFT:
        extra: tuple[str, ...] = llama_draft_args(spec) or ()
    else:
        extra = ("--spec-type", name.split("-", 1)[1]) if "-" in name else ()
    server = LlamaServer(cfg["llama_server"], cfg["gguf"], cfg["threads"], 1, 4096, extra_args=extra)
    drafts = {"draft_n": 0, "draft_n_accepted": 0}     # llama-server's own counts, summed over every call
    try:
        def generate(ids: list[int], n: int) -> int:
            out = server.generate(ids, n)
            for key in drafts:
                drafts[key] += int(out["timings"].get(key, 0))
            return int(out["tokens_predicted"])
        single = {prompt: ms_per_token(generate, ids, cfg["max_tokens"]) for prompt, ids in cfg["prompts"].items()}
        return {"single": single, **{f"llama_{k}": v for k, v in drafts.items()}}
    finally:
        server.stop()


def child_main(payload: str) -> None:
    """In the child (child.py): one pagedserve engine's runs, reported to the parent."""
    job = json.loads(payload)
    report(run_pagedserve(job["cfg"], job["spec"]))


def run_engine(name: str, cfg: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    if name.startswith("llama.cpp"):
        return run_llama(cfg, name, spec)
    job = {"cfg": cfg, "spec": spec if name == spec_engine(spec) else None}
    return run_child(__name__, json.dumps(job), cfg["threads"], name)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf", default=None, help="the GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--spec", default=None, help="pagedserve-METHOD's --speculative-config (default: ngram, k 5, "
                   "lookup 2..4)")
    p.add_argument("--llama-spec-types", nargs="*", default=None,
                   help=f"llama-server --spec-type runs (default for an ngram spec: {' '.join(LLAMA_SPEC_TYPES)})")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--w1-requests", type=int, default=64, help="0: no W1 runs")
    p.add_argument("--llama-cache", default=None)
    p.add_argument("--result-file", default=None)


def check_args(args: argparse.Namespace) -> None:
    """--spec parsed and checked as the engine will (ValueError, reported as a usage error), before anything
    is built or started."""
    try:
        args.spec_config = json.loads(args.spec) if args.spec else DEFAULT_SPEC
        if parse_speculative_config(args.spec_config) is None:
            raise ValueError("an empty config runs no speculation")
    except ValueError as exc:               # JSON's errors too
        raise ValueError(f"--spec: {exc}") from None
    for name in ("repeats", "threads", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def main(args: argparse.Namespace) -> None:
    binary = find_llama_server(args.llama_cache)
    gguf, spec = args.gguf or default_gguf(), args.spec_config     # check_args parsed --spec
    names = engine_names(spec, args.llama_spec_types)
    cfg = {"gguf": gguf, "threads": args.threads, "max_tokens": args.max_tokens, "w1_requests": args.w1_requests,
           "llama_server": binary, "prompts": prompt_ids(gguf)}
    info = {"llama_server_version": llama_version(binary), "gguf": gguf, "threads": args.threads, "spec": spec,
            "prompt_tokens": {k: len(v) for k, v in cfg["prompts"].items()}}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            result = run_engine(name, cfg, spec)
            result.update(engine=name, run=rep + 1)
            runs[name].append(result)
            ms = statistics.mean(v[0] for v in result["single"].values())
            print(f"{name:26s} run {rep + 1}: mean {ms:6.2f} ms/token "
                  + " ".join(f"{k} {v[0]:.2f} ({v[1]} tok)" for k, v in result["single"].items())
                  + (f"  W1 {result['w1_tok_s']:.1f} tok/s" if "w1_tok_s" in result else ""), flush=True)
            if args.result_file:
                meta = run_metadata("spec_decode", name, getattr(args, "command_line", None))
                append_result(args.result_file, {**meta, **info, **result})
    print_summary(runs, spec_engine(spec))


def print_summary(runs: dict[str, list[dict[str, Any]]], spec_name: str) -> None:
    def best_ms(name: str) -> float:
        return min(statistics.mean(v[0] for v in r["single"].values()) for r in runs[name])
    base, spec = best_ms("pagedserve"), best_ms(spec_name)
    llama_spec = {n: best_ms(n) for n in runs if n.startswith("llama.cpp-")}
    best_llama = min(llama_spec.values()) if llama_spec else best_ms("llama.cpp")
    method = spec_name.removeprefix("pagedserve-")
    print(f"\n{method} speed-up: {base / spec:.2f}x ({base:.2f} -> {spec:.2f} ms/token); llama.cpp without "
          f"speculation {best_ms('llama.cpp'):.2f}, its best speculative {best_llama:.2f} "
          f"({min(llama_spec, key=llama_spec.get) if llama_spec else '-'}): {spec_name} at "
          f"{spec / best_llama:.2f}x its ms/token")
    w1 = {n: max(r.get("w1_tok_s", 0) for r in runs[n]) for n in ("pagedserve", spec_name)}
    if w1["pagedserve"]:
        print(f"W1 with speculation on: {w1[spec_name] / w1['pagedserve']:.2f}x of off")
