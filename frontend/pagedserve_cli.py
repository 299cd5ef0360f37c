"""`pagedserve`: one command with vLLM's subcommands.

    pagedserve serve [engine-serve's flags]       the OpenAI-compatible server (the same as `engine-serve`)
    pagedserve chat | complete [-q TEXT]          interactive clients of a running server
    pagedserve router --backend URL ...           the fleet router over many replicas (frontend/router/)
    pagedserve proxy --prefill URL --decode URL   disaggregated prefill/decode over a shared KV folder
                                                  (frontend/disagg/)
    pagedserve bench serve | throughput | latency | peer | ladder | spec-decode | kernels | mm
                                                  benchmarks (frontend/bench/)

`serve` hands its arguments to engine-serve's own parser untouched, so the two never differ. Each subcommand
imports what it needs only when it runs: `pagedserve chat` loads no torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

# bench subcommand -> (module under pagedserve.frontend.bench, its help line). A module has add_cli_args(parser)
# and main(args), and may have check_args(args): flags that are wrong together or out of range raise ValueError
# there, reported as the subcommand's usage error before anything runs.
BENCHES: dict[str, tuple[str, str]] = {
    "serve": ("serve", "Load an OpenAI-compatible server over HTTP at given request rates (TTFT, TPOT, ITL, E2EL)."),
    "throughput": ("throughput", "Offline throughput of pagedserve's LLM (or HF transformers) on one set of requests."),
    "latency": ("latency", "Offline latency of one batch, per batch size (and decode ms per token)."),
    "peer": ("peer.cpu_peer", "llama.cpp's llama-server, HF transformers and pagedserve side by side on one GGUF "
                              "(CPU)."),
    "ladder": ("peer.ladder", "llama-server and pagedserve on a ladder of SmolLM2-shaped models (CPU, issue 25)."),
    "spec-decode": ("peer.spec_decode", "Speculative decoding against none and against llama-server's (CPU, "
                                        "issue 26)."),
    "mm": ("mm", "Image requests: throughput against HF, TTFT with a cached image, text TTFT beside large images "
                 "(issue 47)."),
    "kernels": ("gpu.kernels", "GPU kernel timings against their bandwidth and FLOP floors (--moe: the fused MoE)."),
}


def _bench_module(name: str) -> ModuleType:
    return importlib.import_module(f"pagedserve.frontend.bench.{name}")


def _usage_checker(module: Any, parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        try:
            module.check_args(args)
        except ValueError as exc:
            parser.error(str(exc))             # usage and message on stderr, exit 2, as argparse's own errors
    return check


def make_parser() -> argparse.ArgumentParser:
    from pagedserve.frontend import openai_clients
    parser = argparse.ArgumentParser(prog="pagedserve", description="pagedserve: serve, query and benchmark LLMs.")
    subs = parser.add_subparsers(dest="command", required=True, metavar="{serve,chat,complete,router,proxy,bench}")
    # Listed for --help only: main() passes `serve ...` to engine-serve before this parser sees it.
    subs.add_parser("serve", help="start the OpenAI-compatible server (engine-serve's flags)", add_help=False)
    chat = subs.add_parser("chat", help="chat with a running server", description="Chat with a running server.")
    openai_clients.add_chat_args(chat)
    chat.set_defaults(run=openai_clients.chat)
    complete = subs.add_parser("complete", help="complete prompts on a running server",
                               description="Complete prompts on a running server.")
    openai_clients.add_complete_args(complete)
    complete.set_defaults(run=openai_clients.complete)
    from pagedserve.frontend.disagg import main as proxy_main
    from pagedserve.frontend.router import main as router_main
    for name, module, text in (
            ("router", router_main, "route OpenAI requests over many replicas"),
            ("proxy", proxy_main, "disaggregated prefill/decode: prefill on one instance, decode on another")):
        sub = subs.add_parser(name, help=text, description=module.__doc__)
        module.COMMAND.add_cli_args(sub)
        sub.set_defaults(run=module.COMMAND.main, check=_usage_checker(module.COMMAND, sub))
    bench = subs.add_parser("bench", help="benchmarks", description="Benchmarks, shaped like vllm bench.")
    bench_subs = bench.add_subparsers(dest="bench", required=True)
    for name, (module_name, text) in BENCHES.items():
        module = _bench_module(module_name)
        sub = bench_subs.add_parser(name, help=text, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_cli_args(sub)
        sub.set_defaults(run=module.main, check=_usage_checker(module, sub) if hasattr(module, "check_args") else None)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed, and checked by the subcommand's check_args where it has one (SystemExit 2 if wrong)."""
    args = make_parser().parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:
        check(args)
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from pagedserve.frontend import cli
        cli.main(argv[1:])
        return
    args = parse_args(argv)
    args.command_line = ["pagedserve", *argv]        # what a results line says ran
    run: Callable[[argparse.Namespace], object] = args.run
    run(args)


if __name__ == "__main__":
    main()
