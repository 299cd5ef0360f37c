"""`engine-serve`: the OpenAI-compatible daemon, with `vllm serve`-style flags."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import stat
import sys

from pagedserve.common.config import EngineArgs
from pagedserve.frontend.tokenizer import load_chat_template

logger = logging.getLogger("pagedserve.serve")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine-serve", description="Serve a model over an OpenAI-compatible API.")
    p.add_argument("model_tag", nargs="?", default=None, help="model path (same as --model)")
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=float, default=None, help="KV cache size in GiB (CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder other than the model's own")
    p.add_argument("--chat-template", default=None,
                   help="chat template for /v1/chat/completions instead of the tokenizer's: a file or the "
                        "Jinja text itself")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, /version and the "
                        "API description (or env PAGEDSERVE_API_KEY)")
    p.add_argument("--engine-address", default=None,
                   help="where AsyncEngineClient.connect() reaches the engine core: ipc://PATH (default: a "
                        "private path) or tcp://HOST:PORT (needs a token; uses PORT and PORT+1)")
    p.add_argument("--engine-token", default=os.environ.get("PAGEDSERVE_ENGINE_TOKEN"),
                   help="secret clients must present to the engine core (or env PAGEDSERVE_ENGINE_TOKEN)")
    p.add_argument("--worker-heartbeat-timeout", type=float, default=30.0,
                   help="seconds a worker process may go without a heartbeat before the engine fails (TP > 1)")
    p.add_argument("--engine-heartbeat-timeout", type=float, default=30.0,
                   help="seconds the server may hear nothing from the engine core (it beats every second) "
                        "before it declares the core dead, ends open streams with an error and turns /health 503")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get HTTP 413")
    p.add_argument("--max-waiting-requests", type=int, default=4096,
                   help="new requests beyond this many waiting in the engine core (all clients) get HTTP 429")
    p.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="generation requests this server serves at once; beyond that HTTP 429 (default: no bound)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise ValueError("give the model once: positionally or with --model")
    return EngineArgs(
        model=ns.model or ns.model_tag, tokenizer=ns.tokenizer, served_model_name=ns.served_model_name,
        dtype=ns.dtype, seed=ns.seed,
        max_model_len=ns.max_model_len, block_size=ns.block_size, kv_cache_memory=ns.kv_cache_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization, enable_prefix_caching=ns.enable_prefix_caching,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        scheduling_policy=ns.scheduling_policy, tensor_parallel_size=ns.tensor_parallel_size,
        enforce_eager=ns.enforce_eager, worker_heartbeat_timeout=ns.worker_heartbeat_timeout,
        engine_heartbeat_timeout=ns.engine_heartbeat_timeout, max_waiting_requests=ns.max_waiting_requests)


def main(argv: list[str] | None = None) -> None:
    ns = make_parser().parse_args(argv)
    level = getattr(logging, ns.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.engine_address and ns.engine_address.startswith("tcp://") and not ns.engine_token:
        sys.exit("engine-serve: a tcp:// --engine-address requires --engine-token (or PAGEDSERVE_ENGINE_TOKEN)")
    if ns.max_concurrent_requests is not None and ns.max_concurrent_requests <= 0:
        sys.exit("engine-serve: --max-concurrent-requests must be a positive integer")
    if bool(ns.ssl_keyfile) != bool(ns.ssl_certfile):
        sys.exit("engine-serve: HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag in ("ssl_keyfile", "ssl_certfile"):
        if getattr(ns, flag) and not os.path.isfile(getattr(ns, flag)):
            sys.exit(f"engine-serve: --{flag.replace('_', '-')} {getattr(ns, flag)!r} is not a file")
    try:
        args = engine_args_from(ns)
        chat_template = load_chat_template(ns.chat_template) if ns.chat_template else None
    except ValueError as exc:
        sys.exit(f"engine-serve: {exc}")
    serve(args, ns, level, chat_template)


def serve(args: EngineArgs, ns: argparse.Namespace, level: int, chat_template: str | None) -> None:
    import uvicorn

    from pagedserve.frontend.api_server import ServerSettings, build_app
    from pagedserve.frontend.async_client import AsyncEngineClient
    from pagedserve.frontend.core_client import AsyncMPClient, CoreProcess

    # uvicorn re-raises the SIGTERM it handled once it has shut down; as an exception it unwinds through
    # the finally below (SIGINT already does), so the engine core and its ipc folder go too.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        proc = CoreProcess(args, level, address=ns.engine_address, token=ns.engine_token)
    except (RuntimeError, TimeoutError) as exc:     # the engine core could not start (bad flags, model): it said why
        sys.exit(f"engine-serve: {exc}")
    client = AsyncMPClient(proc.addresses, proc.token, proc, heartbeat_timeout_s=args.engine_heartbeat_timeout)
    engine = AsyncEngineClient(proc.info, client, chat_template)
    _announce(proc, bool(ns.engine_token))
    settings = ServerSettings(served_model_name=proc.info.served_model_name, api_key=ns.api_key,
                              max_body_bytes=ns.max_body_bytes,
                              max_concurrent_requests=ns.max_concurrent_requests)
    app = build_app(engine, settings)
    try:
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, loop="uvloop",
                    timeout_graceful_shutdown=10, ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile)
    finally:
        engine.shutdown()
        logger.info("engine-serve stopped")


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _announce(proc, token_given: bool) -> None:
    if token_given:
        logger.info("engine core at %s (token from --engine-token)", proc.addresses.input)
        return
    # A generated token is written to a private file, never to the log.
    path = os.path.join(proc.paths.root, "engine-token")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR), "w") as f:
        f.write(proc.token)
    logger.info("engine core at %s (token in %s)", proc.addresses.input, path)


if __name__ == "__main__":
    main()
