"""`pagedserve proxy --prefill URL --decode URL`: disaggregated prefill/decode over a shared KV folder
(docs/kv_tiers.md). Each request is prefilled on a prefill instance with max_tokens=1, whose KV reaches the
shared folder, then generated on a decode instance, which loads the prompt's KV from there."""
from __future__ import annotations

import argparse
import logging

from pagedserve.common.config.arg_utils import add_dataclass_args, dataclass_from
from pagedserve.frontend.disagg.args import DisaggProxyArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, DisaggProxyArgs)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for settings the proxy cannot start with."""
    dataclass_from(args, DisaggProxyArgs)


def main(args: argparse.Namespace) -> None:
    import uvicorn

    from pagedserve.frontend.disagg.app import build_proxy_app
    settings = dataclass_from(args, DisaggProxyArgs)
    logging.basicConfig(level=getattr(logging, settings.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_proxy_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                loop="uvloop", timeout_graceful_shutdown=10)
