"""`pagedserve router --backend URL [--backend URL ...]`: the fleet router (docs/router.md)."""
from __future__ import annotations

import argparse
import logging

from pagedserve.common.config.arg_utils import add_dataclass_args, dataclass_from
from pagedserve.frontend.router.args import RouterArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, RouterArgs)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for settings the router cannot start with."""
    dataclass_from(args, RouterArgs)


def main(args: argparse.Namespace) -> None:
    import uvicorn

    from pagedserve.frontend.router.app import build_router_app
    settings = dataclass_from(args, RouterArgs)
    logging.basicConfig(level=getattr(logging, settings.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_router_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                loop="uvloop", timeout_graceful_shutdown=10)
