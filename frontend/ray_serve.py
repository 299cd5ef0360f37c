"""pagedserve's OpenAI server as a Ray Serve application: what a KubeRay RayService's serveConfigV2 names.

    import_path: pagedserve.frontend.ray_serve:build_app
    args: {model: org/model, tensor-parallel-size: 2, distributed-executor-backend: ray}

`args` are engine-serve's flags (dashes or underscores; true for a switch), parsed by engine-serve's own parser.
Each Serve replica starts its engine core(s) as engine-serve does and answers with the same FastAPI routes;
Serve's proxy does the HTTP. Replicas are Ray Serve's data parallelism; Ray Serve is `pip install 'ray[serve]'`.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from ray import serve

from pagedserve.common.ray_utils import export_cluster_address

def flags_from_args(args: dict[str, Any]) -> list[str]:
    """serveConfigV2 args -> engine-serve argv (the model positionally): a value flag takes its value, a
    switch true or false (--x / --no-x; a plain switch false is its default, left out)."""
    from pagedserve.frontend.cli import make_parser
    actions = make_parser()._option_string_actions
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if key == "model":
            argv.insert(0, str(value))
        elif value is True:
            argv.append(flag)
        elif value is False:
            if f"--no-{flag[2:]}" in actions:
                argv.append(f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


@serve.deployment(name="PagedServe")
@serve.ingress()
class PagedServeDeployment:
    """Serve builds the app after the constructor (`__serve_build_asgi_app__`): the routes need the engine."""

    def __init__(self, argv: list[str]) -> None:
        from pagedserve.frontend.api_server import build_app as build_routes
        from pagedserve.frontend.client.async_client import AsyncEngineClient
        from pagedserve.frontend.client.tokenizer import load_chat_template
        from pagedserve.frontend.cli import check_flags, parse_args
        from pagedserve.frontend.engine_launch import start_engines
        args, server = parse_args(argv)
        check_flags(args, server)
        export_cluster_address()       # ranks placed on Ray (--distributed-executor-backend ray) join this cluster
        level = getattr(logging, server.log_level.upper())
        self.procs, client = start_engines(args, server, level)
        template = load_chat_template(server.chat_template) if server.chat_template else None
        self.engine = AsyncEngineClient(self.procs[0].info, client, template, max_media_bytes=server.max_body_bytes)
        self._routes = build_routes(self.engine, server, self.procs[0].info.served_model_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._routes

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_app(args: dict[str, Any]) -> serve.Application:
    """Ray Serve's application builder: refuses bad flags here, before any replica starts."""
    from pagedserve.frontend.cli import check_flags, parse_args
    argv = flags_from_args(args)
    try:
        engine_args, server_args = parse_args(argv)
    except SystemExit:       # argparse printed which flag it could not take
        raise ValueError(f"serveConfigV2 args are not engine-serve flags: {' '.join(argv)}") from None
    check_flags(engine_args, server_args)
    return PagedServeDeployment.bind(argv)
