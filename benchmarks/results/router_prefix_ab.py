"""Prefix-aware routing against round-robin through `pagedserve router` (issue 49), A/B alternated in one run.

Three engine-serve replicas of the embedded model, two routers over them (`--routing-logic prefix` and
`roundrobin`); each repeat sends the multi-turn chat workload of tests/helpers/processes/router_workload.py (fresh prompts
every run: nothing carries over) through one router, then the other, the order swapped every repeat. Per run:
the prefix-cache hit rate from the replicas' own vllm:prefix_cache_hits / queries, and the TTFT percentiles from
the streams. One line per run, and a summary line, are appended to benchmarks/results/router_prefix.jsonl.

    PYTHONPATH=.. python benchmarks/results/router_prefix_ab.py --repeats 3 [--conversations 4 --turns 4]
(from the repository root, where the package folder's parent is on the path)."""
from __future__ import annotations

import argparse
import os
import statistics

from pagedserve.frontend.bench.results import append_result, run_metadata
from pagedserve.tests.helpers.processes.router import Router
from pagedserve.tests.helpers.processes.router_workload import run_conversations
from pagedserve.tests.helpers.processes.server import API_KEY, Server

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "router_prefix.jsonl")
LOGICS = ("prefix", "roundrobin")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    if os.path.exists("/tmp/QUIET"):
        raise SystemExit("/tmp/QUIET exists: someone is timing; run later")
    replicas: list[Server] = []
    routers: dict[str, Router] = {}
    try:
        for _ in range(3):      # one after another: three loading at once on two shared cores took over 3 min
            replicas.append(Server("--kv-cache-memory", "0.5", "--max-num-seqs", "4", max_model_len=1024,
                                   startup_s=900))
        urls = [s.url for s in replicas]
        # Probes of 5 s, as the test's: a replica deep in a prefill on a loaded CPU answers /health late.
        for logic in LOGICS:
            routers[logic] = Router(*urls, routing=logic, backend_key=API_KEY,
                                    extra=("--health-check-interval", "5"))
        model = replicas[0].client().models.list().data[0].id
        run_conversations(routers["roundrobin"].client(), model, urls, salt="warm-up", conversations=3, turns=1)
        runs: dict[str, list] = {logic: [] for logic in LOGICS}
        for repeat in range(args.repeats):
            for logic in (LOGICS if repeat % 2 == 0 else LOGICS[::-1]):
                r = run_conversations(routers[logic].client(), model, urls, salt=f"bench-{repeat}-{logic}",
                                      conversations=args.conversations, turns=args.turns, max_tokens=args.max_tokens)
                runs[logic].append(r)
                ttfts = sorted(r.ttfts_s)
                line = {**run_metadata("router_prefix_ab", logic), "repeat": repeat, "routing_logic": logic,
                        "conversations": args.conversations, "turns": args.turns, "max_tokens": args.max_tokens,
                        "prefix_cache_hits": r.hits, "prefix_cache_queries": r.queries, "hit_rate": r.hit_rate,
                        "p50_ttft_ms": 1e3 * r.p50_ttft_s, "mean_ttft_ms": 1e3 * statistics.mean(ttfts),
                        "p90_ttft_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))]}
                append_result(RESULTS, line)
                print(f"repeat {repeat} {logic:10s} hit rate {r.hit_rate:.3f}  p50 TTFT {line['p50_ttft_ms']:.1f} ms  "
                      f"mean {line['mean_ttft_ms']:.1f} ms", flush=True)
        summary = {**run_metadata("router_prefix_ab", "summary"), "repeats": args.repeats}
        for logic in LOGICS:
            summary[f"{logic}_hit_rate"] = statistics.mean(r.hit_rate for r in runs[logic])
            summary[f"{logic}_p50_ttft_ms"] = 1e3 * statistics.median(t for r in runs[logic] for t in r.ttfts_s)
        summary["hit_rate_ratio"] = summary["prefix_hit_rate"] / max(summary["roundrobin_hit_rate"], 1e-9)
        summary["p50_ttft_ratio"] = summary["prefix_p50_ttft_ms"] / summary["roundrobin_p50_ttft_ms"]
        append_result(RESULTS, summary)
        print(summary)
    finally:
        for router in routers.values():
            router.stop()
        for server in replicas:
            server.stop()


if __name__ == "__main__":
    main()
