"""`engine-serve`: the OpenAI-compatible daemon, with `vllm serve`-style flags."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import stat
import sys

from pagedserve.common.config.arg_utils import dataclass_from, dataclass_parser
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.frontend.server_args import ServerArgs
from pagedserve.frontend.client.tokenizer import load_chat_template

logger = logging.getLogger("pagedserve.serve")


def make_parser() -> argparse.ArgumentParser:
    """Every flag comes from a field of EngineArgs or ServerArgs (common/config/arg_utils.py)."""
    p = dataclass_parser({"engine": EngineArgs, "server": ServerArgs}, prog="engine-serve",
                         description="Serve a model over an OpenAI-compatible API.")
    p.add_argument("model_tag", nargs="?", default=None, help="the model, as with --model")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[EngineArgs, ServerArgs]:
    """The settings the command line asks for; argparse exits on a usage error, a bad value is ValueError."""
    parser = make_parser()
    ns = parser.parse_args(argv)
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        parser.error("give the model once: positionally or with --model")
    return dataclass_from(ns, EngineArgs, model=ns.model or ns.model_tag), dataclass_from(ns, ServerArgs)


def check_flags(args: EngineArgs, server: ServerArgs) -> None:
    """The rules across flags, before anything starts (ValueError naming the flag); model files are the engine
    core's to check. engine-serve and the Ray Serve application both ask here."""
    args.validate()
    if (server.lora_modules or server.allow_runtime_lora_updating) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    from pagedserve.frontend.engine_launch import check_data_parallel_flags
    check_data_parallel_flags(args, server)


def main(argv: list[str] | None = None) -> None:
    try:
        args, server = parse_args(argv)
        level = getattr(logging, server.log_level.upper())
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        check_flags(args, server)
        chat_template = load_chat_template(server.chat_template) if server.chat_template else None
    except ValueError as exc:
        sys.exit(f"engine-serve: {exc}")
    serve(args, server, level, chat_template)


def serve(args: EngineArgs, server: ServerArgs, level: int, chat_template: str | None) -> None:
    import uvicorn

    from pagedserve.frontend.api_server import build_app
    from pagedserve.frontend.http.drain import DrainingServer
    from pagedserve.frontend.client.async_client import AsyncEngineClient
    from pagedserve.frontend.engine_launch import serve_headless, start_engines

    if server.headless:
        serve_headless(args, server, level)
        return
    # uvicorn re-raises the SIGTERM it handled once it has shut down; as an exception it unwinds through
    # the finally below (SIGINT already does), so the engine core and its ipc folder go too.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    procs, client = start_engines(args, server, level)
    proc = procs[0]
    engine = AsyncEngineClient(proc.info, client, chat_template, max_media_bytes=server.max_body_bytes)
    _announce(proc, bool(server.engine_token))
    app = build_app(engine, server, proc.info.served_model_name)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level, loop="uvloop",
                            timeout_graceful_shutdown=10, ssl_keyfile=server.ssl_keyfile,
                            ssl_certfile=server.ssl_certfile)
    try:
        DrainingServer(config, app.state.drain).run()
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
